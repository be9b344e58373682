"""Golden digests: the same seeds give the same final shard state, bit for bit, per mode.

Each scenario starts a real shard (gRPC and the TCP data plane, in this process) and drives
it over the wire from one thread: several PSClients, one per worker, push and pull in a
fixed order, so even async arrival order is fixed. At the end the shard's state digest
(Stats.state_digest: masters, optimizer state, version, rounds, clocks, integer buffers,
loss scale) and, for sparse tables, a hash of every row pulled back are compared with
tests/golden_digests.json. A refactoring that changes any bit of any update fails here.

Each scenario runs under two optimizer implementations (trainkit/optim.py, issue #36):
`loop` (torch's per-parameter step, the only one before #36), whose digests are the ones
recorded from the code before the ps/server restructuring (issue #32) and have not
changed since (the plain scenario names in the file), and the default `auto` (fused on
this CPU), recorded when #36 made it the default (names ending in " @auto"). That the
loop digests still hold proves the implementation is what changed the default's bits.

The digests hold for torch 2.13.0 on CPU (other versions may round differently): on
another version the test skips, saying so. Even then the last bits depend on the CPU, so
tests/golden_digests.json holds one set per machine (`machine()`: torch, its kernels'
capability, the CPU's flags); a machine never recorded must match one of them. To record
them afresh (only when an update is meant to change, or for a new machine, from a commit
known to be right): PSAR_RECORD_DIGESTS=1 python -m pytest tests/test_golden_digests.py
(it rewrites the fixtures of tests/golden_checkpoints too: keep the old ones for a new machine).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from psar.ps import wire
from psar.ps.client.psclient import ClientConfig, PSClient
from psar.ps.client.sparse_client import create_tables, pull_rows, push_rows
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.serve import start_server, stop_server
from psar.ps.sparse_spec import TableSpec
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig

GOLDEN = Path(__file__).with_name("golden_digests.json")
TORCH = "2.13.0"
RECORD = os.environ.get("PSAR_RECORD_DIGESTS") == "1"
pytestmark = pytest.mark.skipif(
    not torch.__version__.startswith(TORCH),
    reason=f"golden digests were recorded with torch {TORCH} on CPU; this is torch "
    f"{torch.__version__}, whose kernels may round differently",
)

# Parameters (name, numel) cut into 12-element slots; "bn.mean" is a model buffer (a slot
# the optimizer never steps) where a scenario asks for buffers.
PARAMS = [("w", 30), ("b", 7), ("v", 13), ("bn.mean", 4)]
CHUNK_BYTES = 48
INT_BUFFER = "bn.num_batches_tracked"


@dataclass(kw_only=True)
class Scenario:
    mode: str
    workers: int = 3
    clocks: int = 5
    shards: int = 1
    plane: str = "tcp"
    """The door every push and pull goes through: tcp (the data plane) or grpc."""
    server: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "sgd"
    wire_dtype: torch.dtype = torch.float32
    buffers: bool = False
    """A buffer slot and an integer buffer (shard 0) in the job and in every push."""
    overflow: tuple[int, int] | None = None
    """(worker, clock) that pushes an overflow instead of its gradient."""
    absent: tuple[int, str] | None = None
    """(clock, parameter) no worker has a gradient for at that clock (an unused one)."""
    streamed: bool = False
    """Push as a stream with a verdict last, as a worker does during backward."""
    table: str = ""
    """A sparse table with this optimizer, pushed before each dense gradient."""
    order: Callable[[int, int], list[tuple[str, int]]] | None = None
    """(clock, workers) -> [("push"|"pull", worker), ...]; default: all push, all pull."""


def _lockstep(clock: int, n: int) -> list[tuple[str, int]]:
    return [("push", w) for w in range(n)] + [("pull", w) for w in range(n)]


def _interleaved(clock: int, n: int) -> list[tuple[str, int]]:
    """Each worker pushes then pulls, starting with another worker every clock: workers
    push from weights some updates old (async staleness > 0; SSP keeps within 1)."""
    out = []
    for i in range(n):
        w = (i + clock) % n
        out += [("push", w), ("pull", w)]
    return out


def _skewed(clock: int, n: int) -> list[tuple[str, int]]:
    """async: worker 0 pulls every clock, the others only every other clock (staler)."""
    out = [("push", w) for w in range(n)]
    return out + [("pull", w) for w in range(n) if w == 0 or clock % 2 == 0]


def _optimizer(name: str, impl: str = "loop") -> OptimizerConfig:
    if name == "adamw":
        return OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.01, schedule="warmup_cosine",
                               warmup_steps=2, total_steps=8, impl=impl)  # fmt: skip
    if name == "outer":  # local SGD's outer optimizer (DiLoCo: Nesterov momentum)
        return OptimizerConfig(name="sgd", lr=0.7, momentum=0.9, nesterov=True, impl=impl)
    return OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01, impl=impl)


IMPLS = ("loop", "auto")
"""The implementations each scenario runs under (the module docstring)."""


def _key(name: str, impl: str) -> str:
    return name if impl == "loop" else f"{name} @{impl}"


SCENARIOS: dict[str, Scenario] = {
    "sync": Scenario(mode="sync", buffers=True, absent=(3, "v"), optimizer="adamw"),
    "sync-grpc": Scenario(mode="sync", plane="grpc", buffers=True, job={"buffers_average": True}),
    "sync-chunk-rounds": Scenario(
        mode="sync",
        server={"chunk_rounds": True},
        streamed=True,
        buffers=True,
        absent=(2, "b"),
        overflow=(2, 4),  # the last pusher: its slots may be applied early, then undone
        optimizer="adamw",
    ),
    "sync-fp16-overflow": Scenario(
        mode="sync",
        wire_dtype=torch.float16,
        overflow=(2, 3),
        clocks=7,
        job={"loss_scale": LossScaleConfig(enabled=True, init_scale=2.0**10, growth_interval=2)},
    ),
    "async": Scenario(mode="async", order=_skewed, job={"staleness_lr": True}, buffers=True),
    "async-dc-grpc": Scenario(
        mode="async",
        plane="grpc",
        order=_interleaved,
        optimizer="adamw",
        job={"delay_compensation": 0.5, "dc_adaptive": True, "momentum_correction": False},
        overflow=(0, 2),
    ),
    "ssp": Scenario(
        mode="ssp",
        order=_interleaved,
        job={
            "staleness": 1,
            "delay_compensation": 0.3,
            "staleness_lr": True,
            "staleness_lr_power": 0.5,
        },  # fmt: skip
    ),
    "local": Scenario(mode="local", optimizer="outer", job={"sync_every": 4}),
    "sparse-sync": Scenario(mode="sync", table="adagrad", shards=2),
    "sparse-async": Scenario(
        mode="async",
        table="lazy_adam",
        shards=2,
        order=_interleaved,
        job={"staleness_rule": "fixed"},  # recorded before adaptive became the default
    ),
    # The default rule of async/ssp since issue #34 (trainkit/staleness_rules.py).
    "async-adaptive": Scenario(mode="async", order=_skewed, buffers=True),
    "ssp-adaptive": Scenario(
        mode="ssp", order=_interleaved, optimizer="adamw", job={"staleness": 1}
    ),
}


def _grad(seed: int, worker: int, clock: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * worker + clock)
    return 0.1 * torch.randn(numel, generator=g)


@contextlib.contextmanager
def _shards(sc: Scenario) -> Iterator[list[str]]:
    servers, addrs = [], []
    try:
        for _ in range(sc.shards):
            server, port, _ = start_server(ServerConfig(bind="127.0.0.1:0", threads=8, **sc.server))
            servers.append(server)
            addrs.append(f"127.0.0.1:{port}")
        yield addrs
    finally:
        for s in servers:
            stop_server(s)


def _jobs(sc: Scenario, slots: list, params: dict[str, int], impl: str) -> list[Job]:
    buffers = tuple(s.key for s in slots if s.param == "bn.mean") if sc.buffers else ()
    return [
        Job(
            mode=sc.mode,
            num_workers=sc.workers,
            optimizer=_optimizer(sc.optimizer, impl),
            shard_index=i,
            num_shards=sc.shards,
            slots=[s for s in slots if s.shard == i],
            job_id="golden",
            buffer_slots=tuple(k for k in buffers if k in {s.key for s in slots if s.shard == i}),
            int_buffers=((INT_BUFFER, 1),) if sc.buffers and i == 0 else (),
            **sc.job,
        )
        for i in range(sc.shards)
    ]


def _table_specs(sc: Scenario) -> list[list[TableSpec]]:
    return [
        [
            TableSpec(
                name="emb",
                rows=40,
                dim=3,
                optimizer=sc.table,
                lr=0.05,
                init_seed=3,
                shard_index=i,
                num_shards=sc.shards,
            )
        ]  # fmt: skip
        for i in range(sc.shards)
    ]


# Stats that follow from the pushes alone (not timing: per-chunk early updates race the
# round's close, update rates are measured): they must not change either.
COUNTERS = ("version", "rounds", "updates_applied", "skipped_rounds", "dropped_nonfinite",
            "staleness_histogram", "loss_scale", "max_clock_gap", "worker_clocks",
            "live_workers")  # fmt: skip


def run(sc: Scenario, impl: str = "loop") -> dict[str, str]:
    """Drive the scenario; per shard its digest and counters, and a hash of the sparse
    table's rows."""
    params = dict(PARAMS if sc.buffers else PARAMS[:-1])
    slots = plan_slots(list(params.items()), sc.shards, chunk_bytes=CHUNK_BYTES)
    jobs = _jobs(sc, slots, params, impl)
    gen = torch.Generator().manual_seed(42)
    values = {s.key: torch.randn(s.numel, generator=gen) for s in slots}
    out: dict[str, str] = {}
    with _shards(sc) as addrs:
        cfg = ClientConfig(data_plane=sc.plane, timeout_s=30.0, pull_timeout_s=30.0)
        clients = [PSClient(addrs, worker=w, cfg=cfg) for w in range(sc.workers)]
        try:
            for c in clients:
                c.set_slots(slots)
            if sc.table:
                create_tables(clients[0], _table_specs(sc))
            clients[0].init(jobs, values)
            for c in clients:
                c.get_jobs(wait=True, timeout_s=30.0)
            _drive(sc, clients, slots)
            for i, s in enumerate(clients[0].stats()):
                out[f"shard{i}"] = s["state_digest"]
                out[f"shard{i} counters"] = json.dumps({k: s[k] for k in COUNTERS})
            if sc.table:
                ids = torch.arange(40)
                rows, versions, _ = pull_rows(clients[0], "emb", ids, 3, torch.float32)
                h = hashlib.sha256(wire.as_bytes_view(rows.contiguous()))
                h.update(repr(versions).encode())
                out["rows"] = h.hexdigest()
        finally:
            for c in clients:
                c.close()
    return out


