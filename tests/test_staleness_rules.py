"""The `adaptive` staleness rule's arithmetic (trainkit/staleness_rules.py), by hand.

Pure logic on tensors: no shard, no socket. Each case builds the situation the rule is
meant to recognise (noise, a coherent gradient, a quadratic at its stability edge, a
stale gradient on a known curvature) and checks the scale, the momentum and the
compensated gradient against values computed here.
"""

from __future__ import annotations

import math

import pytest
import torch

from psar.trainkit import staleness_rules as sr
from psar.trainkit.staleness_rules import AdaptiveRule, check_rule, delayed_edge


def _rule(n: int = 4, momentum: float = 0.9, adamw: bool = False) -> AdaptiveRule:
    return AdaptiveRule(num_workers=n, momentum=momentum, adamw=adamw)


# ---- the stability edge ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("momentum", "delay", "want"),
    [
        (0.0, 0, 2.0),  # plain gradient descent: lr h < 2
        (0.9, 0, 3.8),  # heavy ball: 2 (1 + momentum)
        (0.0, 1, 2 * math.sin(math.pi / 6)),  # x' = x - a x_{t-d}: 2 sin(pi / (4d + 2))
        (0.0, 3, 2 * math.sin(math.pi / 14)),
    ],
)
def test_delayed_edge_known_values(momentum: float, delay: int, want: float) -> None:
    assert delayed_edge(momentum, delay) == pytest.approx(want, rel=1e-6)


def test_delayed_edge_shrinks_with_delay_and_momentum_and_interpolates() -> None:
    edges = [delayed_edge(0.15, d) for d in range(6)]
    assert edges == sorted(edges, reverse=True)
    assert delayed_edge(0.6, 3) < delayed_edge(0.15, 3)  # momentum + delay: less stable
    half = delayed_edge(0.15, 2.5)
    assert half == pytest.approx(0.5 * (edges[2] + edges[3]), rel=1e-9)
    assert delayed_edge(0.0, 1e9) == delayed_edge(0.0, sr.MAX_DELAY)


@pytest.mark.parametrize(("momentum", "delay"), [(-0.1, 1), (1.0, 1), (0.5, -1), (0.5, math.nan)])
def test_delayed_edge_refuses_bad_input(momentum: float, delay: float) -> None:
    with pytest.raises(ValueError, match="momentum|delay"):
        delayed_edge(momentum, delay)


def test_check_rule_names_the_accepted_rules() -> None:
    assert check_rule("adaptive") == "adaptive"
    with pytest.raises(ValueError, match="--staleness-rule: unknown 'fast'; accepted: adaptive"):
        check_rule("fast")


@pytest.mark.parametrize(("n", "momentum"), [(0, 0.9), (4, 1.0), (4, -0.5)])
def test_rule_refuses_bad_config(n: int, momentum: float) -> None:
    with pytest.raises(ValueError):
        AdaptiveRule(num_workers=n, momentum=momentum)


# ---- the step scale --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "momentum", "want"), [(4, 0.9, 0.85 / 0.4), (2, 0.9, 3.0), (1, 0.9, 1.0), (4, 0.0, 0.25)]
)
def test_sync_scale_matches_syncs_movement_per_sample(n: int, momentum: float, want: float) -> None:
    # N pushes at lr c with momentum b_a move N c / (1 - b_a) where sync's one step moves
    # 1 / (1 - b): c = (1 - b_a) / (N (1 - b)).
    rule = _rule(n, momentum)
    assert rule.sync_scale == pytest.approx(want, rel=1e-12)
    assert rule.applied_momentum == pytest.approx(max(0.0, momentum - (1 - 1 / n)))


def test_first_push_knows_nothing_and_moves_as_sync() -> None:
    rule = _rule()
    g = torch.tensor([1.0, -2.0, 3.0])
    adj = rule.adjust({"a": g}, staleness=3, version=3, lr=0.05, w_now={}, w_base=None)
    torch.testing.assert_close(g, torch.tensor([1.0, -2.0, 3.0]) * rule.sync_scale)
    assert adj.lr_scale == 1.0 and adj.momentum == pytest.approx(0.15)


def test_a_coherent_gradient_takes_the_staleness_scale() -> None:
    # The same gradient every push: all signal (coherence 1), so staleness matters and
    # the scale is (1 + s) ** -1/2: 0.5 at staleness 3.
    rule = _rule()
    for v in range(3):
        g = torch.tensor([0.5, -1.0])
        rule.adjust({"a": g}, staleness=3, version=v + 3, lr=0.05, w_now={}, w_base=None)
    assert rule.slots["a"].coherence() == pytest.approx(1.0)
    torch.testing.assert_close(g, torch.tensor([0.5, -1.0]) * 0.5)


def test_independent_noise_keeps_syncs_movement() -> None:
    # Gradients that are batch noise around zero: coherence ~0, no curvature seen (no
    # bases): the slot keeps moving per sample as sync does.
    gen = torch.Generator().manual_seed(0)
    rule = _rule()
    for v in range(200):
        g = torch.randn(4096, generator=gen)
        raw = g.clone()
        rule.adjust({"a": g}, staleness=3, version=v + 3, lr=0.05, w_now={}, w_base=None)
    assert abs(rule.slots["a"].coherence()) < 0.05
    ratio = float((g / raw).mean())
    assert rule.sync_scale**0.9 * 0.5**0.1 <= ratio <= rule.sync_scale  # margin <= 2 x 0.05


