"""Which torchrun flags the installed torch accepts: `psar launch` passes only those
(torch 2.11's torchrun has no --shutdown-timeout and exits 2 on it)."""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

_SWAP = str.maketrans("-_", "_-")


@functools.cache
def torchrun_options() -> frozenset[str] | None:
    """Option strings of the installed torchrun (the parser it builds); None: unknown."""
    try:
        from torch.distributed.run import get_args_parser

        return frozenset(s for a in get_args_parser()._actions for s in a.option_strings)
    except Exception:  # noqa: BLE001 - an odd torch build: pass every flag, as before
        return None


def torchrun_flags(
    argv: Sequence[str], accepted: Collection[str] | None
) -> tuple[list[str], list[str]]:
    """(argv, notes): the `--flag value` pairs of argv that `accepted` lists (or its other
    -/_ spelling), and a note per pair dropped: torchrun exits 2 on a flag it lacks (torch
    2.11's has no --shutdown-timeout)."""
    out, notes = [], []
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        alt = "--" + flag[2:].translate(_SWAP)
        use = flag if accepted is None or flag in accepted else alt if alt in accepted else None
        out += [use, value] if use else []
        notes += [] if use else [f"this torchrun has no {flag}; not passing {flag} {value}"]
    return out, notes
