"""A gradient's path, socket to optimizer (sync, the data plane), is the one
docs/architecture.md names, and crosses at most MAX_FILES files.

The path is measured, not listed by hand: a real shard takes two workers' pushes over the
TCP data plane while the files on the handling thread's stack are noted at each moment the
gradient itself moves: its bytes are read from the socket into the staging buffers
(framing.recv_exact), its values are unscaled and checked (psar.trainkit.finite.all_finite), the
round's pushes are summed (the round rule's _close) and the optimizer steps (the
stepper). What the path
only consults on the way (membership, the mode's traits, metrics, the header's decoding)
is not on the stack at those moments, and docs/architecture.md lists it apart.
"""

from __future__ import annotations

import re
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from psar.ps import framing
from psar.ps.client.psclient import ClientConfig, PSClient
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.intake import pieces
from psar.ps.server.modes.rounds import SyncPolicy
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.update.stepper import SlotStepper

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
MAX_FILES = 10
"""Issue #32's bound."""


def documented_path() -> list[str]:
    """The numbered list under docs/architecture.md's "A gradient's path" heading."""
    text = DOC.read_text()
    if "## A gradient's path" not in text:
        return []
    section = text.split("## A gradient's path", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)


class StackNotes:
    """The project files on a data-plane thread's stack each time `note` runs."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.on = False

    def note(self, callee: Callable[..., Any]) -> None:
        if not self.on or not threading.current_thread().name.startswith("psar-data-conn"):
            return
        frames = [f.filename for f in traceback.extract_stack()[:-2]]
        for name in [*frames, callee.__code__.co_filename]:
            f = Path(name).resolve()
            if ROOT in f.parents and not {"_gen", "tests"} & set(f.parts):
                rel = f.relative_to(ROOT).as_posix()
                if rel not in self.files:
                    self.files.append(rel)

    def wrap(self, mp: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def noted(*args: Any, **kw: Any) -> Any:
            self.note(fn)
            return fn(*args, **kw)

        mp.setattr(owner, name, noted)


def measured_path(mp: pytest.MonkeyPatch) -> list[str]:
    notes = StackNotes()
    notes.wrap(mp, framing, "recv_exact")  # socket -> staging buffer
    notes.wrap(mp, pieces, "all_finite")  # unscaled values checked
    notes.wrap(mp, SyncPolicy, "_close")  # the round's sum
    notes.wrap(mp, SlotStepper, "step_all")  # the optimizer steps
    server, port, state = start_server(ServerConfig(bind="127.0.0.1:0", threads=8))
    slots = plan_slots([("w", 30), ("b", 7)], 1, chunk_bytes=48)
    job = Job(mode="sync", num_workers=2, slots=slots, job_id="path")
    cfg = ClientConfig(data_plane="tcp", timeout_s=30.0)
    clients = [PSClient([f"127.0.0.1:{port}"], worker=w, cfg=cfg) for w in range(2)]
    try:
        for c in clients:
            c.set_slots(slots)
        clients[0].init([job], {s.key: torch.zeros(s.numel) for s in slots})
        for c in clients:
            c.get_jobs(wait=True)
        grads = {s.key: torch.ones(s.numel) for s in slots}
        notes.on = True
        for c in clients:
            c.push(clock=1, base_versions=[0], dtype=torch.float32, grads=grads)
        notes.on = False
        assert state.version == 1, "the round did not close"
    finally:
        for c in clients:
            c.close()
        stop_server(server)
    return notes.files


def test_the_documented_path_is_the_measured_one(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = measured_path(monkeypatch)
    print("measured:", " -> ".join(measured))
    assert {"ps/framing.py", "ps/server/update/stepper.py"} <= set(measured), measured
    doc = documented_path()
    assert doc, "docs/architecture.md names no path"
    assert sorted(doc) == sorted(measured), f"docs: {doc}\nmeasured: {measured}"
    assert len(doc) <= MAX_FILES
