"""The walls between the packages (docs/architecture.md), held by tests.

Each closure test imports every module of one package in a fresh interpreter and lists
what got loaded: a shard must not load the worker, a worker's client must not load the
shard, a DDP run must not load the parameter server, and the neutral package loads
neither side. The cycle tests read the import statements themselves (module level and
inside functions): in ps/ every import counts, ``if TYPE_CHECKING:`` blocks too, so the
parts of the shard depend on each other one way only (issue #32); elsewhere those blocks
do not run, so they do not count.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> module prefixes none of its modules may load
# The contracts (backend protocol, config tree, precision, recorder, flag generation) are
# in trainkit/, the ground floor: the shard, the PS client and DDP are siblings above it,
# none of them loads another or the worker package that drives them.
WALLS = {
    "ps/server": ("psar.worker", "psar.allreduce", "psar.ps.client"),
    "ps/client": ("psar.ps.server", "psar.allreduce", "psar.worker"),
    "allreduce": ("psar.ps", "psar.worker"),
    "trainkit": ("psar.ps", "psar.worker", "psar.allreduce"),
}
CLI = ("worker/cli.py", "worker/cli_parser.py")
"""Only the CLI knows both the shard and the worker."""


def modules_of(package: str, *, recursive: bool = True) -> list[str]:
    """The import names (psar.…) of the modules in the folder `package` ("ps/server")."""
    folder = ROOT / package
    files = folder.rglob("*.py") if recursive else folder.glob("*.py")
    out = []
    for f in sorted(files):
        if "_gen" in f.parts:
            continue
        rel = f.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(["psar", *parts]))
    return out


def file_of(module: str) -> Path:
    rel = module.removeprefix("psar.").replace(".", "/")
    f = ROOT / (rel + ".py")
    return f if f.exists() else ROOT / rel / "__init__.py"


def loaded_after_importing(mods: list[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(WALLS))
def test_package_loads_nothing_across_its_wall(package: str) -> None:
    mods = modules_of(package)
    assert mods, f"no modules found under {package}"
    loaded = loaded_after_importing(mods)
    banned = WALLS[package]
    crossed = [m for m in loaded if any(m == b or m.startswith(b + ".") for b in banned)]
    assert not crossed, f"importing {package} loads {crossed} (forbidden: {banned})"


def test_shared_ps_modules_load_neither_side() -> None:
    mods = [m for m in modules_of("ps", recursive=False) if m != "psar.ps"]
    assert "psar.ps.wire" in mods and "psar.ps.serde" in mods
    loaded = loaded_after_importing(mods)
    banned = ("psar.ps.server", "psar.ps.client", "psar.worker", "psar.allreduce")
    crossed = [m for m in loaded if any(m == b or m.startswith(b + ".") for b in banned)]
    assert not crossed, f"the shared ps modules load {crossed}"


def _imports(path: Path, package_of: str, *, strict: bool = False) -> set[str]:
    """Modules `path` imports (module level and inside functions); TYPE_CHECKING blocks
    left out unless `strict`."""
    return imports_in(path.read_text(), strict=strict)


def imports_in(source: str, *, strict: bool = False) -> set[str]:
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not strict and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            # `from psar.ps.server import shard` imports the module psar.ps.server.shard
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def import_graph(package: str, *, strict: bool) -> dict[str, set[str]]:
    mods = set(modules_of(package))
    graph = {}
    for m in mods:
        f = file_of(m)
        # a package's __init__ is loaded by its modules anyway: not an edge worth a cycle
        found = _imports(f, m, strict=strict)
        graph[m] = {i for i in found if i in mods and i != m and not m.startswith(i + ".")}
    return graph


@pytest.mark.parametrize("package", ["ps", "trainkit", "worker", "allreduce"])
def test_no_import_cycles(package: str) -> None:
    graph = import_graph(package, strict=package == "ps")
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_ps_counts_every_import() -> None:
    """ps/'s graph has the edges only TYPE_CHECKING or a function body hold, and the scan
    finds a cycle made of them."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from psar.ps.server.shard import ShardState\n"
        "def f():\n    from psar.ps.server.state import ShardData\n"
    )
    assert imports_in(source, strict=True) >= {"psar.ps.server.shard", "psar.ps.server.state"}
    assert "psar.ps.server.shard" not in imports_in(source)
    graph = import_graph("ps", strict=True)
    assert sum(map(len, graph.values())) > 100, "the scan found few imports: did it break?"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_a_ddp_process_loads_nothing_of_the_parameter_server() -> None:
    """What a DDP worker imports and runs before training: its config (validated),
    the backend the loop picks, the DDP backend. None of it may load ps/."""
    code = (
        "import json, sys\n"
        "from psar.trainkit.config import TrainConfig\n"
        "from psar.worker.loop import backend_class\n"
        "backend_class(TrainConfig(arch='allreduce'))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'psar.ps' or m.startswith('psar.ps.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _mixed_in(folder: str) -> list[str]:
    """Classes of `folder` with more than one base of the project's own, or named as a
    mixin: "file: Class(bases)"."""
    mixed = []
    for f in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(f.read_text())
        local = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("psar.")
            for a in n.names
        } | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                own = [ast.unparse(b) for b in n.bases if ast.unparse(b).split(".")[0] in local]
                if len(own) > 1 or n.name.endswith("Mixin"):
                    mixed.append(f"{f.relative_to(ROOT)}: {n.name}({', '.join(own)})")
    return mixed


