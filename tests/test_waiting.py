"""trainkit/waiting.py: a long wait is reported every few seconds, a short one never."""

from __future__ import annotations

import logging

from psar.trainkit.waiting import Waits


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_wait_is_reported_after_first_after_then_every() -> None:
    clock = Clock()
    waits = Waits(logging.getLogger("t"), first_after_s=5, every_s=10, clock=clock)
    waits.close()  # no thread: the test reads what is due itself
    with waits.waiting(lambda s: f"waiting for rank 0: {s:.0f} s of --timeout-s 60"):
        clock.t += 4
        assert waits.due() == []
        clock.t += 1
        assert waits.due() == ["waiting for rank 0: 5 s of --timeout-s 60"]
        assert waits.due() == []  # once per period
        clock.t += 10
        assert waits.due() == ["waiting for rank 0: 15 s of --timeout-s 60"]
    clock.t += 100
    assert waits.due() == []  # ended: no more lines


def test_the_thread_logs_a_long_wait_and_not_a_short_one(caplog) -> None:  # noqa: ANN001
    import time

    waits = Waits(logging.getLogger("psar.test"), first_after_s=0.2, every_s=0.3)
    with caplog.at_level(logging.WARNING, logger="psar.test"):
        with waits.waiting(lambda s: "short"):
            pass
        with waits.waiting(lambda s: f"long {s:.1f}"):
            time.sleep(0.9)
    waits.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "psar.test"]
    assert "short" not in lines
    assert sum(m.startswith("long") for m in lines) >= 1  # its thread runs when scheduled
