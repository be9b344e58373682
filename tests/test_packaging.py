"""One import name, `psar`: what the install puts in site-packages and what the code imports.

The folders stay where the layout puts them (ps/, worker/, allreduce/, trainkit/) and
install under `psar` (pyproject's package-dir). Nothing in the project may import them
by their bare folder names: from a checkout that would load a second copy of a module
under another name (or a user's own `worker.py`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("ps", "worker", "allreduce", "trainkit")
BARE = re.compile(rf"^({'|'.join(FOLDERS)})(\.|$)")
TEXT_SUFFIXES = {".md", ".sh", ".sbatch", ".yaml", ".yml", ".toml", ".cpu", ".cuda", ".py"}


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every file under the root
        return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    return [ROOT / f for f in out.stdout.split()]


def bare_imports(source: str) -> list[str]:
    """`import ps...` / `from worker... import` statements of `source` (any depth)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if BARE.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and BARE.match(node.module or ""):
            found.append(f"from {node.module} import ...")
    return found


# In text: `python -m worker.cli`, `from ps.server import`, `import_module("worker.x")`,
# "worker.workloads.mlp:make" (a workload's spec).
TEXT_BARE = re.compile(
    rf"(?:-m |from |import |[\"'`])({'|'.join(FOLDERS)})\.(?!py\b|pt\b|sbatch\b|proto\b)[a-z_]+"
)


def test_bare_import_scan_finds_what_it_must() -> None:
    src = "import ps.wire\nfrom worker import cli\ndef f():\n    from trainkit.optim import x\n"
    assert bare_imports(src) == ["import ps.wire", "from worker import ...",
                                 "from trainkit.optim import ..."]  # fmt: skip
    assert bare_imports("import psar.ps.wire\nfrom psar.worker import cli\nimport psutil\n") == []
    assert TEXT_BARE.search("python -m worker.cli train") and TEXT_BARE.search('"ps.server"')
    assert not TEXT_BARE.search("python -m psar.worker.cli; save to ps.pt, ps.sbatch")


def test_nothing_imports_a_folder_by_its_bare_name() -> None:
    bad = []
    for f in tracked():
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("ps/_gen/") or f.suffix not in TEXT_SUFFIXES or not f.exists():
            continue
        if f.resolve() == Path(__file__).resolve():  # this file's own examples
            continue
        text = f.read_text(errors="replace")
        if f.suffix == ".py":
            bad += [f"{rel}: {s}" for s in bare_imports(text)]
        bad += [f"{rel}: {m.group(0)}" for m in TEXT_BARE.finditer(text)]
    assert not bad, "bare folder names used as import names (use psar.<folder>):\n" + "\n".join(bad)


def test_pyproject_installs_every_package_under_psar() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"psar": "psar", **{f"psar.{f}": f for f in FOLDERS}}
    on_disk = {"psar"} | {
        "psar." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(cfg["packages"]) == on_disk, "pyproject's packages list and the folders differ"


def test_the_installed_project_has_one_top_level_name(tmp_path: Path) -> None:
    """From a folder outside the checkout: psar imports, the bare folder names do not."""
    code = (
        "import importlib.util, json\n"
        "import psar.ps.wire, psar.trainkit.config, psar.allreduce, psar.trainkit.optim\n"
        f"print(json.dumps([n for n in {list(FOLDERS)!r} if importlib.util.find_spec(n)]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"importable by a bare name: {r.stdout}"


@pytest.mark.slow
def test_the_wheel_holds_only_psar(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("psar-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"psar"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "psar/ps/_gen/psar/v1/ps_pb2.py" in names and "psar/worker/cli.py" in names
    assert "psar/ps/_gen/psar/v1/ps_pb2.pyi" in names
