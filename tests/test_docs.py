"""Docs a newcomer can hold (issue #44 item 7), held by tests.

Bounds: no page of docs/ over 600 lines, bench/README.md at most 300, at most 8 scripts at
the top of bench/ (the rest live in bench/experiments/, bench/gpu/, ...). Links: every
relative link in README.md, bench/README.md and docs/*.md names a file that exists, and
where it names a heading of a markdown file (`page.md#heading`) that heading exists, so a
page merged, moved or restructured leaves no dead link behind. Commands: every
`python -m bench.X` and `bench/...` path those pages give runs something that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_DOC_LINES = 600
MAX_BENCH_README_LINES = 300
MAX_BENCH_SCRIPTS = 8

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BENCH_MODULE = re.compile(r"python3? -m (bench(?:\.\w+)*)")
BENCH_PATH = re.compile(r"(?<![\w/.])(bench/[\w/.]+\.(?:py|sh))")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link in an example is not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def dead_links(page: Path) -> list[str]:
    """The relative links of `page` whose file, or heading, is not there."""
    dead = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
        if not file.exists():
            dead.append(f"{target} (no file {shown})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{target} (no heading #{anchor} in {shown})")
    return dead


def rename_table_removed(text: str) -> str:
    """results.md's table of commands as they were once spelled, which no longer run."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith("| as run then |"):
            skipping = True
        elif skipping and not line.startswith("|"):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


def missing_bench_commands(page: Path) -> list[str]:
    text = rename_table_removed(page.read_text())
    missing = []
    for module in sorted(set(BENCH_MODULE.findall(text))):
        if any(part.isupper() for part in module.split(".")):  # a placeholder: bench.NAME
            continue
        rel = Path(*module.split("."))
        if (
            not (ROOT / rel.with_suffix(".py")).exists()
            and not (ROOT / rel / "__main__.py").exists()
        ):
            missing.append(f"python -m {module}")
    for path in sorted(set(BENCH_PATH.findall(text))):
        if not (ROOT / path).exists():
            missing.append(path)
    return missing


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_no_page_of_docs_is_over_the_bound(page: Path) -> None:
    n = len(page.read_text().splitlines())
    assert n <= MAX_DOC_LINES, (
        f"{page.relative_to(ROOT)} has {n} lines (at most {MAX_DOC_LINES}): split it, or move "
        "dated figures into docs/results.md and method notes beside their benchmark"
    )


def test_bench_readme_is_short() -> None:
    n = len((ROOT / "bench" / "README.md").read_text().splitlines())
    assert n <= MAX_BENCH_README_LINES, (
        f"bench/README.md has {n} lines (at most {MAX_BENCH_README_LINES}): a benchmark's full "
        "method goes in its module docstring, its figures in docs/results.md"
    )


def test_bench_has_few_top_level_scripts() -> None:
    scripts = sorted(
        p.name for p in (ROOT / "bench").iterdir() if p.is_file() and p.suffix in (".py", ".sh")
    )
    assert len(scripts) <= MAX_BENCH_SCRIPTS, (
        f"bench/ holds {len(scripts)} top-level scripts ({', '.join(scripts)}), at most "
        f"{MAX_BENCH_SCRIPTS}: move one-off measurements to bench/experiments/"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_what_exists(page: Path) -> None:
    assert dead_links(page) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_commands_name_what_exists(page: Path) -> None:
    assert missing_bench_commands(page) == []


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A dead file, a dead heading and a moved benchmark are each reported; live ones not."""
    (tmp_path / "other.md").write_text("# Other\n\n## Local SGD (`--mode local`, both)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#local-sgd---mode-local-both) [self](#page) [web](https://x.y)\n"
        "[gone](gone.md) [no heading](other.md#nowhere)\n\n```\n[in code](nope.md)\n```\n"
    )
    assert [d.split(" (")[0] for d in dead_links(page)] == ["gone.md", "other.md#nowhere"]
    cmds = tmp_path / "cmds.md"
    cmds.write_text(
        "`python -m bench.links` `python -m bench.no_such` `bash bench/gone.sh`\n\n"
        "| as run then | today |\n|---|---|\n| `python -m bench.run_all` | `python -m bench` |\n"
    )
    assert missing_bench_commands(cmds) == ["python -m bench.no_such", "bench/gone.sh"]
