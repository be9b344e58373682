"""The mode wall: only the mode modules decide by consistency mode.

Every decision that differs between the modes is a method or attribute of the shard's
UpdatePolicy or one of the mode's traits, both declared by the mode's module in
ps/server/modes/ (the sparse side in ps/server/modes/rows.py); the registry there is the one
place a mode name becomes a rule. Anywhere else in ps/server a mode may be named only to
label metrics (`set_mode`, ps/server/metrics/prometheus.py) or in a message. The workers' side
(ps/client) compares no mode name at all: it acts on the traits the shards send with the
job. The test reads the source (AST), so a new `job.mode == "sync"` fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "ps" / "server"
CLIENT = ROOT / "ps" / "client"
MODES = {"sync", "async", "ssp", "local"}
# The mode modules: the only ones that decide by mode.
MODES_PACKAGE = SERVER / "modes"
# Calls that may take a mode as an argument: label the metrics.
MODE_SINKS = {"set_mode"}
# metrics/prometheus.py keeps the mode as a metrics label (its own `mode` attribute, validated).
LABEL_MODULES = {"prometheus.py"}


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
    return sorted(p for p in SERVER.rglob("*.py") if MODES_PACKAGE not in p.parents)


def test_no_mode_decisions_outside_the_mode_modules() -> None:
    files = server_modules()
    assert len(files) > 10, "ps/server moved?"
    found = [v for f in files for v in violations(f.read_text(), f.name)]
    assert not found, "mode decisions outside the mode modules:\n" + "\n".join(found)


def comparisons(source: str, filename: str) -> list[str]:
    """The client's wall: no comparison or match on a mode (it may keep its mode as a
    label for reports and messages)."""
    return [
        v
        for v in violations(source, filename)
        if "compares a mode" in v or "matches on a mode" in v
    ]


def test_the_client_compares_no_mode_name() -> None:
    files = sorted(CLIENT.rglob("*.py"))
    assert len(files) > 10, "ps/client moved?"
    found = [v for f in files for v in comparisons(f.read_text(), f.name)]
    assert not found, "ps/client decides by a mode's name:\n" + "\n".join(found)
    assert comparisons('if self.mode in ("sync", "local"):\n    pass', "x.py")


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
        "st.policy = modes.rule(job, options)",
        "self.metrics.set_mode(job.mode)",
        'raise ValueError(f"waited ({job.mode})")',
        "if self.policy.rounds:\n    pass",
        'policy = getattr(self, "policy", None)',
    ],
)
def test_the_wall_lets_through_what_it_should(source: str) -> None:
    assert not violations(source, "x.py")
