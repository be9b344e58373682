"""A shared-memory segment is attached only when it belongs to the connecting peer
(issue #45, defect 3; ps/shm.py `peer_holds`): real shards, real second processes.

- A hello naming another process's sealed memfd, with that segment's right nonce (the
  strongest offer an intruder can make), is not attached: the connection keeps the
  socket, a piece naming the segment's bytes is refused, and the other process's memory
  is neither read into the shard nor written.
- An honest worker in a process of its own, on this host, still gets shared memory:
  psar_ps_data_connections_total{transport="shm"} counts its connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from psar.ps import framing as fr
from psar.ps import shm
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.server.metrics.prometheus import ShardMetrics
from psar.ps.shm import Segment, peer_holds
from tests.procs import ENV
from tests.ps_fixtures import weights_digest
from tests.test_dataplane import END, header, read_frame
from tests.test_dataplane_shm import _hello, live

pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memfds here")
SC = grpc.StatusCode

# Another process of this user: a sealed memfd like a worker's segment, whose first 16
# bytes are the nonce it is given and the rest a pattern; it prints "PID FD" and holds
# the memfd until its stdin closes.
_HOLDER = """
import fcntl, os, sys
nonce = bytes.fromhex(sys.argv[1])
fd = os.memfd_create("victim", os.MFD_ALLOW_SEALING)
os.write(fd, nonce + bytes(range(256)) * 16)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
print(os.getpid(), fd, flush=True)
sys.stdin.read()
"""

_HONEST = """
import json, sys, torch
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.tcp_transport import DataPlaneClient
port, slots = int(sys.argv[1]), json.loads(sys.argv[2])
with DataPlaneClient("127.0.0.1", port, shm_bytes=1 << 20) as c:
    out = {k: torch.empty(n) for k, n in slots}
    c.pull(pb.PullRequest(worker=0, clock=0, dtype=pb.FLOAT32), out, timeout_s=30)
    print(json.dumps([conn.segment is not None for conn in c._idle]))
"""


@contextlib.contextmanager
def _holder(nonce: bytes) -> Iterator[tuple[int, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, nonce.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, fd = (int(x) for x in proc.stdout.readline().split())
        yield pid, fd
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _memory_of(pid: int, fd: int) -> bytes:
    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
        return f.read()


def test_a_hello_naming_another_processs_memfd_is_not_attached() -> None:
    nonce = os.urandom(shm.NONCE_BYTES)
    with _holder(nonce) as (pid, fd), live() as s:
        path = f"/proc/{pid}/fd/{fd}"
        original = _memory_of(pid, fd)
        before = weights_digest(s.state)
        sock, status = _hello(s.port, path, nonce)  # its path and its very nonce
        try:
            assert status.code == 0 and not status.shm
            # A push naming bytes "in the segment" (the other process's pattern): refused.
            key = s.job.slots[0].key
            bad = pb.DataFrame(piece=pb.DataPiece(key=key, shm_at=0, shm_bytes=256))
            sock.sendall(
                fr.encode(pb.DataFrame(push_header=header(0, 1))) + fr.encode(bad) + fr.encode(END)
            )
            reply = read_frame(sock)
            assert reply.status.code == SC.INVALID_ARGUMENT.value[0], reply
            assert "no segment" in reply.status.details
        finally:
            sock.close()
        stats = s.dp.stats()
        assert stats["shm"] == 0 and stats["shm_refused"] == 1
        assert weights_digest(s.state) == before and s.state.version == 0
        assert _memory_of(pid, fd) == original  # nothing written into it


def test_an_honest_worker_in_its_own_process_gets_shared_memory() -> None:
    metrics = ShardMetrics(shard=0)
    with live(metrics=metrics) as s:
        slots = json.dumps([[x.key, x.numel] for x in s.job.slots])
        out = subprocess.run(
            [sys.executable, "-c", _HONEST, str(s.port), slots],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.splitlines()[-1]) == [True]
        assert s.dp.stats()["shm"] == 1 and s.dp.stats()["shm_refused"] == 0
    got = {
        x.labels["transport"]: x.value
        for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for x in fam.samples
        if x.name == "psar_ps_data_connections_total"
    }
    assert got.get("shm") == 1 and not got.get("socket")


def test_peer_holds_names_only_the_process_holding_the_other_end() -> None:
    """The check itself on a TCP pair this process holds both ends of, over IPv4 and
    IPv6: this process holds the peer's end, another process (its parent) does not."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            listener = socket.create_server((host, 0), family=family)
        except OSError:  # no IPv6 here
            continue
        with listener, socket.create_connection(listener.getsockname()[:2]) as client:
            ours, _ = listener.accept()
            with ours:
                assert peer_holds(os.getpid(), ours)
                assert peer_holds(os.getpid(), client)  # either end names the other
                assert not peer_holds(os.getppid(), ours)
        assert not peer_holds(os.getpid(), ours)  # closed: no peer


def test_a_segment_is_attached_for_its_own_peer_only() -> None:
    """This process's own segment, offered on a connection whose peer is another
    process: refused, whatever the shard may open; on its own connection: attached."""
    seg = Segment.create(4096)
    listener = socket.create_server(("127.0.0.1", 0))
    port = str(listener.getsockname()[1])
    dial = "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); sys.stdin.read()"  # noqa: E501
    other = subprocess.Popen([sys.executable, "-c", dial, port], stdin=subprocess.PIPE)
    try:
        theirs, _ = listener.accept()
        with theirs, pytest.raises(shm.SegmentRefused, match="not the connecting peer's"):
            Segment.attach(seg.path, seg.nonce, theirs)
        with socket.create_connection(listener.getsockname()) as client:
            ours, _ = listener.accept()
            with ours:
                assert client.fileno() >= 0
                Segment.attach(seg.path, seg.nonce, ours).close()
    finally:
        other.stdin.close()
        other.wait(timeout=30)
        listener.close()
        seg.close()
