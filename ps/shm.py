"""Shared-memory segments of the data plane: tensor bytes between a worker and a shard on
the same host without passing through the socket (docs/dataplane.md, "Shared memory").

Over loopback TCP a piece's bytes are copied into the kernel by the sender and out of it by
the receiver, with the TCP stack's work around both; on a host whose cores also run the
workers' compute, that CPU is taken from training. Here a worker creates one segment per
data-plane connection and offers it in its hello; a shard on the same host attaches to it,
and from then on a piece frame may say "my bytes are at `shm_at` in the segment" (no
payload on the wire): the sender copies the bytes in once, the receiver copies them out
once, straight into its tensor. The frames themselves (and so the order, the checks and
the refusals of every call) still travel on the socket.

The segment is an anonymous memfd, sealed against shrinking and growing before it is
offered: a shard reading or writing it can never fault because the worker truncated it
(what a plain file in /dev/shm would allow). The worker names it by its /proc path
(`/proc/PID/fd/FD`) with a random nonce written at its start; a shard attaches only to a
sealed memfd at such a path whose first bytes are that nonce (so a shard on another host,
or in another PID namespace, finds no such segment and the connection keeps the socket),
and never opens a file the worker names anywhere else. Segments are offered only without
TLS: under TLS the user asked for the bytes to travel encrypted.

**The segment must belong to the connecting peer** (`peer_holds`). A shard may be able
to open far more /proc paths than the peer could (a root shard: every process's), so
without this a local user who reaches the data port could make it read pushes from, and
write pulls into, any other process's sealed memfd (a confused deputy, issue #45). So
the process PID that the path names must hold the very socket of this connection: the
peer's end is found in the kernel's TCP table (/proc/net/tcp and tcp6: the row whose
local address is the connection's remote one and whose remote address is its local
one gives the socket's inode), and /proc/PID/fd must hold `socket:[inode]`. A process
holds another's socket only if that one handed it over, so the segment is the peer's.
After the check the opened memfd is compared with what /proc/PID/fd/FD is now (the same
file), so a PID that exited and was reused in between cannot pass.

A segment is a ring. Each call (push or pull) numbers its bytes from 0 (`shm_at` in a
frame is that number; the piece lies at HEADER + shm_at mod the ring's size, never
across its end, 64-byte aligned), and its receiver, once it has copied a piece out,
stores how far it has read at CONSUMED. The sender places a piece only where the
receiver has read what was there; a piece with no room now goes in the socket as before,
so nobody ever waits on the other. One call at a time runs on a connection, and the
sender of the next call starts the numbering (and CONSUMED) from 0 again. Memory is then
at most the ring's size per connection, whatever the model's.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import socket
import stat
import struct
import sys

import torch

HEADER = 64
"""Bytes at the segment's start: the nonce, CONSUMED, then unused."""
NONCE_BYTES = 16
CONSUMED = 16
"""Where the receiver of the call in flight stores (u64) how far it has read."""
_U64 = struct.Struct("<Q")
ALIGN = 64
MAX_BYTES = 1 << 31
"""The largest segment a shard attaches to."""
_PATH = re.compile(r"/proc/(\d+)/fd/(\d+)")


class SegmentRefused(Exception):
    """Why a shard does not attach to an offered segment (the connection keeps the socket)."""


