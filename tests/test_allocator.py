"""trainkit/allocator.py: the shard's fixed mmap threshold (glibc) gives freed big
buffers back to the OS; `psar server --malloc-mmap-threshold-mib` sets it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from psar.ps.server.config import ServerConfig
from psar.trainkit.allocator import set_mmap_threshold

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}
GLIBC = platform.libc_ver()[0] == "glibc"

# Frees fifty 4 MiB tensors (each one written), each followed by a 256 KiB one that stays
# (so they leave holes, as buffers of a shard's rounds do), after one 4 MiB block was freed
# (glibc's threshold then rises to 4 MiB). Prints the resident MiB the frees gave back.
RETAINED = """
import sys, torch
from psar.trainkit.allocator import set_mmap_threshold
if sys.argv[1] != "0":
    assert set_mmap_threshold(int(sys.argv[1]))
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
n = (4 << 20) // 4
first = torch.empty(n).fill_(1.0)
del first
big, keep = [], []
for _ in range(50):
    big.append(torch.empty(n).fill_(1.0))
    keep.append(torch.empty(1 << 16).fill_(1.0))  # 256 KiB after each: holes, not a top
before = rss()
del big
print(before - rss())
"""


def _given_back(threshold: int) -> float:
    p = subprocess.run([sys.executable, "-c", RETAINED, str(threshold)], env=ENV,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return float(p.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="mallopt's mmap threshold is glibc's")
@pytest.mark.slow  # the default run's 5 minutes; a shard setting it at start stays in it
def test_a_fixed_threshold_gives_freed_big_buffers_back_and_glibcs_own_keeps_them() -> None:
    kept_by_default = _given_back(0)
    fixed = _given_back(1 << 20)
    assert fixed > 150, f"fixed 1 MiB threshold gave back only {fixed:.0f} of 200 MiB"
    assert kept_by_default < 50, f"glibc's own threshold gave back {kept_by_default:.0f} MiB"


def test_zero_leaves_the_allocator_alone_and_too_big_is_refused() -> None:
    assert set_mmap_threshold(0) is False
    with pytest.raises(ValueError, match="at most"):
        set_mmap_threshold(33 << 20)


def test_the_flag_is_checked_and_named() -> None:
    assert ServerConfig().malloc_mmap_threshold_mib == 1.0
    with pytest.raises(ValueError, match="--malloc-mmap-threshold-mib must be in \\[0, 32\\]"):
        ServerConfig(malloc_mmap_threshold_mib=64)


@pytest.mark.skipif(not GLIBC, reason="mallopt's mmap threshold is glibc's")
@pytest.mark.parametrize(
    ("flag", "said"), [([], True), (["--malloc-mmap-threshold-mib", "0"], False)]
)
def test_a_shard_sets_it_at_start(flag: list[str], said: bool) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "psar.worker.cli", "server", "--bind", "127.0.0.1:0",
         "--data-port", "-1", "--init-timeout-s", "0.5", *flag],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert p.returncode == 1, p.stderr  # no Init within --init-timeout-s
    assert ("malloc: buffers >= 1 MiB mapped on their own" in p.stderr) is said, p.stderr
