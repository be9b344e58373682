"""Test hosts on one machine: Linux network namespaces joined into a private LAN.

    from tests import netns

    reason = netns.unavailable_reason()        # None, or why namespaces cannot be made
    with netns.lan(["shards", "w0", "w1"]) as lan:
        lan["shards"].addr                      # "10.77.0.1", then .2, .3 ...
        p = lan["shards"].popen(["python", "-m", "psar.worker.cli", "server", ...])
        lan.hub.fetch("http://10.77.0.1:9400/metrics")   # the hub is a host too (.254)
        netns.shape(lan["w0"], rate_mbit=100)    # tc on w0's link (netem when delay/loss)

Layout: a "hub" namespace holds a bridge (br0, address .254); each host is its own
namespace with one veth (eth0) whose peer is enslaved to the bridge. Every interface is
created inside namespaces this module made, so nothing is added to the root namespace,
and deleting the namespaces (always done on exit, also on failure) removes everything.
The addresses exist only inside those namespaces: there is no default route, so nothing
sent to them can leave the machine.

With `lan(..., hostnames=True)` every host is also a host by name: its commands run in a
UTS namespace whose hostname is the host's name, and see an /etc/hosts of their own
(/etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts) that names
localhost and the host itself only, as on a node whose peers are known by address.

Processes started with Host.popen run in their own session; the LAN kills their process
groups, then every process still inside a namespace (daemons that left their group, such
as slurmstepd), before it deletes the namespaces. Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and
iproute2 (`apt-get install -y iproute2`); tc shaping needs the kernel's sch_netem (delay,
jitter, loss) or sch_tbf (rate only).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PREFIX = "psar"
ETC_NETNS = "/etc/netns"  # `ip netns exec NS` bind-mounts ETC_NETNS/NS/* over /etc/*
DEFAULT_SUBNET = "10.77.0"  # a /24; hosts get .1, .2, ..., the hub .254
_counter = itertools.count()
_unavailable: list[str | None] = []  # cached result of unavailable_reason()


class ShapingUnavailable(RuntimeError):
    """The kernel lacks the qdisc a shape() call needs (e.g. sch_netem)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


def ns_cmd(ns: str, argv: Sequence[str]) -> list[str]:
    """argv run inside namespace ns."""
    return ["ip", "netns", "exec", ns, *argv]


def unavailable_reason() -> str | None:
    """None when namespaces, veth pairs and a bridge can be made here, else why not."""
    if _unavailable:
        return _unavailable[0]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif shutil.which("ip") is None:
        reason = "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    elif os.geteuid() != 0:
        reason = "creating network namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    else:
        a, b = f"{PREFIX}{os.getpid()}-probe-a", f"{PREFIX}{os.getpid()}-probe-b"
        try:
            _ip("netns", "add", a)
            _ip("netns", "add", b)
            _ip("link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "p0",
                "netns", b)  # fmt: skip
            _ip("-n", b, "link", "add", "br0", "type", "bridge")
        except RuntimeError as e:
            reason = f"cannot make network namespaces here: {e}"
        finally:
            for ns in (a, b):
                _ip("netns", "del", ns, check=False)
    _unavailable.append(reason)
    return reason


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces left by earlier runs whose process is gone; returns their names."""
    if shutil.which("ip") is None:
        return []
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-.+", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
            gone.append(name)
    return gone


def _kill_inside(ns: str) -> None:
    """SIGKILL every process whose network namespace is ns (by pid: `ip netns pids`)."""
    for raw in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.kill(int(raw), signal.SIGKILL)


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


@dataclass
class Host:
    """One test host: a namespace with an address on the LAN."""

    name: str
    ns: str
    addr: str
    ifname: str = "eth0"
    hostname: str | None = None  # set: commands run in a UTS namespace with this hostname
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def cmd(self, argv: Sequence[str]) -> list[str]:
        if self.hostname:
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname,
                    *argv]  # fmt: skip
        return ns_cmd(self.ns, argv)

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start argv in this host (own session); killed when the LAN is torn down."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.cmd(argv), **kw)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.cmd(argv), **kw)

    def fetch(self, url: str, timeout: float = 5.0) -> str:
        """GET url from this host (e.g. a /metrics scrape); raises OSError on failure."""
        code = (
            "import sys, urllib.request\n"
            "with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r:\n"
            "    sys.stdout.write(r.read().decode())\n"
        )
        p = self.run([sys.executable, "-c", code, url, str(timeout)], timeout=timeout + 10)
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["?"])[-1]
            raise OSError(f"{self.name}: GET {url} failed: {last}")
        return p.stdout

    def kill_all(self) -> None:
        for p in self.procs:
            _kill_group(p)


@dataclass
class Lan:
    """Hosts on one bridge. lan["name"] is a Host; lan.hub is the bridge's own host."""

    hub: Host
    hosts: dict[str, Host]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def all_hosts(self) -> list[Host]:
        return [*self.hosts.values(), self.hub]


