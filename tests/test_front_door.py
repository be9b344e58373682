"""A user's files beside their script never break psar (issue #44 item 1).

Before psar had one import name, its folders installed as the top-level packages `ps`,
`worker`, `allreduce` and `trainkit`: a user's own `worker.py` in the working directory
broke their script and even `psar launch --arch ps` (its shards start Python there). Here
the working directory holds a `worker.py`, `ps.py`, `allreduce.py` and `trainkit.py` that
fail loudly when imported, and real jobs run from it: a loop of the user's own under both
architectures, psar's own loop through `psar launch` under both, and `psar compare`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.procs import run_own_group

ROOT = Path(__file__).resolve().parents[1]
SHADOWS = ("worker", "ps", "allreduce", "trainkit")
PSAR = [sys.executable, "-m", "psar"]
OWN_ARGS = ["--steps", "3", "--batch-size", "16", "--log-every", "1"]
TRAIN_ARGS = ["--steps", "3", "--eval-batches", "1", "--log-every", "1", "--precision", "fp32"]


@pytest.fixture
def crowded(tmp_path: Path) -> Path:
    """A working directory with the user's own worker.py, ps.py, allreduce.py, trainkit.py
    (each raising if anything imports it) and their training script."""
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(
            f"raise ImportError('the user\\'s own {name}.py was imported in place of psar\\'s')\n"
        )
    shutil.copy(ROOT / "examples" / "own_loop.py", tmp_path / "train.py")
    return tmp_path


def _run(args: list[str], cwd: Path, timeout: float = 240) -> str:
    p = run_own_group(args, timeout, cwd=cwd)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode}:\n{out[-4000:]}"
    assert "was imported in place of psar" not in out
    return out


def test_shadow_files_raise_when_imported(crowded: Path) -> None:
    """The shadows are real: a plain `import worker` from that folder fails."""
    p = run_own_group([sys.executable, "-c", "import worker"], 60, cwd=crowded)
    assert p.returncode != 0 and "was imported in place of psar" in p.stderr


def test_own_loop_under_ps_beside_shadowing_files(crowded: Path) -> None:
    out = _run([*PSAR, "launch", "--arch", "ps", "--servers", "1", "--workers", "2", "--",
                sys.executable, "train.py", *OWN_ARGS], crowded)  # fmt: skip
    assert "final_loss=" in out


@pytest.mark.slow
def test_own_loop_under_allreduce_beside_shadowing_files(crowded: Path) -> None:
    out = _run([*PSAR, "launch", "--arch", "allreduce", "--workers", "2", "--",
                sys.executable, "train.py", *OWN_ARGS], crowded)  # fmt: skip
    assert "final_loss=" in out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["ps", "allreduce"])
def test_psar_launch_beside_shadowing_files(crowded: Path, arch: str) -> None:
    _run([*PSAR, "launch", "--arch", arch, "--workers", "2", *TRAIN_ARGS,
          "--run-dir", str(crowded / "run")], crowded)  # fmt: skip
    assert sorted(p.name for p in (crowded / "run").glob("steps-*.jsonl")) == [
        f"steps-{arch}-rank0.jsonl",
        f"steps-{arch}-rank1.jsonl",
    ]


@pytest.mark.slow
def test_psar_compare_beside_shadowing_files(crowded: Path) -> None:
    out = _run([*PSAR, "compare", "--steps", "4",
                "--out", str(crowded / "cmp")], crowded, timeout=420)  # fmt: skip
    for run in ("allreduce", "ps-sync", "ps-async", "ps-ssp"):
        assert f"| {run} |" in out, out[-3000:]
