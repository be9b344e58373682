"""The mode registry (ps/server/modes/): a mode is one module, the workers learn its traits
with the job, and no other place of the code knows a mode by its name.

- Each mode's name is a string literal in at most MAX_FILES files of ps/, worker/,
  allreduce/ and trainkit/ (the mode's module, and trainkit/choices.py's list of what a
  worker may ask for); the counts are printed.
- What a worker's config knows of the modes (trainkit/choices.py) is what the shards
  declare (their traits).
- Over real gRPC: a shard's job carries its mode's traits (GetJob), a mode of one's own
  (tests/drop_stale_mode.py) is served from a registry that has it, an unknown mode or a
  stray option is refused at Init with INVALID_ARGUMENT saying what to send.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps.client.psclient import ClientConfig, PSClient, PSClientError
from psar.ps.job import Job
from psar.ps.server.config import ServerConfig
from psar.ps.server.modes import BUILTIN
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from psar.trainkit import choices
from tests import drop_stale_mode
from tests.ps_fixtures import init_values, make_job, make_slots

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ps", "worker", "allreduce", "trainkit")
MAX_FILES = 3
"""Issue #32's bound (7 to 13 files each before the registry)."""


def files_naming(mode: str) -> list[str]:
    """Files of PACKAGES holding the mode's name as a quoted literal (what grep finds)."""
    pattern = re.compile(rf"[\"']{re.escape(mode)}[\"']")
    out = []
    for package in PACKAGES:
        for f in sorted((ROOT / package).rglob("*.py")):
            if "_gen" not in f.parts and pattern.search(f.read_text()):
                out.append(f.relative_to(ROOT).as_posix())
    return out


@pytest.mark.parametrize("mode", choices.MODES)
def test_a_mode_is_named_in_few_files(mode: str) -> None:
    found = files_naming(mode)
    print(f"{mode!r}: {len(found)} files: {', '.join(found)}")
    assert found, "the count found nothing: did the scan break?"
    assert len(found) <= MAX_FILES, f"{mode!r} is named in {len(found)} files: {found}"


def test_the_scan_finds_a_literal() -> None:
    assert "trainkit/choices.py" in files_naming("sync")
    assert files_naming("no-such-mode") == []


def test_what_workers_know_of_the_modes_is_what_the_shards_declare() -> None:
    assert BUILTIN.names() == choices.MODES
    assert choices.DEFAULT_MODE in BUILTIN
    for mode in BUILTIN:
        t = mode.traits
        assert choices.local_sgd(mode.name) == (t.between_steps == "local_steps"), mode.name
        if choices.averages_buffers(mode.name):  # a round to average the buffers over
            assert t.rounds, mode.name


@pytest.mark.parametrize("mode", [*BUILTIN, drop_stale_mode.MODE], ids=lambda m: m.name)
def test_traits_travel_with_the_job(mode) -> None:  # noqa: ANN001 - a Mode
    job = Job(mode=mode.name, sync_every=4 if choices.local_sgd(mode.name) else 0)
    held = job.served(mode.traits)
    back = serde.job_from_pb(serde.job_to_pb(held))
    assert back == held and back.traits == mode.traits
    spec = serde.job_to_pb(job)
    # A mode with a Mode enum value travels as it, one of one's own as its name.
    assert (spec.mode_name == "") == (mode.name in BUILTIN)
    assert serde.job_from_pb(spec).traits is None  # a worker's job: the shard adds them


def test_a_job_drops_the_loss_scale_where_the_shards_do_not_own_it() -> None:
    from psar.trainkit.optim import LossScaleConfig

    ls = LossScaleConfig(enabled=True, init_scale=1024.0)
    for mode in BUILTIN:
        job = Job(
            mode=mode.name, loss_scale=ls, sync_every=4 if choices.local_sgd(mode.name) else 0
        )
        held = BUILTIN.serve(job)
        assert held.loss_scale == (ls if mode.traits.shard_owns_loss_scale else LossScaleConfig())


# ---- over the wire ------------------------------------------------------------------------------


