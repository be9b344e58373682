"""Generate argparse flags from a dataclass tree, and build the tree back from them.

Each field becomes one flag whose help is the field's docstring (the string literal
under it in the source), so the config tree is the single place options are declared.
Nested dataclasses are flattened: their fields become flags too, with an optional
prefix. A TOML file (--config) fills the same tree; flags given on the command line win.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import tomllib
import typing
from functools import cache
from typing import Any

# Nested sections whose flags carry a prefix, and fields whose flag is renamed.
PREFIXES = {"loss_scale": "loss-scale-"}
RENAMES = {("optimizer", "name"): "optimizer", ("optimizer", "impl"): "optimizer-impl"}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields: {field name: text}, those of inherited
    fields too (PSConfig inherits trainkit.connection.ConnectionConfig's)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    docs.update(_own_field_docs(cls))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The docstrings under the fields declared in `cls`'s own class body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _walk(cls: type, path: tuple[str, ...] = (), prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from _walk(t, path + (f.name,), PREFIXES.get(f.name, ""))
            continue
        flag = RENAMES.get((path[-1] if path else "", f.name), prefix + f.name.replace("_", "-"))
        yield path + (f.name,), "--" + flag, t, f, field_docs(cls).get(f.name, "")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per leaf field of `cls` (defaults suppressed: only given flags parse)."""
    seen: dict[str, tuple[str, ...]] = {}
    groups: dict[tuple[str, ...], Any] = {}
    for path, flag, t, f, doc in _walk(cls):
        if flag in seen:
            raise RuntimeError(f"flag {flag} generated twice ({seen[flag]} and {path})")
        seen[flag] = path
        section = path[:-1]
        if section not in groups:
            title = section[-1] if section else None
            groups[section] = parser.add_argument_group(title) if title else parser
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kw: dict[str, Any] = {"dest": ".".join(path), "default": argparse.SUPPRESS}
        kw["help"] = f"{doc} (default: {default!r})" if doc else f"(default: {default!r})"
        if t is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(t) is list:
            kw["action"] = "append"
            kw["metavar"] = "VALUE"
        else:
            kw["type"] = t
            kw["metavar"] = f.name.upper()
        groups[section].add_argument(flag, **kw)


def flag_names(cls: type) -> list[str]:
    """Every flag generated for `cls`, in order (tests freeze this list)."""
    return [flag for _, flag, *_ in _walk(cls)]


def build(cls: type, args: argparse.Namespace, config_file: str | None = None) -> Any:
    """Defaults <- TOML file <- flags, then construct (and so validate) the tree."""
    values: dict[str, Any] = {}
    if config_file:
        with open(config_file, "rb") as fh:
            try:
                values = tomllib.load(fh)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"--config {config_file}: not valid TOML: {e}") from None
    for dest, value in vars(args).items():
        if "." not in dest and dest not in {f.name for f in dataclasses.fields(cls)}:
            continue
        node = values
        *parents, leaf = dest.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return _construct(cls, values, ())


def _construct(cls: type, values: dict[str, Any], path: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = ".".join(path) or "top level"
        raise ValueError(f"config: unknown key(s) {unknown} at {where}; accepted: {sorted(names)}")
    kwargs = {}
    for name, value in values.items():
        t = hints[name]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ValueError(f"config: [{name}] must be a table")
            kwargs[name] = _construct(t, value, path + (name,))
        else:
            kwargs[name] = value
    return cls(**kwargs)
