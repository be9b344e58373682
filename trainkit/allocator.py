"""The C allocator's mmap threshold: big buffers go back to the OS when they are freed.

glibc's malloc serves a request below its mmap threshold from a heap and keeps what is
freed there for later; the threshold starts at 128 KiB and rises, each time an mmapped
block is freed, to that block's size (up to 32 MiB). A shard frees and makes buffers of
every size of slot (Init's pieces, pull snapshots, the scratch of pushes in flight): with
the rising threshold those below 32 MiB stay on the heaps once freed, and a shard of the
104M-parameter benchmark peaked at 35.6-36.0 bytes per parameter held (3 runs) against
32.5-32.8 with the threshold fixed at 1 MiB (`psar server --malloc-mmap-threshold-mib`,
its default), 33.6-35.5 at 8 MiB (`python -m bench.step_throughput --memory`). A round
on the reference workload makes no buffer that big, so its rate is the same either way
(the bench's `psar-ps-sync-1-glibc-malloc` row). Other allocators (musl, jemalloc or
tcmalloc preloaded, macOS) are left alone: `set_mmap_threshold` says whether it took.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
MAX_THRESHOLD = 32 << 20
"""glibc refuses a threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit hosts."""


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at `nbytes` (0: leave the allocator as it is). True
    when it took; False where the C library has no mallopt or refused the value."""
    if nbytes <= 0:
        return False
    if nbytes > MAX_THRESHOLD:
        raise ValueError(f"mmap threshold {nbytes} bytes: at most {MAX_THRESHOLD} (32 MiB)")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, int(nbytes)):
        return False
    # Fixing one threshold turns off glibc's adjustment of both: keep the trim threshold
    # where the rising one would have put it (twice the mmap threshold), or every free at
    # the heap's top above 128 KiB gives pages back that the next round faults in again.
    mallopt(M_TRIM_THRESHOLD, 2 * int(nbytes))
    return True
