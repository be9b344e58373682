"""Emulated hosts for the benchmarks: network namespaces on a bridge (tests/netns.py)
whose NICs tc shapes both ways, and what a link between two of them carries (raw TCP
goodput and round trip). bench/links.py, bench/lib/grid.py, bench/experiments/cpu_rate.py and
bench/experiments/local_sgd.py run their jobs on them."""

from __future__ import annotations

import json
import re

from bench.lib import common as c

_PORT = re.compile(r"nettool port (\d+)")
_NETTOOL = r"""
import json, socket, statistics, struct, sys, time
mode, host = sys.argv[1], sys.argv[2]
def recv_exact(s, n):
    buf = bytearray(n); view = memoryview(buf); got = 0
    while got < n:
        r = s.recv_into(view[got:], n - got)
        if not r: raise ConnectionError("closed")
        got += r
    return buf
if mode == "serve":
    ls = socket.socket(); ls.bind((host, 0)); ls.listen(1)
    print("nettool port", ls.getsockname()[1], flush=True)
    s, _ = ls.accept(); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (cmd := recv_exact(s, 1)) != b"x":
        if cmd == b"p": s.sendall(b"q")
        else: recv_exact(s, struct.unpack("!Q", recv_exact(s, 8))[0]); s.sendall(b"k")
else:
    s = socket.create_connection((host, int(sys.argv[3])), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtt = []
    for _ in range(200):
        t = time.perf_counter(); s.sendall(b"p"); recv_exact(s, 1); rtt.append(time.perf_counter() - t)
    n = int(sys.argv[4]); payload = bytearray(b"z") * n; gbps = []
    for _ in range(int(sys.argv[5]) if len(sys.argv) > 5 else 3):
        t = time.perf_counter(); s.sendall(b"b" + struct.pack("!Q", n)); s.sendall(payload)
        recv_exact(s, 1); gbps.append(n / (time.perf_counter() - t) / 1e9)
    s.sendall(b"x")
    print(json.dumps({"rtt_us": 1e6 * statistics.median(rtt), "gbps": statistics.median(gbps),
                      "gbps_best": max(gbps)}))
"""


def probe_link(sup: c.Supervisor, src, dst, nbytes: int, repeats: int = 3) -> dict:  # noqa: ANN001
    """Median small-message RTT and one-way raw TCP GB/s (median and best of `repeats`
    transfers) from host src to host dst."""
    sup.start("nettool", c.on(dst, [c.PY, "-c", _NETTOOL, "serve", dst.addr]))
    port = sup.wait_line("nettool", _PORT, 60).group(1)
    argv = [c.PY, "-c", _NETTOOL, "send", dst.addr, port, str(nbytes), str(repeats)]
    p = src.run(argv, timeout=300)
    sup.wait(["nettool"], 30)
    if p.returncode != 0:
        raise c.ProcessError(f"link probe failed: {p.stderr[-1000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def shape_all(netns, lan, mbit: float, delay_ms: float) -> None:  # noqa: ANN001
    """Shape every host's NIC both ways: its egress, and its bridge port's egress."""
    hub_ports = lan.hub.run(["ip", "-o", "link", "show", "master", "br0"]).stdout
    for i, h in enumerate(lan.hosts.values()):
        port = f"v{i}"
        if f" {port}@" not in hub_ports:
            raise RuntimeError(f"no bridge port {port} for {h.name} (tests/netns.py changed?)")
        for end in (h, netns.Host(f"{h.name}-port", lan.hub.ns, h.addr, ifname=port)):
            netns.shape(end, rate_mbit=mbit, delay_ms=delay_ms)


def unavailable(delay_ms: float) -> tuple[object | None, str | None]:
    try:
        from tests import netns
    except ImportError as e:
        return None, f"tests/netns.py cannot be imported ({e})"
    if reason := netns.unavailable_reason():
        return None, reason
    if delay_ms and not netns.netem_available():
        return None, "added latency needs tc netem (sch_netem), which this kernel lacks"
    return netns, None
