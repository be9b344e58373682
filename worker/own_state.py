"""The files of a loop of its own's saved run (worker/own_loop.py's `run.save_state(dir)`
and `prepare(..., resume_from=dir)`), as Accelerate's save_state and load_state write and
read them: everything a run needs to continue bit for bit.

A folder holds:

- ``model.pt``: the model's weights (rank 0's, fp32 where the architecture keeps them:
  backend.state_dict(), what --save writes), torch's format, no "module." prefix;
- ``optimizer.pt``: the optimizer's state dict, torch's format (under ps read back from
  the shards), with each group's hyper-parameters;
- ``rank{R}.pt``, one per rank: the step, each group's learning rate, the state of every
  object the run registered (LR schedulers, ...), and the rank's random generators
  (torch's CPU and CUDA ones, Python's `random`, NumPy's global one).

The model and the optimizer go in before the shards take them (prepare()); the rest once
the objects it belongs to exist (run.register(), after prepare()). Every file is written
atomically (trainkit/atomic.py) and read with weights_only=True.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from psar.trainkit.atomic import atomic_save

MODEL, OPTIMIZER = "model.pt", "optimizer.pt"
FORMAT = 1


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """This process's random generators: torch's (CPU; CUDA where it was started), Python's
    `random`, NumPy's global generator (as tensors and tuples: weights_only loads them)."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what rng_state() returned."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def object_state(obj: Any) -> Any:
    """A registered object's state: state_dict() (schedulers, samplers of one's own), or
    get_state() (a torch.Generator)."""
    return obj.state_dict() if hasattr(obj, "state_dict") else obj.get_state()


def load_object(obj: Any, state: Any) -> None:
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    else:
        obj.set_state(state)


def check_registrable(obj: Any) -> None:
    """A clear error now for an object that save_state() could not save."""
    pairs = (("state_dict", "load_state_dict"), ("get_state", "set_state"))
    if not any(all(callable(getattr(obj, m, None)) for m in pair) for pair in pairs):
        raise TypeError(
            f"run.register({type(obj).__name__}): the object needs state_dict() and "
            "load_state_dict() (an LR scheduler, ...) or get_state() and set_state() (a "
            "torch.Generator)"
        )


def save_shared(folder: Path, model: dict[str, Any], optimizer: dict[str, Any]) -> None:
    """Rank 0's part: the model and the optimizer."""
    atomic_save(model, folder / MODEL)
    atomic_save(optimizer, folder / OPTIMIZER)


def save_rank(
    folder: Path, rank: int, world: int, step: int, lrs: list[float], objects: list[Any]
) -> None:
    """Each rank's part (see the module docstring)."""
    state = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "step": step,
        "lrs": lrs,
        "objects": [object_state(o) for o in objects],
        "rng": rng_state(),
    }
    atomic_save(state, folder / rank_file(rank))


def _load(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file; resume from a folder run.save_state() wrote (call it on "
            "every rank), with the same number of workers"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def load_shared(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) from a saved run's folder."""
    return _load(folder / MODEL), _load(folder / OPTIMIZER)


def load_rank(folder: Path, rank: int, world: int) -> dict[str, Any]:
    """This rank's part; the run must have as many workers as the saved one (each rank's
    generators and data position are its own)."""
    state = _load(folder / rank_file(rank))
    if state.get("format") != FORMAT or state.get("world_size") != world:
        raise ValueError(
            f"{folder}: saved by a run of {state.get('world_size')} workers (format "
            f"{state.get('format')}); this run has {world}: resume with as many workers"
        )
    # Rank 0 writes the model and the optimizer, then its own file: a rank file of
    # another step than rank 0's is a save cut short (or one rank saving alone).
    first = state if rank == 0 else _load(folder / rank_file(0))
    if first["step"] != state["step"]:
        raise ValueError(
            f"{folder}: rank {rank} saved step {state['step']}, rank 0 step {first['step']} "
            "(a save cut short, or run.save_state() not called on every rank); resume from "
            "a folder every rank saved the same step into"
        )
    return state
