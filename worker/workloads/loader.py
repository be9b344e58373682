"""Resolve a ``--workload`` spec to a factory and build the Workload.

A spec is either a built-in name (see :data:`BUILTINS`) or ``package.module:function``
naming a user's factory. Built-ins go through the same import path as user factories,
so there is exactly one way a workload gets loaded.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from psar.trainkit.sparse_tables import materialize_tables
from psar.worker.workloads.base import Workload

__all__ = ["BUILTINS", "load_workload", "resolve_factory"]

BUILTINS: dict[str, str] = {
    "mlp": "psar.worker.workloads.mlp:make",
    "lm": "psar.worker.workloads.lm:make",
    "recsys": "psar.worker.workloads.recsys:make",
}
"""Built-in workload names and the ``module:function`` factory each one stands for."""

_FORM_HELP = (
    "pass a built-in name ({names}) or 'package.module:function' naming a factory "
    "`def factory(seed: int, **options) -> psar.worker.workloads.Workload` "
    "importable from this process (see docs/workloads.md)"
)


def _form_help() -> str:
    return _FORM_HELP.format(names=", ".join(sorted(BUILTINS)))


def resolve_factory(spec: str) -> Callable[..., Any]:
    """Return the factory callable that ``spec`` names, or raise a ValueError saying why not."""
    spec = spec.strip()
    target = BUILTINS.get(spec, spec)
    if ":" not in target:
        raise ValueError(f"unknown workload {spec!r}: {_form_help()}")
    module_name, _, attr_path = target.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"malformed workload spec {spec!r}: {_form_help()}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"workload {spec!r}: cannot import module {module_name!r} ({exc}); "
            "make sure it is installed or its directory is on PYTHONPATH "
            f"in every worker process"
        ) from exc
    obj: Any = module
    # Allow dotted attributes (module:Class.factory) for factories kept on a class.
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise ValueError(
                f"workload {spec!r}: module {module_name!r} has no attribute {attr_path!r} "
                f"(public names: {', '.join(public) or 'none'})"
            ) from None
    if not callable(obj):
        raise ValueError(
            f"workload {spec!r}: {module_name}:{attr_path} is a {type(obj).__name__}, "
            "not a callable factory(seed, **options) -> Workload"
        )
    return obj


def load_workload(
    spec: str, seed: int, options: Mapping[str, str] | None = None, *, materialize: bool = True
) -> Workload:
    """Build the workload named by ``spec`` with ``factory(seed, **options)``.

    Args:
        spec: built-in name (``"mlp"``, ``"lm"``) or ``"package.module:function"``.
        seed: seeds the model's initial weights (and any generated data); every
            process of a job must pass the same value.
        options: ``--workload-option key=value`` pairs, passed as keyword arguments.
            Values are strings; each factory converts the types it needs.
        materialize: build sparse tables left on the meta device (trainkit/
            sparse_tables.py), so the model runs as it is; the training loop passes
            False and lets its backend decide (a PS worker never holds a table).

    Raises:
        ValueError: the spec cannot be resolved, an option is not accepted by the
            factory, or the factory returns something that is not a Workload.
    """
    factory = resolve_factory(spec)
    kwargs = dict(options or {})
    for key in kwargs:
        if not key.isidentifier():
            raise ValueError(f"workload option {key!r} is not a valid name (use key=value)")
    _check_options(spec, factory, seed, kwargs)
    workload = factory(seed, **kwargs)
    if not isinstance(workload, Workload):
        raise ValueError(
            f"workload {spec!r}: factory returned {type(workload).__name__}, expected "
            "psar.worker.workloads.Workload (return Workload(model=..., train_dataset=..., loss_fn=...))"
        )
    if materialize:
        materialize_tables(workload.model)
    return workload


def _check_options(spec: str, factory: Callable[..., Any], seed: int, kwargs: dict) -> None:
    """Reject unknown options before calling the factory.

    Binding against the signature (rather than catching TypeError from the call)
    avoids mistaking a TypeError raised inside the factory for a bad option.
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # builtins/C callables without a signature: let the call decide
    try:
        sig.bind(seed, **kwargs)
    except TypeError as exc:
        accepted = [
            name
            for name, p in list(sig.parameters.items())[1:]
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        unknown = sorted(k for k in kwargs if k not in accepted)
        if unknown:
            raise ValueError(
                f"workload {spec!r} does not accept option(s) {', '.join(unknown)}; "
                f"accepted options: {', '.join(accepted) or 'none'}"
            ) from None
        raise ValueError(
            f"workload {spec!r}: cannot call factory{sig} as factory(seed, **options): {exc}"
        ) from None
