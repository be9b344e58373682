"""psar: train the same PyTorch model under a parameter server or ring-allreduce.

The one import name of the project: its folders install under it (``psar.ps`` is ps/,
``psar.worker`` is worker/, ``psar.allreduce`` is allreduce/, ``psar.trainkit`` is
trainkit/), so a user's own ``worker.py`` or ``ps.py`` never shadows psar's code.

The public surface is the names below (docs/api.md shows each with an example); every
other module is private by convention and may change between releases::

    import psar

    run = psar.prepare(model, optimizer)          # your own loop, either architecture
    psar.launch(["--arch", "ps", "--workers", "2", "--", "python", "train.py"])
    psar.serve(psar.ServerConfig(bind="127.0.0.1:50051"))   # one shard, blocking

``import psar`` is lazy: it loads neither torch nor any ``psar.ps`` module until a name
is used, so ``psar --help`` answers at once and a DDP run never loads the parameter
server (tests/test_public_api.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> (module, attribute): where each public name lives. A name is imported the first
# time it is used (PEP 562), so `import psar` costs nothing and loads only what you use.
_PUBLIC: dict[str, tuple[str, str]] = {
    # a loop of your own (docs/own-loop.md)
    "prepare": ("psar.worker.own_loop", "prepare"),
    "OwnLoop": ("psar.worker.own_loop", "OwnLoop"),
    # a whole job on this machine (psar launch)
    "launch": ("psar.worker.launch", "launch"),
    "LaunchSpec": ("psar.worker.launch", "LaunchSpec"),
    # psar's own loop (psar train)
    "TrainConfig": ("psar.trainkit.config", "TrainConfig"),
    "train": ("psar.worker.loop", "train"),
    "Workload": ("psar.worker.workloads.base", "Workload"),
    # a parameter-server shard (psar server)
    "ServerConfig": ("psar.ps.server.config", "ServerConfig"),
    "serve": ("psar.ps.server.serve", "serve"),
    "start_server": ("psar.ps.server.serve", "start_server"),
    # the contract of a consistency mode of your own (docs/architecture.md)
    "Mode": ("psar.ps.server.modes.registry", "Mode"),
    "UpdatePolicy": ("psar.ps.server.modes.base", "UpdatePolicy"),
    "ShardView": ("psar.ps.server.modes.view", "ShardView"),
}

__all__ = [
    "__version__",
    "LaunchSpec",
    "Mode",
    "OwnLoop",
    "ServerConfig",
    "ShardView",
    "TrainConfig",
    "UpdatePolicy",
    "Workload",
    "launch",
    "prepare",
    "serve",
    "start_server",
    "train",
]
"""The public names (tests/test_public_api.py holds this list to _PUBLIC and docs/api.md)."""


def __getattr__(name: str) -> Any:
    try:
        module, attr = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'psar' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


if TYPE_CHECKING:  # for type checkers and IDEs only; at run time __getattr__ serves these
    from psar.ps.server.config import ServerConfig
    from psar.ps.server.modes.base import UpdatePolicy
    from psar.ps.server.modes.registry import Mode
    from psar.ps.server.modes.view import ShardView
    from psar.ps.server.serve import serve, start_server
    from psar.trainkit.config import TrainConfig
    from psar.worker.launch import LaunchSpec, launch
    from psar.worker.loop import train
    from psar.worker.own_loop import OwnLoop, prepare
    from psar.worker.workloads.base import Workload
