"""Who holds a rank: a Leave or a joiner's Register must come from it (issue #45).

A worker's instance is the random id its process registers with (PSBackend: 16 hex
digits, `RegisterRequest.instance`); the shard records the last one per rank
(ShardData.instances). Without these checks any client that can reach the shard (any
holder of the job's token; anyone where there is none) could Leave a live worker out of
the job, a stale Leave from a rank's previous holder would evict its new one, and a
Register with joined=true would replace a live rank's record. A refusal is
FAILED_PRECONDITION (reason not_holder) and changes nothing: it is raised under the
shard's lock before any state is touched.

A Register without joined from a new instance takes the rank over (a restarted process
of a fixed rank rejoins at once, even while its old lease holds: docs/reliability.md),
except a rank a joiner took through Join while that joiner holds it (a restarted
joiner asks Join again; it never comes back as its old rank). The job's token is what
keeps strangers from taking a fixed rank over that way.
"""

from __future__ import annotations

import hmac

from psar.ps.errors import FailedPrecondition
from psar.ps.server.state import ShardData


def check_holder(d: ShardData, worker: int, instance: str) -> None:
    """A Leave of `worker` must come from the instance that holds its rank here (the
    last Register naming it): a stale Leave of a previous holder, or one from any
    other client, would evict a live worker (issue #45). Refused, nothing changes."""
    holder = d.instances.get(worker, "")
    if not holder:
        raise FailedPrecondition(
            f"worker {worker} has no registered instance on this shard (it never "
            "registered, or the shard restarted since): Register with its instance "
            "first; nothing changed",
            reason="not_holder",
        )
    if not instance or not hmac.compare_digest(instance.encode(), holder.encode()):
        who = "names no instance" if not instance else "names another instance"
        raise FailedPrecondition(
            f"Leave of worker {worker} {who}: only the instance holding the rank (the "
            "one that registered it last, LeaveRequest.instance) may leave it; nothing "
            "changed",
            reason="not_holder",
        )


def check_joiner(d: ShardData, worker: int, instance: str) -> None:
    """A Register with joined=true takes a rank Join gave: refused where another
    instance holds it (live, waiting for its round, or given to it by Join and not
    registered yet), so a joiner never replaces a live rank's record (issue #45).
    The rank's own holder registering again (a retry) is let through."""
    if not instance:
        raise FailedPrecondition(
            f"a Register of worker {worker} with joined=true must name the instance "
            "Join gave the rank to (RegisterRequest.instance); nothing changed",
            reason="not_holder",
        )
    holder = d.instances.get(worker, "")
    held = (worker in d.live or worker in d.joining) and holder != instance
    res = d.reserved.get(worker)
    if res is not None and res[0] != instance and res[1] > d.leases.clock():
        held = True
    if held:
        raise FailedPrecondition(
            f"worker {worker} is held by another instance (live, waiting for its round, "
            "or given to another joiner): a joiner registers only the rank Join gave "
            "it; ask shard 0's Join for a rank. Nothing changed",
            reason="not_holder",
        )


def check_takeover(d: ShardData, joined: dict[int, str], worker: int, instance: str) -> None:
    """A Register without joined from another instance than the holder's: a restart of
    a fixed rank (let through), unless a joiner took the rank through Join and holds it
    now (live or waiting for its round): that one is not replaced."""
    holder = d.instances.get(worker, "")
    if not holder or instance == holder or joined.get(worker) != holder:
        return
    if worker in d.live or worker in d.joining:
        raise FailedPrecondition(
            f"worker {worker} is held by the joiner that took it through Join: another "
            "instance may not register it; start a new worker with --join (it gets a free "
            "rank). Nothing changed",
            reason="not_holder",
        )