def _quadratic_pushes(rule: AdaptiveRule, h: float, *, lr: float, staleness: int, steps: int,
                      numel: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """Pushes of g = h w_base on a trajectory w_k = 0.9^k (no noise), each computed
    `staleness` versions before it is applied; returns the gradients the rule gave back."""
    traj = [torch.full((numel,), 0.9**k) for k in range(steps + staleness + 1)]
    out = []
    for v in range(staleness, staleness + steps):
        base = {"a": traj[v - staleness]}
        g = h * base["a"].clone()
        rule.adjust({"a": g}, staleness=staleness, version=v, lr=lr, w_now={"a": traj[v]},
                    w_base=base)  # fmt: skip
        out.append(g)
    return out


def test_secant_measures_the_curvature_and_compensates_exactly() -> None:
    # AdamW mode: the rule compensates but does not scale the gradient, so what comes
    # back is g + lambda v (w_now - w_base) itself. On a quadratic the secant finds h and
    # the compensated gradient is the gradient at w_now: h * w_now.
    h, s = 3.0, 3
    rule = _rule(adamw=True)
    got = _quadratic_pushes(rule, h, lr=0.05, staleness=s, steps=30)
    assert rule.slots["a"].curvature() == pytest.approx(h, rel=1e-6)  # fp32
    want = h * torch.tensor([0.9 ** (s + 29)])
    torch.testing.assert_close(got[-1], want, rtol=1e-6, atol=0)


def test_the_compensation_follows_the_mean_square_and_has_the_secants_curvature() -> None:
    # lambda v drift, v the mean square per element: the larger gradient's element takes
    # the larger share, and along the drift the correction's curvature is h exactly.
    g = torch.zeros(2)
    v, drift, h = torch.tensor([4.0, 1.0]), torch.tensor([-0.5, -0.5]), 3.0
    sr.compensate_(g, h, v, drift)
    lam = h * float((drift * drift).sum()) / float((v * drift * drift).sum())
    torch.testing.assert_close(g, lam * v * drift)
    assert float(g @ drift) / float(drift @ drift) == pytest.approx(h, rel=1e-6)
    assert float(g[0]) < float(g[1]) < 0
    flat = torch.zeros(2)
    sr.compensate_(flat, h, torch.zeros(2), drift)  # no mean square along it: h drift
    torch.testing.assert_close(flat, h * drift)


def test_a_pair_whose_base_holds_the_earlier_push_is_not_a_secant() -> None:
    # Staleness 0 every time: each push was computed on weights that include the
    # previous push's own update, whose noise would bias h: no secant is taken.
    rule = _rule()
    _quadratic_pushes(rule, 3.0, lr=0.05, staleness=0, steps=10)
    assert rule.slots["a"].secant_den == 0.0 and rule.slots["a"].curvature() == 0.0


def test_a_slot_at_its_stability_edge_takes_the_staleness_scale() -> None:
    # lr c h far beyond KAPPA x the delayed edge: margin 1, scale (1 + s) ** -1/2.
    rule = _rule()
    got = _quadratic_pushes(rule, 500.0, lr=0.05, staleness=3, steps=20)
    assert rule.slots["a"].applied == pytest.approx(0.5, rel=1e-12)
    assert got[-1].abs().item() > 0


def test_a_flat_noisy_slot_keeps_syncs_movement_beside_a_sharp_one() -> None:
    # Per slot: a flat slot of pure noise keeps c_sync while a sharp one is held at the
    # staleness scale in the same pushes.
    gen = torch.Generator().manual_seed(1)
    rule = _rule()
    traj = [torch.full((8,), 0.9**k) for k in range(60)]
    for v in range(3, 50):
        base, now = {"sharp": traj[v - 3], "flat": traj[v - 3]}, {"sharp": traj[v], "flat": traj[v]}
        grads = {"sharp": 500.0 * traj[v - 3].clone(), "flat": torch.randn(8, generator=gen)}
        rule.adjust(grads, staleness=3, version=v, lr=0.05, w_now=now, w_base=base)
    assert rule.slots["sharp"].applied == pytest.approx(0.5, rel=1e-12)
    assert rule.slots["flat"].applied > 1.5  # sync_scale 2.125; chance coherence pulls a little


def test_adamw_scales_the_learning_rate_not_the_gradient() -> None:
    rule = _rule(adamw=True)
    g = torch.tensor([3.0, 4.0])
    adj = rule.adjust({"a": g}, staleness=1, version=1, lr=1e-3, w_now={}, w_base=None)
    torch.testing.assert_close(g, torch.tensor([3.0, 4.0]))
    assert adj.lr_scale == pytest.approx(rule.sync_scale)
    assert adj.momentum == pytest.approx(0.15)  # beta1 by the momentum rule


def test_a_push_without_its_base_is_not_compensated_nor_paired() -> None:
    rule = _rule(adamw=True)
    _quadratic_pushes(rule, 3.0, lr=0.05, staleness=3, steps=5)
    g = torch.tensor([1.0])
    rule.adjust({"a": g}, staleness=3, version=99, lr=0.05, w_now={"a": torch.zeros(1)},
                w_base=None)  # fmt: skip
    torch.testing.assert_close(g, torch.tensor([1.0]))
    assert rule.prev is not None and rule.prev.base is None
    den = rule.slots["a"].secant_den
    g2 = torch.tensor([1.0])
    base = {"a": torch.ones(1)}
    rule.adjust({"a": g2}, staleness=1, version=100, lr=0.05, w_now=base, w_base=base)
    assert rule.slots["a"].secant_den == den * sr.STAT_DECAY**0  # no pair with a baseless push


def test_same_pushes_same_results() -> None:
    def run() -> list[torch.Tensor]:
        return _quadratic_pushes(_rule(), 7.0, lr=0.05, staleness=2, steps=25, numel=3)

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


def test_refuses_negative_staleness() -> None:
    with pytest.raises(ValueError, match="staleness"):
        _rule().adjust({"a": torch.ones(1)}, staleness=-1, version=0, lr=0.1, w_now={},
                       w_base=None)  # fmt: skip
