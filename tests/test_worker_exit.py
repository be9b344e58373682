"""`psar train` ends with the code of what ended it, never by an abort (worker/cli.py
`_leave`). (SIGTERM's code, --sigterm-exit-code: tests/test_cli.py.)

The abort: a thread inside a torch op, which runs with the GIL released, when the
interpreter finalizes. Taking the GIL back then ends the thread by a forced unwind through
pybind11's noexcept destructor: "terminate called without an active exception", SIGABRT,
exit 134, whatever code the process was exiting with. In a PS worker whose Init failed,
that thread is gRPC's, which feeds the Init stream from psar's chunk generator (tensor
copies) and is neither joined nor stopped when the call fails; rank 0 exits right after.
To make the race certain, a sitecustomize runs torch ops on a daemon thread for the whole
run: with interpreter teardown the worker aborts every time, with `_leave` it never does.
"""

from __future__ import annotations

import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tests.procs import ENV, PSAR, run_own_group, shards

ROOT = Path(__file__).resolve().parent.parent
BUSY_TORCH_THREAD = """
import threading

def _ops():
    import torch
    x = torch.randn(192, 192)
    while True:
        x.mm(x)  # the GIL is released inside the op

threading.Thread(target=_ops, daemon=True, name="busy-torch").start()
"""


@pytest.fixture
def busy_env(tmp_path: Path) -> dict[str, str]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BUSY_TORCH_THREAD)
    return {**ENV, "PYTHONPATH": f"{hook}:{ROOT}", "PYTHONFAULTHANDLER": "1"}


@pytest.fixture
def not_a_shard():
    """A gRPC server on a port, serving nothing: a shard's port taken by another service."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _train(env: dict[str, str], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    args = [*PSAR, "train", "--arch", "ps", "--steps", "3", "--batch-size", "8",
            "--eval-batches", "0", "--log-every", "0", *argv]  # fmt: skip
    return run_own_group(args, timeout, env=env, cwd=ROOT)


def test_a_worker_whose_init_failed_exits_1_not_by_an_abort(busy_env, not_a_shard) -> None:
    p = _train(busy_env, "--servers", not_a_shard, "--rank", "0", "--world-size", "2")
    assert "terminate called" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"shard 0 ({not_a_shard}): UNIMPLEMENTED" in p.stderr


@pytest.mark.slow  # the same exit path as above, another code
def test_a_configuration_error_exits_2_not_by_an_abort(busy_env) -> None:
    p = _train(busy_env, "--servers", "127.0.0.1:1", "--workload", "bogus")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "psar train: error: unknown workload 'bogus'" in p.stderr


@pytest.mark.slow  # the same exit path as above, another code
def test_a_finished_worker_exits_0_not_by_an_abort(busy_env) -> None:
    with shards(1) as addrs:
        p = _train(busy_env, "--servers", addrs[0])
    assert p.returncode == 0, p.stderr[-3000:]
    assert '"steps": 3' in p.stdout
