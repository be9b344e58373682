"""argparse as every psar command uses it: no flag is taken by its prefix, and a flag the
command does not know is answered by that command's own usage and the closest spellings.

argparse's own behaviour is the opposite on both counts: `--step` is silently taken as
`--steps` (allow_abbrev), and a subcommand's unknown flag travels up to the top-level
parser, which prints `psar`'s usage, not the subcommand's, and suggests nothing.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser with allow_abbrev off (always) whose parse_args refuses unknown
    flags in the usage of the (sub)command that was chosen, with the closest spellings.
    Subparsers made with add_subparsers are StrictParsers too (argparse's parser_class
    defaults to the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = chosen_subparser(self, ns)
            owner.error(unknown_message(extras, option_strings(owner)))
        return ns

    def refuse_unknown(self, tokens: Sequence[str], accepted: Iterable[str]) -> None:
        """For commands that pass their other flags on (psar launch and compare give them
        to every `psar train`): refuse, in this command's usage, each `--flag` in `tokens`
        that neither this command nor `accepted` knows."""
        known = set(accepted) | set(option_strings(self))
        unknown = [t for t in tokens if t.startswith("--") and t.split("=", 1)[0] not in known]
        if unknown:
            self.error(unknown_message(unknown, sorted(known)))


def chosen_subparser(parser: argparse.ArgumentParser, ns: Any) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that parsed `ns` (`parser` if none was chosen)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(ns, action.dest, None)
            if name in action.choices:
                return chosen_subparser(action.choices[name], ns)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag `parser` accepts, shown in --help or not (old names included)."""
    return [o for action in parser._actions for o in action.option_strings]


def closest(name: str, options: Iterable[str], n: int = 3) -> list[str]:
    """The flags among `options` spelled most like `name` (difflib; dashes ignored, so a
    short name is not 'close' to everything merely for sharing the leading `--`)."""
    bare = {o.lstrip("-"): o for o in options if o.startswith("--")}
    return [bare[m] for m in difflib.get_close_matches(name.lstrip("-"), bare, n=n, cutoff=0.6)]


def unknown_message(extras: Sequence[str], options: Iterable[str]) -> str:
    """`unrecognized arguments: ...`, and for each unknown flag the closest spellings."""
    options = list(options)
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    for token in extras:
        if not token.startswith("-") or token == "-":
            continue  # a value of the unknown flag before it
        name = token.split("=", 1)[0]
        near = closest(name, options)
        lines.append(
            f"  {name}: did you mean {' or '.join(near)}?"
            if near
            else f"  {name}: no flag is spelled like it (see --help)"
        )
    return "\n".join(lines)


class HelpAll(argparse.Action):
    """`--help-all`: show every flag, also those the default --help leaves out (their
    help text was set aside on the action as `full_help`), then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002  # fmt: skip
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> NoReturn:  # fmt: skip
        for action in parser._actions:
            if hasattr(action, "full_help"):
                action.help = action.full_help
        parser.print_help()
        parser.exit()