def _drive(sc: Scenario, clients: list[PSClient], slots: list) -> None:
    n = sc.workers
    versions = [[0] * sc.shards for _ in range(n)]
    scale = [1.0] * n
    if sc.job.get("loss_scale") is not None:
        scale = [sc.job["loss_scale"].init_scale] * n
    clocks = [0] * n
    bufs = {s.key: torch.empty(s.numel) for s in slots}
    order = sc.order or _lockstep
    for clock in range(1, sc.clocks + 1):
        for what, w in order(clock, n):
            if what == "pull":
                headers = clients[w].pull(clock=clocks[w], dtype=torch.float32, out=bufs)
                versions[w] = [h.version for h in headers]
                if sc.job.get("loss_scale") is not None:
                    scale[w] = headers[0].loss_scale
                continue
            clocks[w] = clock
            if sc.table:
                ids = torch.tensor(sorted({(7 * w + 3 * clock + k * 5) % 40 for k in range(4)}))
                grads = _grad(9, w, clock, ids.numel() * 3).reshape(-1, 3)
                push_rows(clients[w], table="emb", clock=clock, ids=ids, grads=grads,
                          dtype=torch.float32, base_versions=versions[w])  # fmt: skip
            _push(sc, clients[w], w, clock, slots, versions[w], scale[w])


