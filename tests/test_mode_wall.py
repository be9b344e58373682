"""The mode wall: in ps/server only the policy modules decide by consistency mode.

Every decision that differs between sync, async and ssp is a method or attribute of the
shard's UpdatePolicy (ps/server/policies.py, ps/server/chunk_rounds.py, the sparse side in
ps/server/sparse_policy.py); ps/server/policy_for_mode.py is the one place a mode name
becomes a policy. Anywhere else in ps/server a mode may be named only to build the policy
(`make_policy(job.mode, ...)`), to label metrics (`set_mode`, ps/server/metrics.py) or in
a message. The test reads the source (AST), so a new `job.mode == "sync"` fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "ps" / "server"
MODES = {"sync", "async", "ssp", "local"}
# The policy modules: the only ones that decide by mode.
POLICY_MODULES = {
    "policies.py",
    "policy_for_mode.py",
    "chunk_rounds.py",
    "sparse_policy.py",
    "local_policy.py",
}
# Calls that may take a mode as an argument: build the policy, label the metrics.
MODE_SINKS = {"make_policy", "set_mode"}
# metrics.py keeps the mode as a metrics label (its own `mode` attribute, validated).
LABEL_MODULES = {"metrics.py"}


def _is_mode_value(node: ast.AST) -> bool:
    """A mode name literal (or a tuple, list or set holding one), or something's `.mode`."""
    if isinstance(node, ast.Constant) and node.value in MODES:
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_mode_value(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "mode"


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def violations(source: str, filename: str) -> list[str]:
    """`file:line: what` for every mode decision made outside a policy in `source`."""
    tree = ast.parse(source)
    allowed: set[int] = set()  # ids of `.mode` reads that are fine where they stand
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) in MODE_SINKS:
            allowed.update(id(a) for a in node.args)
        if isinstance(node, ast.JoinedStr):  # an f-string message names the mode
            allowed.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            if any(_is_mode_value(n) for n in [node.left, *node.comparators]):
                out.append(f"{where}: compares a mode ({ast.unparse(node)})")
        elif isinstance(node, ast.Match) and _is_mode_value(node.subject):
            out.append(f"{where}: matches on a mode")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "mode"
            and isinstance(node.ctx, ast.Load)
            and id(node) not in allowed
            and filename not in LABEL_MODULES
        ):
            out.append(f"{where}: reads {ast.unparse(node)} (ask the policy instead)")
        elif isinstance(node, ast.Call) and _call_name(node) in {"isinstance", "issubclass"}:
            kinds = node.args[1:] if len(node.args) > 1 else []
            names = [n.id for k in kinds for n in ast.walk(k) if isinstance(n, ast.Name)]
            if any(n.endswith("Policy") for n in names):
                out.append(f"{where}: tests a policy's type ({ast.unparse(node)})")
        elif isinstance(node, ast.Call) and _call_name(node) in {"getattr", "hasattr"}:
            target = node.args[0] if node.args else None
            if isinstance(target, ast.Attribute | ast.Name) and "policy" in ast.unparse(target):
                out.append(
                    f"{where}: probes the policy ({ast.unparse(node)}); give it an attribute"
                )
    return out


def server_modules() -> list[Path]:
    return sorted(p for p in SERVER.glob("*.py") if p.name not in POLICY_MODULES)


def test_no_mode_decisions_outside_the_policies() -> None:
    files = server_modules()
    assert len(files) > 10, "ps/server moved?"
    found = [v for f in files for v in violations(f.read_text(), f.name)]
    assert not found, "mode decisions outside the policy modules:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'if job.mode == "sync":\n    pass',
        'sync = st.job is not None and st.job.mode != "async"',
        "x = mode in ('sync', 'ssp')",
        "m.due(step, self.job.mode)",
        "match job.mode:\n    case 'sync':\n        pass",
        "if isinstance(st.policy, SyncPolicy):\n    pass",
        'pending = getattr(self.policy, "pending", None)',
    ],
)
def test_the_wall_catches_what_it_should(source: str) -> None:
    assert violations(source, "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "st.policy = make_policy(job.mode, job.staleness)",
        "self.metrics.set_mode(job.mode)",
        'raise ValueError(f"waited ({job.mode})")',
        "if self.policy.rounds:\n    pass",
        'policy = getattr(self, "policy", None)',
    ],
)
def test_the_wall_lets_through_what_it_should(source: str) -> None:
    assert not violations(source, "x.py")
