"""What each wire of the data plane costs in CPU: seconds per GiB at each end.

Two processes on this machine, a sender and a receiver, move `--gib` GiB in data-plane
piece frames of `--frame-mib` MiB through psar.ps.framing as a push does: the sender sets its
timeout and fr.send-s each frame (header and payload); the receiver reads them as the
shard does (fr.read_header under a FrameClock, then fr.recv_exact under the frame's
deadline straight into a reused buffer), over each wire:

- tcp:       plain TCP (sendmsg / recv_into);
- sslsocket: standard TLS, the data plane's default: Python's ssl.SSLSocket (OpenSSL on
             the socket, one 16 KiB record per read);
- sealed:    psar's opt-in sealed records after a TLS hello (ps/sealed.py).

TLS uses the data plane's own contexts (server_ssl_context, client_ssl_context) with a
throwaway CA (openssl CLI). Each process counts its own CPU time (user + system,
time.process_time) over the measured bytes only (handshake and two warm-up frames left
out); the sender's count ends when the receiver acknowledges the last byte. Wires are
alternated within each repeat; the table gives the median of the repeats and, in
brackets, the best (least CPU: on a shared machine other processes only add to it); the
ratios are medians against tcp's of the same run, and the load average is printed
(compare ratios, not absolute figures, across runs).

    python -m bench.experiments.tls_cost --gib 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb

WIRES = ("tcp", "sslsocket", "sealed")
WARMUP_FRAMES = 2


def pattern(frame_mib: int) -> bytearray:
    """The payload of every frame (the receiver checks the last one it got)."""
    return bytearray(range(256)) * (frame_mib << 12)


def _server_side(sock: socket.socket, wire: str, certs: dict[str, str]) -> socket.socket:
    from psar.ps import sealed
    from psar.ps.server.doors.dataplane import server_ssl_context

    if wire == "tcp":
        return sock
    ctx = server_ssl_context(certs["cert"], certs["key"])
    tls = ctx.wrap_socket(sock, server_side=True)
    if wire == "sslsocket":
        return tls
    theirs = bytearray(sealed.SHARE_BYTES)
    fr.recv_exact(tls, memoryview(theirs))
    mine = sealed.new_share()
    tls.sendall(mine)
    up, down = sealed.derive_keys(bytes(theirs), mine)
    return sealed.seal(tls, down, up)


def _client_side(sock: socket.socket, wire: str, certs: dict[str, str]) -> socket.socket:
    from psar.ps import sealed
    from psar.ps.client.tcp_transport import client_ssl_context

    if wire == "tcp":
        return sock
    ctx = client_ssl_context(certs["ca"])
    tls = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    if wire == "sslsocket":
        return tls
    mine = sealed.new_share()
    tls.sendall(mine)
    theirs = bytearray(sealed.SHARE_BYTES)
    fr.recv_exact(tls, memoryview(theirs))
    up, down = sealed.derive_keys(mine, bytes(theirs))
    return sealed.seal(tls, up, down)


def _describe(sock: socket.socket) -> str:
    version = getattr(sock, "version", None)
    cipher = getattr(sock, "cipher", None)
    if version is None or cipher is None:
        return ""
    return f"{version()} {cipher()[0]}"


def receive(args: argparse.Namespace) -> dict[str, Any]:
    certs = json.loads(args.certs)
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    raw, _ = listener.accept()
    raw.settimeout(120)
    fr.tune(raw)
    sock = _server_side(raw, args.wire, certs)
    sock.settimeout(120)
    what = _describe(sock)
    buf = bytearray(args.frame_mib << 20)
    scratch = fr.Scratch()
    frames = int(args.gib * 1024 / args.frame_mib)
    cpu0 = wall0 = 0.0
    clock = fr.FrameClock(idle_s=120, frame_s=120)  # as the shard reads a push's pieces
    for i in range(WARMUP_FRAMES + frames):
        if i == WARMUP_FRAMES:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        frame, plen = fr.read_header(sock, max_payload_bytes=len(buf), scratch=scratch,
                                     clock=clock)  # fmt: skip
        assert frame.WhichOneof("kind") == "piece", frame
        fr.recv_exact(sock, memoryview(buf)[:plen], deadline=clock.deadline)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if buf != pattern(args.frame_mib):
        raise AssertionError(f"{args.wire}: the bytes received are not the bytes sent")
    fr.send(sock, pb.DataFrame(end=pb.DataEnd()))
    sock.close()
    return {"cpu_s": cpu, "wall_s": wall, "bytes": frames * len(buf), "tls": what}


def send(args: argparse.Namespace) -> dict[str, Any]:
    certs = json.loads(args.certs)
    raw = socket.create_connection(("127.0.0.1", args.port), timeout=120)
    fr.tune(raw)
    sock = _client_side(raw, args.wire, certs)
    sock.settimeout(120)
    payload = memoryview(pattern(args.frame_mib))
    frames = int(args.gib * 1024 / args.frame_mib)
    piece = pb.DataFrame(piece=pb.DataPiece(key="w", offset=0))
    cpu0 = wall0 = 0.0
    for i in range(WARMUP_FRAMES + frames):
        if i == WARMUP_FRAMES:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        sock.settimeout(120)  # as both ends do before each frame they send
        fr.send(sock, piece, payload)
    frame, _ = fr.read_header(sock, max_payload_bytes=0, scratch=fr.Scratch())
    assert frame.WhichOneof("kind") == "end", frame
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    sock.close()
    return {"cpu_s": cpu, "wall_s": wall, "bytes": frames * len(payload)}


def run_pair(wire: str, args: argparse.Namespace, certs: dict[str, str]) -> dict[str, Any]:
    """One transfer over `wire` between two fresh processes: both ends' figures."""
    base = [sys.executable, "-m", "bench.experiments.tls_cost", "--wire", wire,
            "--gib", str(args.gib), "--frame-mib", str(args.frame_mib),
            "--certs", json.dumps(certs)]  # fmt: skip
    rx = subprocess.Popen([*base, "--role", "recv"], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        port = int(rx.stdout.readline())
        tx = subprocess.run([*base, "--role", "send", "--port", str(port)],
                            capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
        out, _ = rx.communicate(timeout=600)
    finally:
        if rx.poll() is None:
            rx.kill()
    if rx.returncode:
        raise RuntimeError(f"{wire}: the receiver failed ({rx.returncode})")
    r, s = json.loads(out.strip().splitlines()[-1]), json.loads(tx.stdout.strip().splitlines()[-1])
    gib = r["bytes"] / (1 << 30)
    return {"wire": wire, "send_s_per_gib": s["cpu_s"] / gib, "recv_s_per_gib": r["cpu_s"] / gib,
            "gb_per_s": r["bytes"] / r["wall_s"] / 1e9, "tls": r["tls"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per transfer")
    p.add_argument("--frame-mib", type=int, default=4, help="MiB of payload per frame")
    p.add_argument("--repeats", type=int, default=3, help="transfers per wire (alternated)")
    p.add_argument("--wires", default=",".join(WIRES), help=f"comma-separated, of {WIRES}")
    p.add_argument("--json", default="", help="also write every transfer's figures here")
    p.add_argument("--role", choices=("recv", "send"), help=argparse.SUPPRESS)
    p.add_argument("--wire", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--certs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        print(json.dumps((receive if args.role == "recv" else send)(args)), flush=True)
        return 0
    wires = [w.strip() for w in args.wires.split(",") if w.strip()]
    if bad := [w for w in wires if w not in WIRES]:
        p.error(f"--wires: unknown {bad}; accepted: {', '.join(WIRES)}")
    if args.gib <= 0 or args.frame_mib < 1 or args.repeats < 1:
        p.error("--gib > 0, --frame-mib >= 1 and --repeats >= 1")
    from bench.step_throughput import make_certs

    load0 = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        certs = make_certs(Path(d))
        for rep in range(args.repeats):
            for wire in wires if rep % 2 == 0 else wires[::-1]:
                runs.append(run_pair(wire, args, certs))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    keys = ("send_s_per_gib", "recv_s_per_gib", "gb_per_s")
    med = {w: {k: statistics.median(r[k] for r in runs if r["wire"] == w) for k in keys}
           for w in wires}  # fmt: skip
    best = {w: {k: min(r[k] for r in runs if r["wire"] == w) for k in keys} for w in wires}
    print(f"{args.gib:g} GiB in {args.frame_mib} MiB frames, {args.repeats} repeats: median "
          f"(best); load average {load0[0]:.1f} before, {load1[0]:.1f} after, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print("| wire | send CPU s/GiB | receive CPU s/GiB | x tcp (send / receive) | GB/s | TLS |")
    print("|---|---|---|---|---|---|")
    tcp = med.get("tcp")
    for w in wires:
        m, b = med[w], best[w]
        ratio = (f"{m['send_s_per_gib'] / tcp['send_s_per_gib']:.2f} / "
                 f"{m['recv_s_per_gib'] / tcp['recv_s_per_gib']:.2f}") if tcp else "-"  # fmt: skip
        tls = next(r["tls"] for r in runs if r["wire"] == w) or "-"
        print(f"| {w} | {m['send_s_per_gib']:.2f} ({b['send_s_per_gib']:.2f}) | "
              f"{m['recv_s_per_gib']:.2f} ({b['recv_s_per_gib']:.2f}) | {ratio} | "
              f"{m['gb_per_s']:.2f} | {tls} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": med, "best": best,
                                               "load": [load0, load1]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
