"""Unit parsing and human formatting for ``psar plan``.

Parsers turn what people type (``500M``, ``100Gbit/s``, ``1.25GiB/s``, ``5us``) into
SI base units (a count, bytes/s, seconds, bytes) and raise ``ValueError`` with a
message naming the accepted forms; ``psar.worker.plan`` turns that into an argparse error.
Decimal arithmetic keeps ``1.5B`` exactly 1_500_000_000 and ``0.1ms`` exactly 1e-4 s.
Case matters where it carries meaning: ``b`` is bits and ``B`` bytes; ``Ki``/``Mi``/
``Gi``/``Ti`` are binary (2**10...) prefixes, ``k``/``M``/``G``/``T`` SI ones.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A plain decimal number: 500, 1.5, .5, 7e9. No sign, no inf/nan.
_NUM = r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"

PARAMS_FORMS = "500M, 1.5B, 7e9, 125k, 350000"
BANDWIDTH_FORMS = (
    "100Gbit/s, 25GB/s, 10Gbps, 1.25GiB/s, 800Mbit/s "
    "(b/bit = bits, B = bytes; k/M/G/T = SI, Ki/Mi/Gi/Ti = binary)"
)
LATENCY_FORMS = "5us, 0.5ms, 2s, 100ns (or 0)"
SIZE_FORMS = "25MiB, 4MB, 1GiB (k/M/G/T = SI, Ki/Mi/Gi/Ti = binary)"

# Parameter counts use the ML convention: B (and G) is billion, never bytes.
_COUNT_SUFFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_PREFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_PREFIX.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})
_TIME_UNIT = {"ns": Decimal("1e-9"), "us": Decimal("1e-6"), "ms": Decimal("1e-3"), "s": Decimal(1)}
_TIME_UNIT.update({"\u00b5s": Decimal("1e-6"), "\u03bcs": Decimal("1e-6")})  # micro sign, mu

_PARAMS_RE = re.compile(rf"{_NUM}\s*(?P<suf>[kKMBGT]?)")
# Case matters: lower-case b is bits, upper-case B bytes (10Gbps vs 10GBps).
_BANDWIDTH_RE = re.compile(rf"{_NUM}\s*(?P<pre>[kKMGT]i?)?(?P<unit>bits?|b|bytes?|B)(?:/s|/sec|ps)")
_LATENCY_RE = re.compile(rf"{_NUM}\s*(?P<unit>ns|us|\u00b5s|\u03bcs|ms|s)")
_SIZE_RE = re.compile(rf"{_NUM}\s*(?P<pre>[kKMGT]i?)?B")


def _decimal(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation as exc:  # the regexes should make this unreachable
        raise ValueError(text) from exc


def parse_params(text: str) -> int:
    """Parse a parameter count such as ``500M``, ``1.5B``, ``7e9`` or ``125k``.

    Decimal arithmetic keeps ``1.5B`` exactly 1_500_000_000; a count that is not a
    whole number of parameters (``1.5``) or is below one is rejected.
    """
    m = _PARAMS_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"cannot read {text!r}; use a parameter count like {PARAMS_FORMS}")
    value = _decimal(m["num"]) * _COUNT_SUFFIX[m["suf"]]
    if value != value.to_integral_value() or value < 1:
        raise ValueError(f"{text!r} is not a whole number >= 1 of parameters; use {PARAMS_FORMS}")
    return int(value)


def parse_bandwidth(text: str) -> float:
    """Parse a link bandwidth such as ``100Gbit/s`` or ``1.25GiB/s`` into bytes/s."""
    m = _BANDWIDTH_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"cannot read {text!r}; use forms like {BANDWIDTH_FORMS}")
    value = _decimal(m["num"]) * _PREFIX[m["pre"] or ""]
    if m["unit"] in ("b", "bit", "bits"):
        value /= 8
    if value <= 0:
        raise ValueError(f"{text!r} must be above zero; use forms like {BANDWIDTH_FORMS}")
    return float(value)


def parse_latency(text: str) -> float:
    """Parse a one-way message latency such as ``5us`` or ``0.5ms`` into seconds."""
    stripped = text.strip()
    if stripped in ("0", "0.0"):  # zero needs no unit
        return 0.0
    m = _LATENCY_RE.fullmatch(stripped)
    if m is None:
        raise ValueError(f"cannot read {text!r}; use forms like {LATENCY_FORMS}")
    return float(_decimal(m["num"]) * _TIME_UNIT[m["unit"]])


def parse_size(text: str) -> int:
    """Parse a byte size such as ``25MiB`` or ``4MB`` (the bucket size) into bytes."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"cannot read {text!r}; use forms like {SIZE_FORMS}")
    value = int(_decimal(m["num"]) * _PREFIX[m["pre"] or ""])
    if value < 1:
        raise ValueError(f"{text!r} must be at least one byte; use forms like {SIZE_FORMS}")
    return value


def human_bytes(n: float) -> str:
    """Format bytes with SI units (GB = 1e9 B), matching how the textbook counts."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"


def human_seconds(t: float) -> str:
    """Format a duration in s, ms, us or ns (ASCII ``us`` so any terminal shows it)."""
    if t == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(t) >= scale:
            return f"{t / scale:.4g} {unit}"
    return f"{t / 1e-9:.4g} ns"


def human_count(n: int) -> str:
    """Format a parameter count the way it is usually written: 500M, 1.5B."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)