def _serve(modes=BUILTIN):  # noqa: ANN001, ANN202 - a Modes; (server, address)
    state = ShardState(modes=modes)
    server, port, _ = start_server(ServerConfig(bind="127.0.0.1:0", threads=8), state)
    return server, f"127.0.0.1:{port}"


def test_a_mode_of_ones_own_is_served_from_a_registry_that_has_it() -> None:
    server, addr = _serve(drop_stale_mode.MODES)
    job = make_job(drop_stale_mode.NAME, num_workers=2, mode_options={"max_staleness": 0})
    try:
        clients = [PSClient([addr], worker=w, cfg=ClientConfig(timeout_s=30.0)) for w in (0, 1)]
        for c in clients:
            c.set_slots(job.slots)
        clients[0].init([job], init_values(job))
        [have] = clients[1].get_jobs(wait=True)
        assert have is not None and have == job and have.traits == drop_stale_mode.TRAITS
        grads = {s.key: torch.ones(s.numel) for s in job.slots}
        replies = [c.push(clock=1, base_versions=[0], dtype=torch.float32, grads=grads)[0]
                   for c in clients]  # fmt: skip
        # Both computed from version 0: the second arrives one update late, K is 0.
        assert [r.applied for r in replies] == [True, False]
        assert [r.staleness for r in replies] == [0, 1]
        stats = clients[0].stats()[0]
        assert stats["version"] == 1 and stats["worker_clocks"] == [1, 1]
    finally:
        for c in clients:
            c.close()
        stop_server(server)


@pytest.mark.parametrize(
    ("job", "words"),
    [
        (make_job(drop_stale_mode.NAME, mode_options={"max_staleness": 1}), "serves: sync"),
        (make_job("sync", mode_options={"k": 1.0}), "takes no mode options"),
    ],
    ids=["unknown-mode", "stray-option"],
)
def test_a_job_the_shard_cannot_serve_is_refused_at_init(job: Job, words: str) -> None:
    server, addr = _serve()
    try:
        with PSClient([addr], worker=0, cfg=ClientConfig(timeout_s=30.0)) as c:
            c.set_slots(make_slots())
            with pytest.raises(PSClientError) as e:
                c.init([job], init_values(job))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert words in str(e.value)
            assert c.get_jobs(wait=False) == [None]  # nothing was installed
    finally:
        stop_server(server)


# ---- what a rule may touch of its shard ---------------------------------------------------------


def view_members() -> set[str]:
    from psar.ps.server.modes.view import ShardView

    return {n for n in vars(ShardView) if not n.startswith("_")}


def reaches_past_the_view(source: str, allowed: set[str]) -> list[str]:
    """`line: view.name` for every attribute a rule reads of its view outside `allowed`."""
    import ast

    return [
        f"{node.lineno}: view.{node.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "view"
        and node.attr not in allowed
    ]


def test_rules_touch_only_what_the_view_offers() -> None:
    allowed = view_members()
    assert {"apply_update", "skip_round", "live", "version", "metrics"} <= allowed
    files = [
        *sorted((ROOT / "ps" / "server" / "modes").glob("*.py")),
        ROOT / "tests" / "drop_stale_mode.py",
    ]
    bad = [f"{f.name}:{v}" for f in files for v in reaches_past_the_view(f.read_text(), allowed)]
    assert not bad, "rules reaching past their ShardView:\n" + "\n".join(bad)
    assert reaches_past_the_view("view.data.clocks[0] = 1", allowed) == ["1: view.data"]


def test_rules_import_nothing_else_of_the_shard() -> None:
    """A mode module reaches the shard through its ShardView only: of ps/server it imports
    the modes, the recorder's interface, the sparse table rows rules step, and the in-flight
    push (its type, and pacing's answer) that per-chunk rules hear of."""
    import ast

    allowed = {"psar.ps.server.metrics.recorder", "psar.ps.server.sparse.table", "psar.ps.server.intake.pieces",
               "psar.ps.server.intake"}  # fmt: skip
    bad = []
    for f in sorted((ROOT / "ps" / "server" / "modes").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "psar.ps.server"
            ):
                m = node.module or ""
                if not m.startswith("psar.ps.server.modes") and m not in allowed:
                    bad.append(f"{f.name}: from {m} import ...")
    assert not bad, "\n".join(bad)