@pytest.mark.parametrize("folder", ["ps/server", "ps/client", "allreduce"])
def test_the_shard_and_the_backends_are_composed_not_mixed_in(folder: str) -> None:
    """No class of the shard or of either backend has more than one base of the
    project's own, nor is a mixin: the shard's components are attributes of ShardState,
    the PS backend's parts (overlap, resync, local SGD, own optimizer, elastic
    membership) attributes of PSBackend, the gRPC client's groups of calls (doors,
    membership, optimizer) attributes of PSClient, each called, not inherited."""
    mixed = _mixed_in(folder)
    assert mixed == [], "classes mixing several of the project's bases:\n" + "\n".join(mixed)


def test_the_mixin_check_finds_a_mixin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a class of two of the project's bases is found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "from psar.ps.client.backend_resync import Resync\n"
        "class AMixin:\n    pass\n"
        "class B(AMixin, Resync):\n    pass\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _mixed_in("pkg") == ["pkg/m.py: AMixin()", "pkg/m.py: B(AMixin, Resync)"]


def test_only_the_cli_knows_the_shard() -> None:
    """Outside the CLI, no module of worker/, ps/client/, allreduce/ or trainkit/ imports
    the shard (psar.ps.server), at module level or inside a function."""
    bad = []
    for folder in ("worker", "ps/client", "allreduce", "trainkit"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            found = {m for m in _imports(f, rel, strict=True) if m.startswith("psar.ps.server")}
            if found and rel not in CLI:
                bad.append(f"{rel}: {sorted(found)}")
    assert not bad, "modules besides the CLI that import the shard:\n" + "\n".join(bad)


def _ps_modules_loaded(code: str, env: dict[str, str] | None = None) -> list[str]:
    import os

    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted("
         "m for m in sys.modules if m == 'psar.ps' or m.startswith('psar.ps.'))))\n"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prepare_under_allreduce_loads_nothing_of_the_parameter_server() -> None:
    """A user's own loop under DDP (a real gloo group of one) through prepare(): no
    psar.ps module is loaded, from the configuration to the first step and finish()."""
    from tests.procs import free_port

    code = (
        "import torch\n"
        "from psar.worker.own_loop import prepare\n"
        "model = torch.nn.Linear(4, 2)\n"
        "run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0)\n"
        "run.backward(run.model(torch.ones(3, 4)).sum())\n"
        "run.optimizer.step()\n"
        "run.finish()\n"
    )
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PSAR_ARCH": "allreduce"}  # fmt: skip
    assert _ps_modules_loaded(code, env) == []


def test_psar_train_allreduce_loads_nothing_of_the_parameter_server(tmp_path: Path) -> None:
    """`psar train --arch allreduce` end to end (a gloo group of one, two steps): Python's
    own import log (-X importtime) names no psar.ps module."""
    import os

    from tests.procs import free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "psar", "train", "--arch", "allreduce",
         "--steps", "2", "--eval-batches", "0", "--log-every", "1", "--run-dir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    imported = [
        ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if "import time:" in ln
    ]
    assert "psar.worker.loop" in imported and "psar.allreduce.backend" in imported
    assert [m for m in imported if m == "psar.ps" or m.startswith("psar.ps.")] == []


def test_the_hybrid_backend_composes_both_sides_lazily() -> None:
    """worker/hybrid.py sees the PS client and allreduce/ (the walls keep them apart, so
    the composition lives in worker/); importing it loads neither, and building a
    hybrid backend loads the client, never the shard."""
    code = (
        "import json, sys\n"
        "from psar.trainkit.config import PSConfig, TrainConfig\n"
        "import psar.worker.hybrid\n"
        "before = sorted(m for m in sys.modules if m.startswith(('psar.ps', 'psar.allreduce')))\n"
        "import torch\n"
        "from psar.trainkit.backend import BackendContext\n"
        "from psar.trainkit.precision import resolve\n"
        "from psar.worker.loop import make_backend\n"
        "cfg = TrainConfig(arch='hybrid', ps=PSConfig(servers='h:1'))\n"
        "fp32 = resolve(torch.device('cpu'), 'fp32', 'fp32', 'fp32')\n"
        "make_backend(BackendContext(cfg, fp32, 0, 1, 3))\n"
        "print(json.dumps([before, sorted(sys.modules)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == []
    assert "psar.ps.client.backend" in after
    assert not [m for m in after if m.startswith("psar.ps.server")]
