"""The front door: `import psar`, its public names, and what importing costs (issue #44 item 2).

`import psar` is lazy (PEP 562): it loads neither torch nor any psar.ps module until a
public name is used, and a name of the worker's side (prepare, launch, TrainConfig) never
loads the parameter server. docs/api.md documents each public name.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import psar

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(code: str) -> list[str]:
    """Modules of interest loaded by `code` in a fresh interpreter (from an empty folder)."""
    probe = (
        code + "\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'grpc', 'psar'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_psar_loads_nothing_heavy() -> None:
    mods = loaded_after("import psar\nassert psar.__version__")
    assert mods == ["psar"], mods


def test_worker_side_names_load_no_parameter_server() -> None:
    mods = loaded_after(
        "import psar\npsar.prepare, psar.OwnLoop, psar.launch, psar.LaunchSpec, "
        "psar.TrainConfig, psar.Workload, psar.train"
    )
    assert "psar.worker.own_loop" in mods and "psar.worker.launch" in mods
    assert [m for m in mods if m == "psar.ps" or m.startswith("psar.ps.")] == []
    assert [m for m in mods if m.startswith("psar.allreduce")] == []


def test_server_side_names_load_the_shard() -> None:
    mods = loaded_after("import psar\npsar.serve, psar.ServerConfig, psar.Mode")
    assert "psar.ps.server.serve" in mods and "psar.worker.own_loop" not in mods


def test_every_public_name_resolves_to_what_it_says() -> None:
    from psar.ps.server.config import ServerConfig
    from psar.trainkit.config import TrainConfig
    from psar.worker.own_loop import prepare

    assert psar.prepare is prepare and psar.TrainConfig is TrainConfig
    assert psar.ServerConfig is ServerConfig
    for name in psar.__all__:
        assert getattr(psar, name) is not None, name
    assert set(psar.__all__) == {"__version__", *psar._PUBLIC}
    assert set(psar.__all__) <= set(dir(psar))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        psar.nope  # noqa: B018


def test_version_matches_the_installed_distribution() -> None:
    from importlib.metadata import version

    assert psar.__version__ == version("psar")


def test_docs_api_lists_every_public_name() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^### `psar\.(\w+)`", text, re.M))
    assert documented == set(psar.__all__), (
        f"docs/api.md lacks {sorted(set(psar.__all__) - documented)}, "
        f"documents unknown {sorted(documented - set(psar.__all__))}"
    )


def test_python_dash_m_psar_is_the_cli() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "psar", "--help"], capture_output=True, text=True, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    assert "usage: psar" in r.stdout and "train" in r.stdout and "server" in r.stdout
