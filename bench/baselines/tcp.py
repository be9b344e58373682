"""Raw loopback TCP baseline: how fast plain Python sockets move N bytes one way.

The yardstick the other benchmarks divide by ("ratio to raw TCP"). The receiver is a
separate process (this file run as a script, stdlib only), so sender and receiver
never share a GIL; the sender `sendall`s from one preallocated buffer, the receiver
`recv_into`s one preallocated buffer and answers one byte when it has everything.

Protocol on one connection, per transfer: the sender announces the size (8 bytes,
big-endian), the receiver allocates (outside the timing) and answers b"r"; the clock
starts, the payload goes, the receiver answers b"k" and the clock stops. Size 0 ends.

    from bench.baselines.tcp import TcpSink
    with TcpSink() as sink:
        times = sink.time_transfers(64 << 20, repeats=5)   # seconds, one per repeat

    python -m bench.baselines.tcp --sizes 16,64,256 --repeats 5    # a table on its own

The receiver runs under worker/supervisor.py's Supervisor, as every process the
benchmarks start (its one line of output goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psar.worker.supervisor import Supervisor

MIB = 1 << 20
_HELLO = "tcp sink listening on port "
_SIZE = struct.Struct("!Q")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        out += chunk
    return bytes(out)


def _sink_main() -> int:
    """The receiving process: accept one connection and receive until told to stop."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        print(f"{_HELLO}{ls.getsockname()[1]}", flush=True)
        conn, _ = ls.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(0)
        while True:
            (n,) = _SIZE.unpack(_recv_exact(conn, _SIZE.size))
            if n == 0:
                return 0
            if len(buf) != n:
                buf = bytearray(n)
            view = memoryview(buf)
            conn.sendall(b"r")
            got = 0
            while got < n:
                r = conn.recv_into(view[got:], n - got)
                if r == 0:
                    raise ConnectionError("sender closed mid-transfer")
                got += r
            conn.sendall(b"k")


class TcpSink:
    """A receiver process on loopback and one connection to it; a context manager."""

    def __init__(self, *, start_timeout_s: float = 30.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.sup: Supervisor | None = None
        self.sock: socket.socket | None = None
        self._buf = bytearray(0)

    def __enter__(self) -> TcpSink:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        from psar.worker.supervisor import Supervisor  # here: the sink itself runs on stdlib only

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.sup = Supervisor(out=sys.stderr, env=env, grace=10.0)
        self.sup.start("tcp-sink", [sys.executable, str(Path(__file__).resolve()), "--sink"])
        hello = re.compile(re.escape(_HELLO) + r"(\d+)")
        port = int(self.sup.wait_line("tcp-sink", hello, self.start_timeout_s).group(1))
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def time_transfers(
        self,
        nbytes: int,
        repeats: int,
        *,
        warmup: int = 1,
        before_each: Callable[[], object] | None = None,
    ) -> list[float]:
        """Seconds per one-way transfer of `nbytes`, one entry per repeat (after warm-up).

        before_each() runs before every transfer, outside the timing (e.g. to wait for
        a quiet machine)."""
        if self.sock is None:
            raise RuntimeError("TcpSink not started")
        if nbytes <= 0 or repeats < 1 or warmup < 0:
            raise ValueError("nbytes and repeats must be >= 1, warmup >= 0")
        if len(self._buf) != nbytes:
            # bytes * n writes every page, so the kernel copies real memory (a fresh
            # zeroed bytearray would be backed by the shared zero page).
            self._buf = bytearray(b"\x5a") * nbytes
        view = memoryview(self._buf)
        times = []
        for i in range(warmup + repeats):
            self.sock.sendall(_SIZE.pack(nbytes))
            if _recv_exact(self.sock, 1) != b"r":
                raise RuntimeError("tcp sink: protocol error")
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            self.sock.sendall(view)
            if _recv_exact(self.sock, 1) != b"k":
                raise RuntimeError("tcp sink: protocol error")
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
        return times

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.sendall(_SIZE.pack(0))
            except OSError:
                pass
            self.sock.close()
            self.sock = None
        if self.sup is not None:
            self.sup.stop()  # the sink has exited on the size 0 by now, or is stopped
            self.sup = None


@dataclass
class TcpResult:
    payload_mib: float
    tcp_gbps: float
    """Payload bytes / median transfer time, in GB/s (1e9 bytes per second)."""
    tcp_gbps_min: float
    tcp_gbps_max: float
    repeats: int


def measure_tcp(
    sink: TcpSink,
    payload_mib: float,
    repeats: int,
    *,
    warmup: int = 1,
    before_each: Callable[[], object] | None = None,
) -> TcpResult:
    """One-way raw TCP throughput for a payload of `payload_mib` MiB (median of repeats)."""
    nbytes = int(payload_mib * MIB)
    times = sink.time_transfers(nbytes, repeats, warmup=warmup, before_each=before_each)
    return TcpResult(
        payload_mib=payload_mib,
        tcp_gbps=nbytes / statistics.median(times) / 1e9,
        tcp_gbps_min=nbytes / max(times) / 1e9,
        tcp_gbps_max=nbytes / min(times) / 1e9,
        repeats=repeats,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64,256", help="payload sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per size")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sink:
        return _sink_main()
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    with TcpSink() as sink:
        results = [measure_tcp(sink, s, args.repeats) for s in sizes]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"raw loopback TCP, one way, median of {args.repeats} (pid {os.getpid()})")
        print(f"{'MiB':>8} {'GB/s':>8} {'min':>8} {'max':>8}")
        for r in results:
            print(
                f"{r.payload_mib:>8g} {r.tcp_gbps:>8.2f} {r.tcp_gbps_min:>8.2f} "
                f"{r.tcp_gbps_max:>8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
