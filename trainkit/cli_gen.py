"""Generate argparse flags from a dataclass tree, and build the tree back from them.

Each field becomes one flag whose help is the field's docstring (the string literal
under it in the source), so the config tree is the single place options are declared.
Nested dataclasses are flattened: their fields become flags too, with an optional
prefix. A field declared with `everyday(default)` is shown by the default --help; the
others only by --help-all (the mark lives on the field, so no list can drift from it). A
TOML file (--config) fills the same tree, one [section] per nested dataclass; flags given
on the command line win.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import re
import sys
import textwrap
import tomllib
import typing
from functools import cache
from typing import Any

EVERYDAY = "psar.everyday"
"""Field metadata key: the field's flag is shown by the default --help."""


def everyday(
    default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A dataclass field whose flag the default `--help` shows (every other field's flag
    is accepted the same, and listed by `--help-all`)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={EVERYDAY: True}
    )


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
    section's group), with the old names `cls.FLAG_ALIASES` gives ({flag: old names}).
    Where some fields are marked `everyday`, the others are left out of --help (they
    parse all the same) and a --help-all flag shows every one."""
    from psar.trainkit.cli_strict import HelpAll

    seen: dict[str, tuple[str, ...]] = {}
    groups: dict[Any, Any] = {}
    titled = {
        flag: title for title, flags in getattr(cls, "HELP_GROUPS", {}).items() for flag in flags
    }
    aliases = getattr(cls, "FLAG_ALIASES", {})
    fields = list(_walk(cls))
    hidden = sum(1 for *_, f, _ in fields if not f.metadata.get(EVERYDAY))
    if hidden < len(fields):  # some are everyday: the rest wait for --help-all
        parser.add_argument(
            "--help-all",
            action=HelpAll,
            help=f"show all {len(fields)} flags ({hidden} more than this list), then exit",
        )
    else:
        hidden = 0
    for title in getattr(cls, "HELP_GROUPS", {}):  # in the order the class gives them
        groups[title] = parser.add_argument_group(title)
    for path, flag, t, f, doc in fields:
        if flag in seen:
            raise RuntimeError(f"flag {flag} generated twice ({seen[flag]} and {path})")
        seen[flag] = path
        section: Any = titled.get(flag, path[:-1])
        if section not in groups:
            title = section if isinstance(section, str) else (section[-1] if section else None)
            groups[section] = parser.add_argument_group(title) if title else parser
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kw: dict[str, Any] = {"dest": ".".join(path), "default": argparse.SUPPRESS}
        kw["help"] = help_text(doc, default)
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
        if hidden and not f.metadata.get(EVERYDAY):
            action.full_help = action.help  # type: ignore[attr-defined]
            action.help = argparse.SUPPRESS


_STATES_DEFAULT = re.compile(r"\(default\b|\bdefault \(|\(the default\b", re.IGNORECASE)
"""A docstring that already says its default (an env variable, `auto` explained): the
value would only contradict it ("(default: env RANK, else 0). (default: -1)")."""


def help_text(doc: str, default: Any) -> str:
    """A field's help: its docstring, then its default, said once and as a user types it
    (on/off for switches, no quotes); nothing where there is no value to state (an empty
    string or list: off, or unset) or where the docstring says it already."""
    if _STATES_DEFAULT.search(doc) or default in ("", []):
        return doc
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif default is None:
        shown = "auto"
    else:
        shown = str(default)
    return f"{doc} (default: {shown})" if doc else f"(default: {shown})"


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
    values = load_config_file(cls, config_file) if config_file else {}
    for dest, value in vars(args).items():
        if "." not in dest and dest not in {f.name for f in dataclasses.fields(cls)}:
            continue
        node = values
        *parents, leaf = dest.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return _construct(cls, values, ())


def load_config_file(cls: type, path: str) -> dict[str, Any]:
    """A --config TOML file's settings for `cls`'s tree: top-level keys are its own
    fields, one [section] per nested dataclass ([optimizer] lr = 0.1). Unknown keys and
    values of the wrong type are refused (ValueError), naming the key and, for an
    unknown one, the closest spellings in the tree (`lr` at the top: [optimizer] lr)."""
    where = f"--config {path}"
    try:
        with open(path, "rb") as fh:
            values = tomllib.load(fh)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML: {e}") from None
    _check_file(cls, values, (), cls, where)
    return values


def _check_file(cls: type, values: dict[str, Any], path: tuple[str, ...], root: type,
                where: str) -> None:  # fmt: skip
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():
        at = _spelling(path + (key,))
        if key not in names:
            near = _closest_keys(root, key, path)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ValueError(
                f"{where}: unknown key {at}{hint} (keys are the config tree's fields, one "
                "[section] per group: see --help-all)"
            )
        t = hints[key]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {key} is a section: write it as [{key}] and its keys")
            _check_file(t, value, path + (key,), root, where)
        elif (problem := _type_problem(value, t)) is not None:
            raise ValueError(f"{where}: {at}: expected {problem}, got {value!r}")


def _type_problem(value: Any, t: Any) -> str | None:
    """What `value` (from TOML) should have been for a field of type `t`; None if fine."""
    if t is bool or t == bool | None:
        return None if isinstance(value, bool) else "true or false"
    if t is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if t is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "a number"
    if typing.get_origin(t) is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return None if ok else 'a list of strings (["a=1", "b=2"])'
    # str fields: a string (a number is let through where the field reads one, as the
    # shard's torch_threads = 4 does); never a table, list or boolean.
    return "a string" if isinstance(value, dict | list | bool) else None


def _spelling(path: tuple[str, ...]) -> str:
    """A key as a TOML file spells it: `steps`, `[optimizer] lr`, `[ps]`."""
    return f"[{'.'.join(path[:-1])}] {path[-1]}" if len(path) > 1 else path[-1]


def _closest_keys(root: type, key: str, here: tuple[str, ...]) -> list[str]:
    """Where in `root`'s tree a key spelled like `key` lives: by field name or flag name
    (`batch-size` -> batch_size, `lr` -> [optimizer] lr, `optimiser` -> [optimizer]);
    the section `here` first."""
    places: dict[str, list[tuple[str, ...]]] = {}
    for path, flag, *_ in _walk(root):
        for name in (path[-1], flag.lstrip("-").replace("-", "_")):
            places.setdefault(name, []).append(path)
        for i in range(1, len(path)):  # the sections above it
            places.setdefault(path[i - 1], []).append(path[:i])
    wanted = key.replace("-", "_")
    out: list[str] = []
    for name in difflib.get_close_matches(wanted, places, n=1, cutoff=0.6):  # the closest
        for p in sorted(set(places[name]), key=lambda p: (p[:-1] != here, p)):
            shown = f"[{'.'.join(p)}]" if _is_section(root, p) else _spelling(p)
            if shown not in out:
                out.append(shown)
    return out[:3]


def _is_section(root: type, path: tuple[str, ...]) -> bool:
    t: Any = root
    for name in path:
        t = typing.get_type_hints(t)[name]
    return dataclasses.is_dataclass(t)


def _construct(cls: type, values: dict[str, Any], path: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        t = hints[name]
        if dataclasses.is_dataclass(t):
            kwargs[name] = _construct(t, value, path + (name,))
        elif t is float and isinstance(value, int):
            kwargs[name] = float(value)  # TOML's `lr = 1` is a float field's 1.0
        else:
            kwargs[name] = value
    return cls(**kwargs)
