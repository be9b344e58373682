"""A small harness for hostile-input tests against a real `psar server` process (#18).

- `HostileShard`: a real shard process (tests/fault_procs.Shard), initialised the way
  rank 0 initialises it (PSClient.init), with an in-process MIRROR: a ShardState holding
  the same job, values and incarnation. Every request sent to the real shard is also
  run on the mirror, through the servicer's own PushCall (the code both doors use;
  tests/hostile_wire.py), so after every request the real shard's Stats (state_digest,
  version, rounds, clocks) must equal the mirror's: both must refuse or accept the same
  requests, a refused one leaves no trace, an accepted one changes the state exactly as
  it should.
- The mutations, data-plane frames and the mirror's replay are in tests/hostile_wire.py;
  the per-request checks (`Campaign`) in tests/test_hostile.py.
- `Tally`: requests tried, crashes (the process died, a status UNKNOWN, or a traceback in
  the shard's log), state changes behind an error, doors disagreeing with the mirror, and
  the shard's peak RSS (VmHWM in /proc/PID/status); one summary line per test.

Everything is bounded: fixed seeds, fixed counts, a timeout on every call.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from psar.ps import auth, wire
from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.client.client_config import ClientConfig
from psar.ps.client.psclient import PSClient
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.shard import ShardState
from tests.fault_procs import Shard
from tests.hostile_wire import MAX_MESSAGE
from tests.ps_fixtures import init_values, make_job

SC = grpc.StatusCode
TIMEOUT = 30.0
"""Every call's deadline: generous, the machine may be loaded (nothing asserts a time)."""
HANDLER_THREADS = 16
"""The shard's --rpc-threads (gRPC handler pool: its threads stay once started)."""
PIECE_BYTES = 1024
"""Tensor bytes per gRPC message / data-plane piece of the valid pushes."""
# A small MLP's parameters, cut into several slots (as a worker's partition plan does).
PARAMS = [("fc1.weight", 32 * 64), ("fc1.bias", 64), ("fc2.weight", 64 * 10), ("fc2.bias", 10)]
_identity = lambda b: b  # noqa: E731 - raw bytes go out exactly as given


def hostile_job(mode: str = "async", num_workers: int = 2) -> Job:
    slots = plan_slots(PARAMS, 1, chunk_bytes=4096)
    return make_job(mode, num_workers=num_workers, optimizer="adamw", slots=slots,
                    job_id="hostile")  # fmt: skip


# ---- the shard process and its mirror -----------------------------------------------


def proc_status(pid: int, field_name: str) -> int:
    """A numeric field of /proc/PID/status (kB for memory fields); 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Tally:
    """What one hostile test did to its shard, and what the shard did about it."""

    name: str
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    crashes: int = 0
    behind_error: int = 0
    """Requests answered with an error that nonetheless changed the shard's state."""
    divergences: int = 0
    """Requests where the real shard and the mirror disagreed (accepted vs refused, or a
    different resulting state)."""
    codes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    peak_rss_mib: float = 0.0

    def note(self, what: str) -> None:
        if len(self.notes) < 20:
            self.notes.append(what[:500])

    def code(self, c: grpc.StatusCode | None) -> None:
        name = "OK" if c is None else c.name
        self.codes[name] = self.codes.get(name, 0) + 1

    def line(self) -> str:
        return (
            f"hostile[{self.name}]: requests tried {self.tried}, crashes {self.crashes}, "
            f"state changes behind an error {self.behind_error}, "
            f"mirror divergences {self.divergences}, refused {self.refused}, "
            f"accepted {self.accepted}, peak shard RSS {self.peak_rss_mib:.1f} MiB, "
            f"codes {dict(sorted(self.codes.items()))}"
        )


