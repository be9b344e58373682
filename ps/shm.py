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

Within a segment each call (push or pull) writes from its start, pieces one after another
at 64-byte boundaries; a piece that does not fit what is left goes in the socket as before.
One call at a time runs on a connection, and a call ends only once its receiver has read
every piece, so the next call may write from the start again.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import stat
import sys

import torch

HEADER = 64
"""Bytes at the segment's start: the nonce (then unused)."""
NONCE_BYTES = 16
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
        self.used = HEADER

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
    def attach(cls, path: str, nonce: bytes, max_bytes: int = MAX_BYTES) -> Segment:
        """A shard's view of a worker's segment; SegmentRefused says why not."""
        if not _PATH.fullmatch(path):
            raise SegmentRefused(f"segment path {path[:80]!r} is not /proc/PID/fd/FD")
        if len(nonce) != NONCE_BYTES:
            raise SegmentRefused(f"segment nonce of {len(nonce)} bytes, not {NONCE_BYTES}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentRefused(f"cannot open {path} ({e.strerror}): not this host?") from None
        try:
            st = os.fstat(fd)
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
        """A new call: its pieces are written from the start."""
        self.used = HEADER

    def put(self, data: memoryview) -> int | None:
        """Copy `data` (bytes) in after the call's earlier pieces; its place, or None when
        it does not fit what is left (send it in the socket)."""
        n = len(data)
        at = self.used
        if at + n > self.size:
            return None
        copy(self.bytes[at : at + n], data, self.view[at : at + n])
        self.used = -(-(at + n) // ALIGN) * ALIGN
        return at

    def copy_out(self, at: int, n: int, dst: memoryview) -> None:
        """The `n` bytes at `at` into `dst` (bytes, writable); ValueError as `get`."""
        src = self.get(at, n)
        if len(dst) != n:
            raise ValueError(f"{n} bytes in the segment for a {len(dst)}-byte destination")
        if n:
            torch.frombuffer(dst, dtype=torch.uint8).copy_(self.bytes[at : at + n])
        del src

    def get(self, at: int, n: int) -> memoryview:
        """The `n` bytes at `at`; ValueError when they are not inside the pieces' area."""
        if not (HEADER <= at and n >= 0 and at + n <= self.size):
            raise ValueError(
                f"piece at {at} (+{n} bytes) is outside the shared segment's pieces "
                f"[{HEADER}, {self.size})"
            )
        return self.view[at : at + n]

    def close(self) -> None:
        self.offered()
        del self.bytes
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the GC unmaps it
            pass


def copy(dst: torch.Tensor, data: memoryview, dst_view: memoryview) -> None:
    """`data` (bytes) into `dst` (its bytes also as `dst_view`), the GIL released where
    torch can read `data` (a writable buffer; a read-only one is copied by Python)."""
    if not len(data):
        return
    if data.readonly:
        dst_view[:] = data
    else:
        dst.copy_(torch.frombuffer(data, dtype=torch.uint8))
