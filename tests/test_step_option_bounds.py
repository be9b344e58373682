"""Step options a shard cannot step with are refused before anything changes (issue #45,
defect 1), and an error the checks did not foresee is INTERNAL and leaves no round open.

Before the fix, a learning rate above fp32's largest value (3.5e38, DBL_MAX) failed the
optimizer step after the push was taken: UNKNOWN, the worker's clock advanced and the
digest moved, and a sync round never closed. 1e30 was stepped with (masters 0.01 ->
1e27), and options were honoured on a job that never declared them. Through the shard's
own intake (the code both doors drive); tests/test_hostile_options.py sends the same
through a real shard process."""

from __future__ import annotations

import grpc
import pytest

from psar.ps.errors import InvalidArgument, PSError
from psar.ps.server.limits import ShardLimits
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import StepOptions
from tests.ps_fixtures import grad_for, init_values
from tests.test_step_options import own_job, push

BAD_LRS = [3.5e38, 1.7976931348623157e308, 1e30, 1001.0]
"""Above fp32's largest (the first two: the step's conversion failed), above the default
cap --max-step-lr 1000 (the last two: stepped with before)."""


def _shard(mode: str, limits: ShardLimits | None = None, **kw: object) -> ShardState:
    job = own_job(mode, "sgd", **kw)  # type: ignore[arg-type]
    st = ShardState(limits=limits)
    st.init(job, init_values(job))
    return st


def _push(st: ShardState, worker: int, lrs: tuple[float, ...], clock: int = 1) -> object:
    assert st.job is not None
    return push(st, options=StepOptions(lrs=lrs), worker=worker, clock=clock,
                base_version=st.version, grads=grad_for(st.job, worker, clock))  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("lr", BAD_LRS)
def test_a_learning_rate_the_masters_cannot_take_is_refused_and_changes_nothing(
    mode: str, lr: float
) -> None:
    st, clean = _shard(mode), _shard(mode)
    digest = st.state_digest()
    for worker in (0, 1):
        with pytest.raises(InvalidArgument, match="learning rate") as e:
            _push(st, worker, (lr, 0.1))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert st.state_digest() == digest and st.clocks == [0, 0]
    # Not wedged: the honest pushes of the same clock go in, as on a shard never bothered.
    for s in (st, clean):
        for worker in (0, 1):
            _push(s, worker, (0.1, 0.05))
    assert st.state_digest() == clean.state_digest()
    assert st.version == (1 if mode == "sync" else 2)


def test_the_cap_is_the_users_to_raise() -> None:
    st = _shard("async", ShardLimits(max_step_lr=1e31))
    _push(st, 0, (1e30, 0.1))
    assert st.version == 1
    with pytest.raises(ValueError, match="--max-step-lr"):
        ShardLimits(max_step_lr=1e39)


def test_options_on_a_job_that_did_not_declare_them_are_refused() -> None:
    st = _shard("sync", step_options=False)
    digest = st.state_digest()
    with pytest.raises(InvalidArgument, match="did not declare"):
        _push(st, 0, (0.1, 0.05))
    assert st.state_digest() == digest and st.clocks == [0, 0]


class _Boom(RuntimeError):
    pass


def _fail_next_step(st: ShardState) -> None:
    real = st.updates.stepper.step_all

    def once(*a: object, **k: object) -> None:
        st.updates.stepper.step_all = real  # type: ignore[method-assign]
        raise _Boom("the step failed")

    st.updates.stepper.step_all = once  # type: ignore[method-assign]


def test_an_unforeseen_error_in_an_async_step_is_internal_and_undone() -> None:
    st, clean = _shard("async"), _shard("async")
    digest = st.state_digest()
    _fail_next_step(st)
    with pytest.raises(PSError, match="internal error.*nothing of it was applied") as e:
        _push(st, 0, (0.1, 0.05))
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert st.state_digest() == digest and st.clocks == [0, 0]
    for s in (st, clean):  # the retry goes in as if the failure had never been
        _push(s, 0, (0.1, 0.05))
    assert st.state_digest() == clean.state_digest()


def test_an_unforeseen_error_in_a_sync_close_skips_the_round_and_leaves_none_open() -> None:
    st = _shard("sync")
    weights = {k: p.detach().clone() for k, p in st.masters.items()}
    _push(st, 0, (0.1, 0.05))
    _fail_next_step(st)
    with pytest.raises(PSError, match="its round was skipped") as e:
        _push(st, 1, (0.1, 0.05))
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert st.rounds == 1 and st.skipped_rounds == 1 and st.version == 0
    assert all(p.detach().equal(weights[k]) for k, p in st.masters.items())
    for worker in (0, 1):  # round 2 is open and closes
        _push(st, worker, (0.1, 0.05), clock=2)
    assert st.rounds == 2 and st.version == 1
