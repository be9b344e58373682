"""The elastic data ledger (ps/server/membership/ledger.py), as pure logic: every batch id is
trained on exactly once across any membership history (grow, shrink, kill), and the deal
is a function of that history."""

from __future__ import annotations

import random

import pytest

from psar.ps.server.membership.ledger import DataLedger


def test_deal_is_idempotent_and_in_order() -> None:
    led = DataLedger(10, per_step=2)
    assert led.deal(0, 1) == (0, 1)
    assert led.deal(1, 1) == (2, 3)
    assert led.deal(0, 1) == (0, 1)  # asked again (a retried pull): the same ids
    assert led.remaining() == 6 and led.outstanding() == 4


def test_rounds_are_dealt_in_rank_order() -> None:
    led = DataLedger(100)
    led.deal_round({3, 0, 1}, clock=1)
    assert [led.deals[w][1] for w in (0, 1, 3)] == [(0,), (1,), (2,)]


def test_given_back_ids_go_first_sorted() -> None:
    led = DataLedger(100, per_step=2)
    for w in range(3):
        led.deal(w, 1)  # 0: (0, 1), 1: (2, 3), 2: (4, 5)
    led.consume(0, 1)
    assert led.give_back(2) == 2 and led.give_back(1) == 2
    assert led.returned == [2, 3, 4, 5]
    assert led.deal(0, 2) == (2, 3) and led.deal(0, 3) == (4, 5)
    assert led.deal(0, 4) == (6, 7)  # then the fresh ones again


def test_give_back_through_a_clock_keeps_later_deals() -> None:
    led = DataLedger(100)
    led.deal(0, 1), led.deal(0, 2)
    assert led.give_back(0, through=1) == 1
    assert led.deals[0] == {2: (1,)} and led.returned == [0]


def test_the_last_deal_may_be_short_then_none() -> None:
    led = DataLedger(5, per_step=2)
    assert [led.deal(w, 1) for w in range(4)] == [(0, 1), (2, 3), (4,), ()]
    assert led.exhausted() and 3 not in led.deals


def test_state_round_trips() -> None:
    led = DataLedger(50, per_step=3)
    led.deal(0, 1), led.deal(1, 1), led.consume(0, 1), led.give_back(1)
    led.deal(2, 4)
    back = DataLedger.from_state(led.state())
    assert back.state() == led.state()
    assert back.deal(5, 1) == led.deal(5, 1)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="per_step"):
        DataLedger(10, per_step=0)
    with pytest.raises(ValueError, match="total"):
        DataLedger(0)


# ---- a sync job's whole history, simulated: grow, shrink, kill ---------------------------


def simulate_sync(seed: int, total: int = 200, per_step: int = 2) -> tuple[list, dict]:
    """A rounds job driven round by round with random joins, graceful leaves and kills
    (a killed worker may have pushed its round before dying, or not). Returns the ids
    each push trained on, in order, and every round's deal (the history's function)."""
    rng = random.Random(seed)
    led = DataLedger(total, per_step)
    live = {0, 1}
    next_rank = 2
    trained: list[int] = []
    deals: dict[int, dict[int, tuple[int, ...]]] = {}
    round_ = 1
    led.deal_round(live, round_)
    while not (led.exhausted() and led.outstanding() == 0) and round_ < 10_000:
        deals[round_] = {w: led.deals.get(w, {}).get(round_, ()) for w in sorted(live)}
        event = rng.random()
        pushed = [w for w in sorted(live) if deals[round_][w]]
        if event < 0.1 and len(live) > 1:  # a kill: before or after its push on shard 0
            dead = rng.choice(sorted(live))
            if rng.random() < 0.5:
                pushed.remove(dead) if dead in pushed else None
            for w in pushed:
                trained.extend(led.deals[w][round_])
                led.consume(w, round_)
            live.discard(dead)
            led.give_back(dead)
        else:
            for w in pushed:
                trained.extend(led.deals[w][round_])
                led.consume(w, round_)
            if event < 0.2 and len(live) > 1:  # a graceful leave after its push
                gone = rng.choice(sorted(live))
                live.discard(gone)
                led.give_back(gone)
        # Workers with nothing dealt this round leave (their data is done).
        for w in [w for w in live if not deals[round_][w]]:
            live.discard(w)
            led.give_back(w)
        if event > 0.85 or not live:  # a join at the boundary
            live.add(next_rank)
            next_rank += 1
        round_ += 1
        led.deal_round(live, round_)
    return trained, deals


@pytest.mark.parametrize("seed", range(20))
def test_every_id_trained_exactly_once_across_any_history(seed: int) -> None:
    trained, _ = simulate_sync(seed)
    assert sorted(trained) == list(range(200))


def test_the_deal_is_a_function_of_the_history() -> None:
    assert simulate_sync(7) == simulate_sync(7)
    assert simulate_sync(7)[1] != simulate_sync(8)[1]


def test_async_workers_ask_in_any_order_and_still_train_each_id_once() -> None:
    rng = random.Random(3)
    led = DataLedger(300, per_step=1)
    clocks = {0: 0, 1: 0, 2: 0}
    trained: list[int] = []
    next_rank = 3
    for _ in range(5000):
        if led.exhausted() and led.outstanding() == 0:
            break
        w = rng.choice(sorted(clocks))
        ids = led.deal(w, clocks[w] + 1)
        roll = rng.random()
        if roll < 0.03 and len(clocks) > 1:  # killed before pushing
            del clocks[w]
            led.give_back(w)
            clocks[next_rank] = 0
            next_rank += 1
        elif ids:
            clocks[w] += 1
            trained.extend(ids)
            led.consume(w, clocks[w])
    assert sorted(trained) == list(range(300))