def _push(
    sc: Scenario,
    client: PSClient,
    w: int,
    clock: int,
    slots: list,
    base: list[int],
    scale: float,
) -> None:
    overflow = sc.overflow == (w, clock)
    absent = frozenset(
        s.key for s in slots if sc.absent is not None and sc.absent == (clock, s.param)
    )
    grads: dict[str, torch.Tensor] = {}
    for s in slots:
        if s.param == "bn.mean":  # a buffer's value, never scaled
            grads[s.key] = _grad(5, w, clock, s.numel).to(sc.wire_dtype)
        elif s.key in absent:
            grads[s.key] = torch.zeros(s.numel, dtype=sc.wire_dtype)
        else:
            g = _grad(1, w, clock, s.numel) * scale
            grads[s.key] = g.to(sc.wire_dtype)
    int_buffers = {INT_BUFFER: (clock + 10 * w,)} if sc.buffers else None
    common = {"clock": clock, "base_versions": base, "dtype": sc.wire_dtype, "loss_scale": scale}
    if sc.streamed:

        def items(shard: int, _again: bool) -> list[tuple[Any, ...]]:
            mine = client.slots_by_shard[shard]
            # An overflow is known only after backward: the data has gone out already.
            data = [("data", s.key, 0, grads[s.key]) for s in mine]
            return [*data, ("verdict", overflow, tuple(k for k in absent if k in grads))]

        client.push(items=items, int_buffers=int_buffers, **common)
        return
    client.push(grads=None if overflow else grads, overflow=overflow, absent=absent,
                int_buffers=int_buffers, **common)  # fmt: skip


