"""What a worker's client raises when a shard refuses a request or cannot be reached."""

from __future__ import annotations

import grpc


class PSClientError(RuntimeError):
    """A shard refused a request or could not be reached; says which shard and why."""

    def __init__(self, shard: int, address: str, code: grpc.StatusCode | None, details: str):
        name = code.name if code is not None else "ERROR"
        super().__init__(f"shard {shard} ({address}): {name}: {details}")
        self.shard, self.address, self.code, self.details = shard, address, code, details


class NeedsResync(PSClientError):
    """The shard was restored or rolled back (reason "restored"), the worker's lease
    expired ("expired"), or a join came too late ("too_late"): register again."""

    @property
    def reason(self) -> str:
        return self.details.split(":", 1)[0].replace(" ", "_")


RESYNC_PREFIXES = ("restored:", "expired:", "too late:")


NOT_INITIALISED = "shard not initialised"


def restarted_empty(incarnation: int, details: str) -> str:
    """What a worker says when a shard it had synchronised with (`incarnation`) answers
    that it is not initialised: the shard restarted without its state. The shard's own
    words blame rank 0, which is right at job start but misleading here."""
    return (
        f"shard restarted empty: it served this job (incarnation {incarnation}) and now "
        "holds no state; it was restarted without --restore, or with --restore-or-fresh "
        "after none of its checkpoints verified. Restart it with --restore DIR (or start "
        f"the job again). The shard said: {details}"
    )
