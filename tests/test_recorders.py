"""Metrics go through recorders with a fixed interface: a misspelt call fails here.

The shard records through psar.ps.server.recorder.ShardRecorder, the worker through
psar.trainkit.recorder.WorkerRecorder. The Prometheus recorders (ShardMetrics, WorkerMetrics) and
the null ones implement exactly the interface's methods, with the same parameters, and
every metrics call in ps/, worker/, allreduce/ and trainkit/ (read from the source: any
call on something named *metrics* or *recorder*) names one of them.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from psar.ps.server.metrics.prometheus import ShardMetrics
from psar.ps.server.metrics.recorder import NullShardRecorder, ShardRecorder
from psar.trainkit.recorder import NullWorkerRecorder, WorkerRecorder
from psar.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
EXPOSITION = {"exposition", "serve"}
"""Public methods of a Prometheus recorder that record nothing (a scrape, the endpoint)."""


def interface(proto: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(proto).items()
        if callable(fn) and not name.startswith("_")
    }


def methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in inspect.getmembers(cls, callable)
        if not name.startswith("_") and name not in EXPOSITION
    }


def params(sig: inspect.Signature) -> list[str]:
    return [p.name for p in sig.parameters.values()]


CASES = [
    (ShardRecorder, ShardMetrics, NullShardRecorder),
    (WorkerRecorder, WorkerMetrics, NullWorkerRecorder),
]


@pytest.mark.parametrize(("proto", "prom", "null"), CASES, ids=["shard", "worker"])
def test_recorders_implement_exactly_the_interface(proto: type, prom: type, null: type) -> None:
    want = interface(proto)
    assert len(want) >= 8
    for cls in (prom, null):
        got = methods(cls)
        assert got.keys() == want.keys(), f"{cls.__name__}: {got.keys() ^ want.keys()}"
        for name, sig in want.items():
            assert params(got[name]) == params(sig), f"{cls.__name__}.{name}{got[name]}"
        assert "__getattr__" not in vars(cls), f"{cls.__name__} must not accept any name"


def test_recorders_are_instances_of_their_interface() -> None:
    assert isinstance(ShardMetrics(), ShardRecorder)
    assert isinstance(NullShardRecorder(), ShardRecorder)
    assert isinstance(WorkerMetrics(arch="ps"), WorkerRecorder)
    assert isinstance(NullWorkerRecorder(), WorkerRecorder)


def test_a_misspelt_call_fails_at_once() -> None:
    with pytest.raises(AttributeError):
        NullShardRecorder().barier_wait(1.0)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        NullWorkerRecorder().step_don(1)  # type: ignore[attr-defined]


# ---- every call site, read from the source ------------------------------------------------

# Which interface the calls of a file go to: the shard's (and ps/auth.py's interceptor,
# which counts refused calls on the shard's metrics) or the worker's.
SHARD_SIDE = ("ps/server/", "ps/auth.py")
SCANNED = ("ps", "worker", "allreduce", "trainkit")


def _receiver_name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return getattr(node, "id", "")


def metric_calls(source: str) -> list[tuple[int, str]]:
    """(line, method) of every call `<...metrics or recorder>.method(...)` in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            recv = _receiver_name(node.func.value).lower()
            if "metrics" in recv or "recorder" in recv:
                out.append((node.lineno, node.func.attr))
    return out


def misspelt(source: str, allowed: set[str]) -> list[str]:
    return [f"{line}: .{name}()" for line, name in metric_calls(source) if name not in allowed]


def test_every_metrics_call_names_an_interface_method() -> None:
    shard, worker = set(interface(ShardRecorder)), set(interface(WorkerRecorder))
    bad, seen = [], 0
    for package in SCANNED:
        for f in sorted((ROOT / package).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if "/_gen/" in rel or rel.endswith(("/metrics.py", "/recorder.py")):
                continue  # the recorders themselves
            allowed = shard if rel.startswith(SHARD_SIDE) else worker
            source = f.read_text()
            seen += len(metric_calls(source))
            bad += [f"{rel}:{m}" for m in misspelt(source, allowed)]
    assert seen > 40, "no metrics calls found: did the scan break?"
    assert not bad, "metrics calls outside the recorder interface:\n" + "\n".join(bad)


def test_the_scan_catches_a_misspelt_call() -> None:
    allowed = set(interface(ShardRecorder))
    assert misspelt("self.metrics.barier_wait(1.0)", allowed)
    assert misspelt("st.metrics.push_rejectd('x')", allowed)
    assert misspelt("metrics.set_lossscale(2.0)", set(interface(WorkerRecorder)))
    assert not misspelt("self._metrics.push_rejected('unauthenticated')", allowed)
