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
import sys
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
    fields too (PSConfig inherits psar.trainkit.connection.ConnectionConfig's)."""
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
        own = getattr(cls, "FLAG_NAMES", {}).get(f.name)
        if own is not None:  # a class's own name for its field's flag (one meaning a name)
            yield path + (f.name,), own, t, f, field_docs(cls).get(f.name, "")
            continue
        flag = RENAMES.get((path[-1] if path else "", f.name), prefix + f.name.replace("_", "-"))
        yield path + (f.name,), "--" + flag, t, f, field_docs(cls).get(f.name, "")


def _aliased(action: type[argparse.Action], new: str) -> type[argparse.Action]:
    """`action`, noting on stderr that an old flag name was used (it still works)."""

    class Aliased(action):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204
            if (
                option_string is not None
                and option_string != new
                and option_string in (getattr(self, "old_names", ()))
            ):
                print(f"{parser.prog}: note: {option_string} is now {new} (the old name still "
                      "works)", file=sys.stderr)  # fmt: skip
            super().__call__(parser, namespace, values, option_string)

    return Aliased


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per leaf field of `cls` (defaults suppressed: only given flags parse),
    in the help groups `cls.HELP_GROUPS` names ({title: flags}; a flag in none goes to its
    section's group), with the old names `cls.FLAG_ALIASES` gives ({flag: old names})."""
    seen: dict[str, tuple[str, ...]] = {}
    groups: dict[Any, Any] = {}
    titled = {
        flag: title for title, flags in getattr(cls, "HELP_GROUPS", {}).items() for flag in flags
    }
    aliases = getattr(cls, "FLAG_ALIASES", {})
    for title in getattr(cls, "HELP_GROUPS", {}):  # in the order the class gives them
        groups[title] = parser.add_argument_group(title)
    for path, flag, t, f, doc in _walk(cls):
        if flag in seen:
            raise RuntimeError(f"flag {flag} generated twice ({seen[flag]} and {path})")
        seen[flag] = path
        section: Any = titled.get(flag, path[:-1])
        if section not in groups:
            title = section if isinstance(section, str) else (section[-1] if section else None)
            groups[section] = parser.add_argument_group(title) if title else parser
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kw: dict[str, Any] = {"dest": ".".join(path), "default": argparse.SUPPRESS}
        shown = "auto" if default is None and t == bool | None else repr(default)
        kw["help"] = f"{doc} (default: {shown})" if doc else f"(default: {shown})"
        if t is bool or t == bool | None:  # None: auto, decided where it is used
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(t) is list:
            kw["action"] = "append"
            kw["metavar"] = "VALUE"
        else:
            kw["type"] = t
            kw["metavar"] = f.name.upper()
        old = tuple(aliases.get(flag, ()))
        if old:
            kw["action"] = _aliased(_action_class(kw.get("action", "store")), flag)
            kw["help"] += f" (old name: {', '.join(old)})"
        action = groups[section].add_argument(flag, *old, **kw)
        action.old_names = old  # type: ignore[attr-defined]


def _action_class(action: str | type[argparse.Action]) -> type[argparse.Action]:
    if isinstance(action, str):
        return {"store": argparse._StoreAction, "append": argparse._AppendAction}[action]
    return action


def flag_names(cls: type) -> list[str]:
    """Every flag generated for `cls`, in order."""
    return [flag for _, flag, *_ in _walk(cls)]


def accepted_flags(cls: type) -> list[str]:
    """Every flag `cls`'s command accepts: its names and their old names (tests freeze
    this list: users' scripts keep working)."""
    aliases = getattr(cls, "FLAG_ALIASES", {})
    return [name for flag in flag_names(cls) for name in (flag, *aliases.get(flag, ()))]


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
