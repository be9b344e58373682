"""The checked-in stubs in ps/_gen match proto/psar/v1/*.proto, and live inside `ps`.

`proto` is the name of a popular PyPI distribution (proto-plus), so this project must
never provide a top-level `proto` (or `psar`) package: the stubs import as
psar.ps._gen.psar.v1.ps_pb2 and nothing else.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh() -> None:
    r = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (
        "ps/_gen is stale or the generator failed; run `python scripts/gen_protos.py`:\n"
        + r.stdout
        + r.stderr
    )
    assert "fresh" in r.stdout


def test_stubs_import_inside_the_ps_package() -> None:
    pb = importlib.import_module("psar.ps._gen.psar.v1.ps_pb2")
    pb_grpc = importlib.import_module("psar.ps._gen.psar.v1.ps_pb2_grpc")
    assert pb.DESCRIPTOR.package == "psar.v1"
    assert Path(pb.__file__).resolve().is_relative_to(ROOT / "ps" / "_gen")
    # The grpc stub imports its messages package-relatively, not as `psar.v1`.
    assert pb_grpc.psar_dot_v1_dot_ps__pb2 is pb
    for path in (ROOT / "ps" / "_gen").rglob("*.py"):
        text = path.read_text()
        assert "from psar" not in text and "import psar" not in text, path
        assert "from proto" not in text and "import proto" not in text, path


def test_no_top_level_proto_package_from_this_project(tmp_path: Path) -> None:
    # Run from an empty folder (the repo root, with its proto/ folder of .proto files,
    # must not be on sys.path) with the project installed as it is for users.
    code = textwrap.dedent(
        f"""
        import importlib.util, pathlib, sys
        root = pathlib.Path({str(ROOT)!r})
        bad = []
        # `psar` is the project's one import name; its stubs are psar.ps._gen.psar.v1,
        # never a top-level `proto` nor a `psar.v1` beside psar's own modules.
        for name in ("proto", "psar.v1"):
            spec = importlib.util.find_spec(name)
            if spec is None:
                continue
            places = [spec.origin or ""] + list(spec.submodule_search_locations or [])
            if any(p and pathlib.Path(p).resolve().is_relative_to(root) for p in places):
                bad.append((name, places))
        import psar.ps._gen.psar.v1.ps_pb2 as pb
        assert pb.__name__ == "psar.ps._gen.psar.v1.ps_pb2"
        print(bad)
        sys.exit(1 if bad else 0)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, f"a top-level package comes from this project: {r.stdout}{r.stderr}"