@contextlib.contextmanager
def lan(
    names: Sequence[str], subnet: str = DEFAULT_SUBNET, *, hostnames: bool = False
) -> Iterator[Lan]:
    """Create one namespace per name plus a hub with a bridge; delete them all on exit.

    hostnames: each host (the hub too, as "hub") also gets its name as hostname and an
    /etc/hosts naming localhost and itself only (module docstring)."""
    if len(names) > 253 or len(set(names)) != len(names):
        raise ValueError("lan(): up to 253 distinct host names")
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    cleanup_stale()
    tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
    hub = Host("hub", f"{tag}-hub", f"{subnet}.254", ifname="br0")
    hosts = {n: Host(n, f"{tag}-{n}", f"{subnet}.{i + 1}") for i, n in enumerate(names)}
    made: list[str] = []
    try:
        if hostnames:
            if shutil.which("unshare") is None:
                raise RuntimeError("lan(hostnames=True) needs util-linux's `unshare`")
            for h in [hub, *hosts.values()]:
                h.hostname = h.name
                etc = os.path.join(ETC_NETNS, h.ns)
                os.makedirs(etc, exist_ok=True)
                with open(os.path.join(etc, "hosts"), "w") as f:
                    f.write(f"127.0.0.1\tlocalhost\n{h.addr}\t{h.name}\n")
        _ip("netns", "add", hub.ns)
        made.append(hub.ns)
        _ip("-n", hub.ns, "link", "set", "lo", "up")
        _ip("-n", hub.ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub.ns, "addr", "add", f"{hub.addr}/24", "dev", "br0")
        _ip("-n", hub.ns, "link", "set", "br0", "up")
        for i, h in enumerate(hosts.values()):
            _ip("netns", "add", h.ns)
            made.append(h.ns)
            peer = f"v{i}"
            _ip("link", "add", h.ifname, "netns", h.ns, "type", "veth", "peer", "name", peer,
                "netns", hub.ns)  # fmt: skip
            _ip("-n", hub.ns, "link", "set", peer, "master", "br0")
            _ip("-n", hub.ns, "link", "set", peer, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
        yield Lan(hub=hub, hosts=hosts)
    finally:
        for h in [*hosts.values(), hub]:
            h.kill_all()
        for ns in reversed(made):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        for h in [hub, *hosts.values()]:
            shutil.rmtree(os.path.join(ETC_NETNS, h.ns), ignore_errors=True)


def _qdisc_works(kind: str, params: Sequence[str]) -> bool:
    ns = f"{PREFIX}{os.getpid()}-qdisc-probe"
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "d0", "type", "dummy")
        p = subprocess.run(ns_cmd(ns, ["tc", "qdisc", "add", "dev", "d0", "root", kind, *params]),
                           capture_output=True, text=True)  # fmt: skip
        return p.returncode == 0
    except RuntimeError:
        return False
    finally:
        _ip("netns", "del", ns, check=False)


def netem_available() -> bool:
    """Whether tc's netem qdisc (delay, jitter, loss) can be used here."""
    return shutil.which("tc") is not None and _qdisc_works("netem", ["delay", "1ms"])


def shape(
    host: Host,
    *,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss_pct: float = 0.0,
    rate_mbit: float = 0.0,
) -> list[str]:
    """Shape the egress of host's link (replacing any earlier shaping); returns the tc argv.

    Delay, jitter or loss use netem (with its own rate when rate_mbit is given too); rate
    alone uses tbf. Shape both ends of a link to shape both directions. Raises
    ShapingUnavailable when the kernel lacks the qdisc (check netem_available() first).
    """
    if shutil.which("tc") is None:
        raise ShapingUnavailable("tc is not installed (apt-get install -y iproute2)")
    base = ["tc", "qdisc", "replace", "dev", host.ifname, "root"]
    if delay_ms or jitter_ms or loss_pct:
        argv = [*base, "netem", "delay", f"{delay_ms}ms"]
        if jitter_ms:
            argv += [f"{jitter_ms}ms"]
        if loss_pct:
            argv += ["loss", f"{loss_pct}%"]
        if rate_mbit:
            argv += ["rate", f"{rate_mbit}mbit"]
    elif rate_mbit:
        # burst: at least one MTU and ~1 ms worth of bytes at the given rate.
        burst = max(1600, int(rate_mbit * 1e6 / 8 / 1000))
        argv = [*base, "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
                "latency", "50ms"]  # fmt: skip
    else:
        argv = ["tc", "qdisc", "del", "dev", host.ifname, "root"]
        host.run(argv)  # no shaping requested: drop any earlier qdisc (absent is fine)
        return argv
    p = host.run(argv)
    if p.returncode != 0:
        msg = p.stderr.strip()
        if "unknown" in msg.lower() or "no such file" in msg.lower():
            raise ShapingUnavailable(f"{' '.join(argv)}: {msg} (kernel module missing?)")
        raise RuntimeError(f"{' '.join(argv)}: {msg}")
    return argv