class HostileShard:
    """A real `psar server` process, initialised as rank 0 does it, and its mirror."""

    def __init__(
        self,
        tmp: Path,
        *,
        mode: str = "async",
        extra: tuple[str, ...] = (),
        max_message: int = MAX_MESSAGE,
        token: str = "",
        certs: Path | None = None,
        sealed: bool = False,
        exact_fp16_sum: bool = ServerConfig.exact_fp16_sum,
    ) -> None:
        self.tmp = tmp
        self.exact_fp16_sum = exact_fp16_sum
        """The shard's --exact-fp16-sum (sync rounds of fp16 pushes summed exactly as they
        arrive); its mirror sums the same way."""
        extra = (*extra, "--exact-fp16-sum" if exact_fp16_sum else "--no-exact-fp16-sum")
        self.job = hostile_job(mode)
        self.values = init_values(self.job, seed=3)
        self.token = token
        self.ca = str(certs / "ca.pem") if certs is not None else ""
        """With `certs` (tests/test_security.py's fixture): a TLS shard; every data-plane
        request then travels inside TLS, and with `sealed` in sealed records after its
        hello (the shard's --data-sealed-records): the same bytes, the other wire."""
        self.sealed = sealed
        self.sealed_exchanges = 0
        """Requests whose bytes did travel in sealed records (the shard agreed)."""
        if token:
            (tmp / "token").write_text(token)
            extra = (*extra, "--auth-token-file", str(tmp / "token"))
        if certs is not None:
            extra = (*extra, "--tls-cert", str(certs / "server.pem"),
                     "--tls-key", str(certs / "server.key"))  # fmt: skip
            if sealed:
                extra = (*extra, "--data-sealed-records")
        self.proc = Shard(
            0, tmp, "--lease-s", "3600", "--join-grace-s", "3600",
            "--rpc-threads", str(HANDLER_THREADS),
            "--max-message-bytes", str(max_message), "--message-bytes", str(max_message // 4),
            *extra,
        )  # fmt: skip
        self.channel: grpc.Channel | None = None
        self._log_seen = 0

    def start(self) -> HostileShard:
        self.proc.start()
        self.address = self.proc.address
        self.channel = auth.make_channel(self.address, [], token=self.token, tls_ca=self.ca)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        with self.client(0, "grpc") as c:  # rank 0's init, through the worker's client
            c.get_jobs(wait=False)
            c.init([self.job], self.values)
        reply = self.stub.GetJob(pb.GetJobRequest(), timeout=TIMEOUT)
        self.data_port = reply.data_port
        self.incarnation = reply.incarnation
        self.mirror = ShardState(lease_s=3600, join_grace_s=3600,
                                 exact_fp16_sum=self.exact_fp16_sum)  # fmt: skip
        self.mirror.init(self.job, {k: v.clone() for k, v in self.values.items()})
        self.mirror.incarnation = self.incarnation  # pushes may name the real one
        self._log_seen = len(self.proc.output())
        return self

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.proc.stop()

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    def alive(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is None

    def peak_rss_mib(self) -> float:
        return proc_status(self.pid, "VmHWM") / 1024

    def rss_mib(self) -> float:
        return proc_status(self.pid, "VmRSS") / 1024

    def threads(self) -> int:
        return proc_status(self.pid, "Threads")

    def settled_threads(self, quiet_s: float = 1.0, timeout: float = 30.0) -> int:
        """The shard's thread count once it has not changed for `quiet_s`: the threads of
        connections closed just before (a loaded machine ends them late) are gone."""
        last, since = self.threads(), time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.threads()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def threads_back_to(self, base: int) -> bool:
        """Whether the shard's threads are back near `base`: a connection's thread is
        gone once it closed; the gRPC handler pool may have grown to its size meanwhile."""
        return self.threads() <= base + HANDLER_THREADS + 4

    def new_tracebacks(self) -> list[str]:
        """Unhandled exceptions the shard logged since the last call."""
        text = self.proc.output()
        fresh, self._log_seen = text[self._log_seen :], len(text)
        return [_exception_line(fresh[i:]) for i in _find_all(fresh, "Traceback (most")]

    def client(self, worker: int, door: str) -> PSClient:
        cfg = ClientConfig(timeout_s=TIMEOUT, retry_timeout_s=TIMEOUT, data_plane=door,
                           message_bytes=PIECE_BYTES, auth_token=self.token,
                           tls_ca=self.ca)  # fmt: skip
        c = PSClient([self.address], worker=worker, cfg=cfg)
        c.set_slots(self.job.slots)
        return c

    def exchange(self, data: bytes) -> list[pb.DataFrame]:
        """`exchange` over this shard's wire: plaintext, TLS, or TLS then sealed records."""
        if not self.ca:
            return exchange(self.data_port, data)
        replies, sealed = secure_exchange(self.data_port, data, self.ca, self.sealed)
        self.sealed_exchanges += sealed
        return replies

    def trace(self) -> tuple:
        """Everything a request could change (Stats): digest, version, rounds, clocks."""
        s = self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
        return (s.state_digest, s.version, s.rounds, s.updates_applied, tuple(s.worker_clocks))

    def mirror_trace(self) -> tuple:
        m = self.mirror.stats()
        return (m["state_digest"], m["version"], m["rounds"], m["updates_applied"],
                tuple(m["worker_clocks"]))  # fmt: skip

    def next_push(self, worker: int) -> tuple[int, int]:
        """(clock, base_version) of the push `worker` would send next (sync: the open
        round's, even when the worker pushed it already: then it is a duplicate)."""
        if self.job.mode == "sync":
            return self.mirror.rounds + 1, self.mirror.version
        return self.mirror.clocks[worker] + 1, self.mirror.version

    def round_wire(self) -> tuple[torch.dtype, float]:
        """(dtype, loss scale) a valid push into the open round carries: fp32 unscaled,
        or, once an fp16 push into a round summed exactly was accepted, fp16 at that
        push's loss scale (such a round refuses other dtypes and scales)."""
        policy = self.mirror.policy
        exact = getattr(policy, "exact", None)
        if getattr(policy, "kind", None) == "exact" and exact is not None and exact.scale:
            return torch.float16, exact.scale
        return torch.float32, 1.0

    def pull_clock(self, worker: int) -> int:
        """A clock `worker` may pull at without waiting."""
        return self.mirror.rounds if self.job.mode == "sync" else self.mirror.clocks[worker]

    def fresh_worker(self, worker: int) -> int:
        """`worker`, or (sync) the other one when `worker` already pushed the open round:
        a control push must change the state."""
        if self.job.mode == "sync" and self.mirror.clocks[worker] > self.mirror.rounds:
            return 1 - worker
        return worker


@contextlib.contextmanager
def hostile_shard(tmp: Path, **kw: Any) -> Iterator[HostileShard]:
    s = HostileShard(tmp, **kw)
    try:
        yield s.start()
    finally:
        s.close()


def _exception_line(tb: str) -> str:
    """The exception a traceback ends with (its first unindented line after the header),
    and the innermost psar frame that raised it."""
    lines = tb.splitlines()
    where = ""
    for line in lines[1:]:
        if line.startswith("  File") and "/ps/" in line:
            where = line.strip()
        elif not line.startswith(" "):
            return f"{line} ({where})" if where else line
    return lines[0] if lines else ""


def _find_all(text: str, word: str) -> list[int]:
    out, i = [], text.find(word)
    while i >= 0:
        out.append(i)
        i = text.find(word, i + 1)
    return out


# ---- valid requests ------------------------------------------------------------------


def gradient(job: Job, rng: random.Random) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return {s.key: 0.05 * torch.randn(s.numel, generator=g) for s in job.slots}


DTYPES = {pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16}
WIRE_OF = {t: w for w, t in DTYPES.items()}


def valid_push(s: HostileShard, worker: int, rng: random.Random) -> list[pb.PushChunk]:
    """A push `worker` could send next: header, pieces of every slot, maybe a verdict."""
    clock, version = s.next_push(worker)
    dtype = rng.choice([pb.FLOAT32, pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16])
    streamed = rng.random() < 0.3
    head = pb.PushHeader(
        worker=worker, clock=clock, base_version=version, dtype=dtype,
        loss_scale=rng.choice([1.0, 1.0, 1024.0]), verdict_follows=streamed,
        incarnation=rng.choice([0, s.incarnation]),
    )  # fmt: skip
    out = [pb.PushChunk(header=head)]
    for key, t in gradient(s.job, rng).items():
        flat = (t * head.loss_scale).to(DTYPES[dtype]).contiguous()
        for off, data in wire.iter_pieces(flat, PIECE_BYTES):
            out.append(pb.PushChunk(data=pb.TensorData(key=key, offset=off, data=data)))
    if streamed:
        out.append(pb.PushChunk(verdict=pb.PushVerdict(overflow=False)))
    return out


def data_conn(port: int, timeout: float = TIMEOUT) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def exchange(port: int, data: bytes, timeout: float = TIMEOUT) -> list[pb.DataFrame]:
    """Send `data` on a fresh data-plane connection, half-close, and read every frame the
    shard answers until it closes (or `timeout`)."""
    replies: list[pb.DataFrame] = []
    with data_conn(port, timeout) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        scratch = fr.Scratch()
        with contextlib.suppress(OSError, fr.ConnectionClosed, fr.FramingError):
            while True:
                f, plen = fr.read_header(sock, max_payload_bytes=1 << 30, scratch=scratch)
                if plen:
                    fr.recv_payload(sock, plen, scratch)
                replies.append(f)
    return replies


def secure_exchange(
    port: int, data: bytes, ca: str, sealed: bool
) -> tuple[list[pb.DataFrame], bool]:
    """`exchange` inside TLS. With `sealed`: when `data` opens with a hello frame, that
    hello asks for sealed records (a share added); if the shard agrees (its OK carries
    its share), the rest of `data` goes in sealed records and ends with the close record
    (the sealed form of a half-close). Otherwise the bytes go as they are, inside TLS,
    and the TCP half-close ends them. Returns the replies and whether it sealed."""
    from psar.ps import sealed as sl
    from psar.ps.client.tcp_transport import client_ssl_context

    replies: list[pb.DataFrame] = []
    scratch = fr.Scratch()

    def read_all(sock: socket.socket) -> None:
        with contextlib.suppress(OSError, fr.ConnectionClosed, fr.FramingError):
            while True:
                f, plen = fr.read_header(sock, max_payload_bytes=1 << 30, scratch=scratch)
                if plen:
                    fr.recv_payload(sock, plen, scratch)
                replies.append(f)

    raw = data_conn(port)
    tls = client_ssl_context(ca).wrap_socket(raw, server_hostname="127.0.0.1")
    with tls:
        hello, rest = _leading_hello(data) if sealed else (None, data)
        if hello is not None:
            share = sl.new_share()
            hello.hello.seal_share = share
            with contextlib.suppress(OSError):
                tls.sendall(fr.encode(hello))
            try:
                answer, _ = fr.read_header(tls, max_payload_bytes=0, scratch=scratch)
            except (OSError, fr.ConnectionClosed, fr.FramingError):
                return replies, False
            replies.append(answer)
            if answer.status.code != 0 or not answer.status.seal_share:
                read_all(tls)
                return replies, False
            up, down = sl.derive_keys(share, bytes(answer.status.seal_share))
            sock = sl.seal(tls, up, down)
            with sock:
                with contextlib.suppress(OSError):
                    sock.sendall(rest)
                    sock.send_close()
                    socket.socket.shutdown(sock, socket.SHUT_WR)
                read_all(sock)
            return replies, True
        with contextlib.suppress(OSError):
            tls.sendall(rest)
            socket.socket.shutdown(tls, socket.SHUT_WR)
        read_all(tls)
    return replies, False


def _leading_hello(data: bytes) -> tuple[pb.DataFrame | None, bytes]:
    """(the hello frame `data` opens with, the bytes after it), or (None, data)."""
    if len(data) < fr.PREFIX.size:
        return None, data
    magic, hlen, plen = fr.PREFIX.unpack_from(data)
    end = fr.PREFIX.size + hlen
    if magic != fr.MAGIC or plen or end > len(data):
        return None, data
    f = pb.DataFrame()
    try:
        f.ParseFromString(data[fr.PREFIX.size : end])
    except Exception:  # noqa: BLE001 - not a frame: sent as it is
        return None, data
    if f.WhichOneof("kind") != "hello" or f.hello.seal_share:
        return None, data
    return f, data[end:]


def refusal(replies: list[pb.DataFrame]) -> grpc.StatusCode | None:
    """The first non-OK status among a connection's replies (None: none)."""
    for f in replies:
        if f.HasField("status") and f.status.code != 0:
            return fr.CODE_BY_NUMBER.get(f.status.code, SC.UNKNOWN)
    return None


def wait_for(what: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return False
