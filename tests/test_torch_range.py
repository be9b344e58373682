"""pyproject's torch range is what README.md says was tested, no wider and no narrower.

README.md's "torch versions tested" table lists each release run and how; pyproject
accepts from the oldest tested minor release up to, not including, the minor release
after the newest. Widening the range means running the suite on the new release and
adding its row (README.md says how).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def readme_torch_versions() -> list[str]:
    """The torch column of README.md's table under "torch versions tested"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### torch versions tested", 1)[1].split("\n#", 1)[0]
    rows = [ln for ln in section.splitlines() if re.match(r"\|\s*\d+\.\d+\.\d+", ln)]
    return [ln.split("|")[1].strip().split()[0] for ln in rows]


def torch_requirement() -> tuple[str, str]:
    """(lower, upper) of pyproject's `torch>=lower,<upper`."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"torch\b", d))
    m = re.fullmatch(r"torch\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)", spec)
    assert m, f"torch requirement {spec!r} is not of the form torch>=A,<B"
    return m.group(1), m.group(2)


def test_pyproject_accepts_exactly_the_tested_minor_releases() -> None:
    tested = readme_torch_versions()
    assert len(tested) >= 2, tested
    lower, upper = torch_requirement()
    minors = sorted(_minor(v) for v in tested)
    assert _minor(lower) == minors[0], (lower, tested)
    newest = minors[-1]
    assert _minor(upper) == (newest[0], newest[1] + 1), (upper, tested)


def test_the_running_torch_is_in_the_range() -> None:
    lower, upper = torch_requirement()
    assert _minor(lower) <= _minor(torch.__version__) < _minor(upper), torch.__version__
