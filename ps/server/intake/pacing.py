"""Push pacing (sync with `--chunk-rounds`, data plane): keep a round's pushes in step.

Why: a shard host's NIC is shared by every worker's push, and TCP does not share a
bottleneck fairly over a second or two: on a 1 Gbit/s link, of two flows sending 80 MB
each at once, one finished at 0.83 s and the other at 1.40 s (bench/README.md, "The
crossover"). A per-slot round closes only when the *slowest* push has brought that slot,
so while one push runs ahead the shard has few slots to send back; once the fast one is
done, the slow one's remaining slots close in a burst and their pulls, one copy per
worker, pile up behind the NIC's outgoing side. Measured: a 0.2-0.46 s tail after the
last push on 2-8 workers per shard host, 12-19% of the step.

What: before the shard reads the next slot of a push, it waits while that push has
received `lead` bytes or more beyond the slowest other push of the same round that is
still streaming. The bytes it does not read stay in TCP's buffers, so the sender's
window closes and the bottleneck's capacity goes to the pushes behind. Pushes of
workers that have not begun this round do not hold anyone back (their bytes do not
compete yet), nor do finished ones. Nothing about what is applied changes: the same
bytes reach the same slots, only when they are read.

Liveness: every wait ends when the slowest push moves on, ends, or is dropped (the
shard notifies its condition at each), and a push waits at most `budget_s` in all,
whatever happens to the others; the frame's read deadline is extended by the wait (the
delay is the shard's, not the sender's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psar.ps.server.intake.pieces import PushTicket

DEFAULT_LEAD_MIB = 2.0
"""Measured on emulated 1 Gbit/s hosts (bench/links, 0.5 MiB slots): 2 MiB cut the tail
after the push from 0.21 to 0.07 s (2 workers, 1 shard host) and 0.42 to 0.20 s (4
workers, 2 shard hosts), with no change where every NIC carries one flow's worth."""
BUDGET_S = 5.0
"""A push's total pacing wait at most: a safety net for a push that stops moving without
ending (its connection's own read deadlines end it later), never reached in a run."""


def ahead(tickets: Mapping[int, PushTicket], ticket: PushTicket, lead_bytes: int) -> bool:
    """Whether `ticket` has received `lead_bytes` or more beyond the slowest other push of
    its round still streaming (`tickets`: the round's data-carrying pushes by worker)."""
    if lead_bytes <= 0 or tickets.get(ticket.header.worker) is not ticket:
        return False
    others = [
        t.bytes_in
        for w, t in tickets.items()
        if w != ticket.header.worker and not t.accepted and t.lock is not None
    ]
    return bool(others) and ticket.bytes_in - min(others) >= lead_bytes