def available() -> bool:
    """Sealed memfds (Linux)."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and hasattr(fcntl, "F_ADD_SEALS")
    )


def _seals() -> int:
    return fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Segment:
    """One connection's segment, mapped; `put` and `get` place and find a call's pieces."""

    def __init__(self, fd: int, size: int, path: str = "", nonce: bytes = b"") -> None:
        self.size = size
        self._map = mmap.mmap(fd, size)
        self.view = memoryview(self._map)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        """The segment as a tensor: copies through torch release the GIL (a memoryview
        assignment holds it for the whole memcpy, stalling every other thread of the
        process: the training thread's forward and backward among them)."""
        self.path = path
        """/proc/PID/fd/FD while the worker's fd is open (offered in its hello)."""
        self.nonce = nonce
        self._fd: int | None = fd if path else None
        self.ring = size - HEADER
        self.head = 0
        """The sender's next byte number in the call in flight."""
        self.placed = 0
        """Bytes this end has placed in the segment (all calls)."""

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A worker's new segment with room for `nbytes` of pieces per call."""
        fd = os.memfd_create("psar-data", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = HEADER + nbytes
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())
            nonce = os.urandom(NONCE_BYTES)
            seg = cls(fd, size, f"/proc/{os.getpid()}/fd/{fd}", nonce)
        except BaseException:
            os.close(fd)
            raise
        seg.view[:NONCE_BYTES] = nonce
        return seg

    @classmethod
    def attach(
        cls, path: str, nonce: bytes, peer: socket.socket, max_bytes: int = MAX_BYTES
    ) -> Segment:
        """A shard's view of the segment the peer of connection `peer` (the shard's end
        of its TCP socket) offered; SegmentRefused says why not: among others, a
        segment held by any process but the one holding the peer's end of `peer`."""
        m = _PATH.fullmatch(path)
        if not m:
            raise SegmentRefused(f"segment path {path[:80]!r} is not /proc/PID/fd/FD")
        if len(nonce) != NONCE_BYTES:
            raise SegmentRefused(f"segment nonce of {len(nonce)} bytes, not {NONCE_BYTES}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentRefused(f"cannot open {path} ({e.strerror}): not this host?") from None
        try:
            if not peer_holds(int(m.group(1)), peer):
                raise SegmentRefused(
                    f"{path} is not the connecting peer's: process {m.group(1)} does not "
                    "hold this connection's socket"
                )
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except OSError:
                raise SegmentRefused(f"{path} went away while it was checked") from None
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise SegmentRefused(f"{path} changed while it was checked")
            if not stat.S_ISREG(st.st_mode):
                raise SegmentRefused(f"{path} is not a memory file")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise SegmentRefused(f"{path} is not a sealable memfd") from None
            need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            if seals & need != need:
                raise SegmentRefused(f"{path} is not sealed against shrinking and growing")
            if not HEADER < st.st_size <= max_bytes:
                raise SegmentRefused(
                    f"segment of {st.st_size} bytes; must be over {HEADER} and at most {max_bytes}"
                )
            seg = cls(fd, st.st_size)
        finally:
            os.close(fd)  # the mapping keeps the memfd alive
        if bytes(seg.view[:NONCE_BYTES]) != nonce:
            seg.close()
            raise SegmentRefused(f"{path} is another segment (nonce differs): not this host")
        return seg

    def offered(self) -> None:
        """The hello was answered: the worker's fd (the /proc path) is no longer needed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- one call's pieces -------------------------------------------------------------

    def begin(self) -> None:
        """The sender's new call: its bytes are numbered from 0, nothing read yet."""
        self.head = 0
        _U64.pack_into(self.view, CONSUMED, 0)

    def put(self, data: memoryview) -> int | None:
        """Copy `data` (bytes) in after the call's earlier pieces; its number (`shm_at`),
        or None when the receiver has not yet read the room it needs (send it in the
        socket)."""
        n = len(data)
        got = self.reserve(n)
        if got is None:
            return None
        at, dst = got
        pos = HEADER + at % self.ring
        copy(dst, data, self.view[pos : pos + n])
        return at

    def reserve(self, n: int) -> tuple[int, torch.Tensor] | None:
        """Room for `n` bytes after the call's earlier pieces, for the caller to fill
        (a gather straight into the segment: no buffer between): (its number, `shm_at`;
        those bytes as a uint8 tensor, 64-byte aligned), or None as `put`."""
        head = self.head
        if (head % self.ring) + n > self.ring:  # never across the end: start at the ring's
            head += self.ring - head % self.ring
        if head + n - _U64.unpack_from(self.view, CONSUMED)[0] > self.ring:
            return None
        pos = HEADER + head % self.ring
        self.head = -(-(head + n) // ALIGN) * ALIGN
        self.placed += n
        return head, self.bytes[pos : pos + n]

    def copy_out(self, at: int, n: int, dst: memoryview) -> None:
        """Piece `at` (`n` bytes) into `dst` (bytes, writable), then read past it;
        ValueError as `get`."""
        pos = self._pos(at, n)
        if len(dst) != n:
            raise ValueError(f"{n} bytes in the segment for a {len(dst)}-byte destination")
        if n:
            torch.frombuffer(dst, dtype=torch.uint8).copy_(self.bytes[pos : pos + n])
        self.consumed(at, n)

    def get(self, at: int, n: int) -> memoryview:
        """Piece `at`'s `n` bytes, valid until `consumed`; ValueError when they are not
        inside the ring."""
        pos = self._pos(at, n)
        return self.view[pos : pos + n]

    def consumed(self, at: int, n: int) -> None:
        """The receiver has read piece `at`: the sender may write over it."""
        _U64.pack_into(self.view, CONSUMED, at + n)

    def _pos(self, at: int, n: int) -> int:
        pos = HEADER + at % self.ring if self.ring else HEADER
        if not (0 <= at and 0 <= n and pos + n <= self.size):
            raise ValueError(
                f"piece {at} (+{n} bytes) does not lie inside the shared segment's ring "
                f"of {self.ring} bytes"
            )
        return pos

    def close(self) -> None:
        self.offered()
        del self.bytes
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the GC unmaps it
            pass


def peer_holds(pid: int, sock: socket.socket) -> bool:
    """Does process `pid` hold the other end of TCP connection `sock` (this host, this
    network namespace)? False where that cannot be established (not TCP, no such row,
    a process whose fds this one may not list)."""
    try:
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:
        return False
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    # The peer's socket: its local address is our remote one, its remote ours.
    want = (_packed(remote[0]), remote[1], _packed(local[0]), local[1])
    inode = _tcp_inode(want)
    if not inode:
        return False
    link = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


_V4_MAPPED = bytes(10) + b"\xff\xff"


def _packed(ip: str) -> bytes:
    """An address as 4 bytes (IPv4, and IPv4-mapped IPv6) or 16."""
    ip = ip.split("%", 1)[0]
    raw = socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
    return raw[12:] if raw[:12] == _V4_MAPPED else raw


def _table_address(text: str) -> tuple[bytes, int]:
    """/proc/net/tcp's HEX:PORT: the address as 32-bit words in host byte order."""
    hexaddr, port = text.split(":")
    raw = b"".join(
        int(hexaddr[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hexaddr), 8)
    )
    return (raw[12:] if raw[:12] == _V4_MAPPED else raw), int(port, 16)


def _tcp_inode(want: tuple[bytes, int, bytes, int]) -> int:
    """The inode of the TCP socket whose (local, remote) addresses are `want`; 0: none."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)  # the column names
                for line in f:
                    fields = line.split()
                    if len(fields) < 10:
                        continue
                    if (*_table_address(fields[1]), *_table_address(fields[2])) == want:
                        return int(fields[9])
        except (OSError, ValueError):
            continue
    return 0


def copy(dst: torch.Tensor, data: memoryview, dst_view: memoryview) -> None:
    """`data` (bytes) into `dst` (its bytes also as `dst_view`), the GIL released where
    torch can read `data` (a writable buffer; a read-only one is copied by Python)."""
    if not len(data):
        return
    if data.readonly:
        dst_view[:] = data
    else:
        dst.copy_(torch.frombuffer(data, dtype=torch.uint8))