def machine() -> str:
    """What the last bits of a float update depend on besides the code: torch's build,
    the kernels it picked for this CPU, and the CPU's features (the same torch 2.13.0
    rounds the adaptive rule, DC-ASGD and the sparse tables' row statistics differently
    on two x86 machines, both AVX512)."""
    try:
        with open("/proc/cpuinfo") as fh:
            line = next((ln for ln in fh if ln.startswith("flags")), "flags:")
    except OSError:
        line = "flags:"
    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return (
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, cpu flags {digest}"
    )


def _sets() -> dict[str, dict[str, Any]]:
    """The recorded digests, one set per machine they were recorded on."""
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def _golden() -> dict[str, Any]:
    """This machine's set; on a machine never recorded, the first set (the checks
    below then accept any recorded machine's digests, see _check)."""
    sets = _sets()
    return sets.get(machine()) or next(iter(sets.values()), {})


def _record(key: str, got: Any) -> None:
    sets = _sets()
    sets.setdefault(machine(), {})[key] = got
    GOLDEN.write_text(json.dumps(sets, indent=2, sort_keys=True) + "\n")


def _check(key: str, got: Any, what: str) -> None:
    """On a recorded machine, `got` must be its digest; elsewhere, some recorded
    machine's: a refactoring that moves a bit fails either way, and a new machine that
    rounds differently from every recorded one says how to record it."""
    sets, here = _sets(), machine()
    if here in sets:
        want = sets[here].get(key)
        assert want is not None, f"no golden digest for {key!r}: record it (module docstring)"
        assert got == want, f"{key}: {what}"
        return
    assert any(s.get(key) == got for s in sets.values()), (
        f"{key}: {what}, or this machine ({here}) rounds differently from every recorded "
        "one: record its digests from a commit known to be right (module docstring)"
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_seeds_same_final_state(name: str, impl: str) -> None:
    got = run(SCENARIOS[name], impl)
    key = _key(name, impl)
    if RECORD:
        _record(key, got)
        return
    _check(key, got, "the final shard state changed")


def test_the_implementation_is_what_changes_the_bits() -> None:
    """Under fused (the default here) the dense scenarios end elsewhere than under loop,
    with the same counters: the same rounds, skips and staleness, other last bits."""
    golden = _golden()
    for name in ("sync", "async", "ssp", "local"):
        loop, fused = golden[name], golden[_key(name, "auto")]
        assert loop["shard0"] != fused["shard0"], name
        assert loop["shard0 counters"] == fused["shard0 counters"], name


def test_a_scenario_is_deterministic() -> None:
    """The driver itself is deterministic (twice the same run, the same digests), so a
    mismatch above is the code's, not the harness's."""
    sc = SCENARIOS["async"]
    assert run(sc) == run(sc)


# ---- checkpoints written before the restructuring still restore -------------------------

CKPTS = Path(__file__).with_name("golden_checkpoints")
CKPT_MODES = ("sync", "async")


def _ckpt_job(mode: str) -> Job:
    slots = plan_slots(PARAMS, 1, chunk_bytes=CHUNK_BYTES)
    return Job(
        mode=mode,
        num_workers=2,
        # Written before optimizers had an implementation to choose: the job restores with
        # the per-parameter loop it ran then (ps/serde.py), and goes on with its bits.
        optimizer=_optimizer("adamw", "loop"),
        slots=slots,
        job_id="golden-ckpt",
        buffer_slots=tuple(s.key for s in slots if s.param == "bn.mean"),
        int_buffers=((INT_BUFFER, 1),),
        delay_compensation=0.2 if mode == "async" else 0.0,
        # Written before --staleness-rule: a spec without it reads fixed (ps/serde.py).
        staleness_rule="fixed",
    )


def _ckpt_round(st: Any, job: Job, clock: int) -> None:
    """Every worker pushes its rows and its gradient of `clock` (tests/ps_fixtures.push)."""
    from psar.ps.server.sparse.tables import RowPush
    from tests.ps_fixtures import push

    for w in range(job.num_workers):
        ids = torch.tensor(sorted({(5 * w + clock + 7 * k) % 40 for k in range(3)}))
        grads = _grad(9, w, clock, ids.numel() * 3).reshape(-1, 3)
        st.sparse.push("emb", RowPush(w, clock, st.version, False, ids, grads))
        g = {s.key: _grad(1, w, clock, s.numel) for s in job.slots}
        base = st.version
        push(st, worker=w, clock=clock, base_version=base, grads=g)
    with st.cond:
        st.int_buffers.put(clock, 0, {INT_BUFFER: (clock,)})


def _ckpt_digest(st: Any) -> str:
    h = hashlib.sha256(st.state_digest().encode())
    for name, t in sorted(st.sparse.tables.items()):
        h.update(name.encode())
        for part in (t.weight, t.m, t.v, t.steps, t.acc):
            if part is not None:
                h.update(wire.as_bytes_view(part.contiguous().view(torch.uint8).reshape(-1)))
    return h.hexdigest()


def _write_checkpoint(mode: str, folder: Path) -> None:
    from psar.ps.server.durability.checkpoints import CheckpointManager
    from psar.ps.server.shard import ShardState
    from psar.ps.server.sparse.tables import SparseTables

    job = _ckpt_job(mode)
    st = ShardState(checkpoints=CheckpointManager(folder, every=1000))
    st.sparse = SparseTables(st)
    st.sparse.create([TableSpec(name="emb", rows=40, dim=3, optimizer="lazy_adam", lr=0.05)])
    gen = torch.Generator().manual_seed(7)
    st.init(job, {s.key: torch.randn(s.numel, generator=gen) for s in job.slots})
    for clock in (1, 2, 3):
        _ckpt_round(st, job, clock)
    assert st.durability.checkpoint_now("shutdown", wait=True)
    st.checkpoints.close()


@pytest.mark.parametrize("mode", CKPT_MODES)
def test_checkpoints_of_earlier_code_restore_and_continue(mode: str, tmp_path: Path) -> None:
    """A checkpoint written by the code before the restructuring (tests/golden_checkpoints)
    restores to the same state, and the next round gives the same bits as then."""
    from psar.ps.server.durability.checkpoints import newest_verified
    from psar.ps.server.shard import ShardState

    folder = CKPTS / mode
    if RECORD:
        for old in folder.glob("*.pt"):
            old.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        _write_checkpoint(mode, folder)
    found, rejected = newest_verified(folder, 0)
    assert found is not None and not rejected, f"{folder}: no checkpoint verifies"
    step, snap = found
    st = ShardState()
    st.durability.restore(step, snap)
    job = _ckpt_job(mode)
    assert st.job == job
    got = {"restored": _ckpt_digest(st)}
    _ckpt_round(st, job, 4)
    got["next round"] = _ckpt_digest(st)
    key = f"checkpoint-{mode}"
    if RECORD:
        _record(key, got)
        return
    _check(key, got, "the restored state differs")
