"""--staleness-rule from the flags to the shard's step (issue #34 item 3).

The rule's arithmetic is tested by hand in tests/test_staleness_rules.py; here: which rule a
job gets from the flags (the older flags are aliases), that it travels in the JobSpec, and
that an async/ssp shard applies the adaptive rule on the weights it served each worker."""

from __future__ import annotations

import pytest
import torch

from psar.ps import serde
from psar.ps.job import Job
from psar.trainkit.config import PSConfig
from psar.trainkit.optim import adjusted, build_optimizer
from psar.trainkit.staleness_rules import AdaptiveRule, resolve_rule
from tests.ps_fixtures import grad_for, init_values, make_job, make_state, masters, pull, push


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, "adaptive"),
        ({"staleness_lr": True}, "fixed"),
        ({"staleness_lr_power": 0.5}, "fixed"),
        ({"delay_compensation": 1.0}, "fixed"),
        ({"delay_compensation": 1.0, "dc_adaptive": True}, "fixed"),
        ({"momentum_correction": False}, "none"),
        ({"staleness_lr": True, "momentum_correction": False}, "fixed"),
    ],
)
def test_the_older_flags_select_their_rule(kw: dict, want: str) -> None:
    assert resolve_rule("adaptive", **kw) == want
    assert PSConfig(mode="async", **kw).staleness_rule == want


@pytest.mark.parametrize("rule", ["adaptive", "fixed", "momentum", "none"])
def test_a_rule_alone_is_kept(rule: str) -> None:
    assert resolve_rule(rule) == rule
    assert PSConfig(mode="ssp", staleness_rule=rule).staleness_rule == rule


def test_fixed_without_the_momentum_rule_is_its_own_setting() -> None:
    assert resolve_rule("fixed", momentum_correction=False) == "fixed"


@pytest.mark.parametrize(
    ("rule", "kw", "flag"),
    [
        ("momentum", {"staleness_lr": True}, "--staleness-lr"),
        ("none", {"delay_compensation": 0.5}, "--delay-compensation"),
        ("momentum", {"momentum_correction": False}, "--no-momentum-correction"),
    ],
)
def test_an_alias_that_contradicts_the_rule_is_refused(rule: str, kw: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"{flag}.*--staleness-rule {rule}"):
        PSConfig(mode="async", staleness_rule=rule, **kw)
    with pytest.raises(ValueError, match="--staleness-rule"):
        Job(mode="async", staleness_rule=rule, **kw)


def test_an_unknown_rule_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="adaptive, fixed, momentum, none"):
        PSConfig(mode="async", staleness_rule="fast")


def test_the_rule_travels_in_the_job_spec_and_an_old_spec_reads_fixed() -> None:
    job = make_job("async", staleness_rule="adaptive")
    assert serde.job_from_pb(serde.job_to_pb(job)).staleness_rule == "adaptive"
    old = serde.job_to_pb(job)
    old.ClearField("staleness_rule")  # a spec written before the field existed
    assert serde.job_from_pb(old).staleness_rule == "fixed"


@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_an_async_shard_steps_as_the_adaptive_rule_says(mode: str, optimizer: str) -> None:
    """Three workers push in turn, each on the weights its last pull served (staleness 0 to
    2): the shard's masters equal the rule run beside it on those same weights, each push
    one step of the configured optimizer adjusted as the rule returns."""
    job = make_job(mode, num_workers=3, optimizer=optimizer, staleness=4, staleness_rule="adaptive")
    values = init_values(job)
    st = make_state(job, values)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in values.items()}
    opt = build_optimizer(params.values(), job.optimizer)
    rule = AdaptiveRule(
        num_workers=3,
        momentum=job.optimizer.beta1 if optimizer == "adamw" else job.optimizer.momentum,
        adamw=optimizer == "adamw",
    )
    served: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    version, changed = 0, 0
    for clock in range(1, 5):
        for w in range(3):
            pull(st, w, clock - 1)
            served[w] = (version, {k: p.detach().clone() for k, p in params.items()})
        for w in range(3):
            base_version, base = served[w]
            grads = grad_for(job, w, clock)
            out, _, _ = push(st, worker=w, clock=clock, base_version=base_version, grads=grads)
            assert out.applied
            mine = {k: g.clone() for k, g in grads.items()}
            adjust = rule.adjust(
                mine,
                staleness=version - base_version,
                version=version,
                lr=job.optimizer.lr,
                w_now={k: p.detach() for k, p in params.items()},
                w_base=base,
            )
            changed += adjust.lr_scale != 1.0 or any(
                not torch.equal(mine[k], grads[k]) for k in grads
            )
            for k, p in params.items():
                p.grad = mine[k]
            with adjusted(opt, adjust):
                opt.step()
            version += 1
    got = masters(st)
    for k, p in params.items():
        torch.testing.assert_close(got[k], p.detach(), rtol=0, atol=1e-6)
    assert changed == 12  # every push was scaled (or its lr) and, once stale, compensated
