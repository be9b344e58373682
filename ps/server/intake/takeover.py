"""A worker's newer push supersedes its stalled one, whichever door each came through.

One push per worker at a time: Intake.begin_push (ps/server/intake/intake.py) holds a
per-worker lock for the push's whole stream. A push whose peer went silent after a piece (a stalled data-plane
connection, a gRPC stream left open) would hold that lock until its connection's
deadline, so the worker's retry (which gave up on it) waited up to 60 s and failed
"another push is still in flight". Instead, each door registers the push it is streaming
with a way to cut it off; a new push of the same worker, on either door, cuts the old
one first (its push is released unapplied: a push applies only once its stream ended
cleanly), and the old one's thread lets go of the lock at once (issue #18 for the data
plane alone, issue #33 across the data plane and gRPC).

The doors' cut-offs: the data plane shuts the old connection's socket (its thread wakes
from recv); gRPC aborts the old call with ABORTED (its handler wakes from the request
iterator). Both are safe to call from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("psar.shard")


class InFlightPushes:
    """Worker -> the push of it streaming now (an owner token and how to cut it off)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_worker: dict[int, tuple[object, str, Callable[[], None]]] = {}
        self.superseded = 0
        """Pushes cut off by a newer push of the same worker (both doors)."""

    def supersede(self, worker: int, owner: object, door: str) -> bool:
        """`owner` (a push arriving on `door`) is about to take `worker`'s push lock: cut
        off the push of that worker still streaming, if any. Returns whether one was."""
        with self._lock:
            old = self._by_worker.get(worker)
            if old is None or old[0] is owner:
                return False
            del self._by_worker[worker]
            self.superseded += 1
        log.warning("a new push of worker %d (%s) supersedes its stalled one (%s): that one "
                    "is cut off and applies nothing", worker, door, old[1])  # fmt: skip
        old[2]()
        return True

    def began(self, worker: int, owner: object, door: str, cut_off: Callable[[], None]) -> None:
        """`owner`'s push of `worker` was accepted (it holds the worker's push lock)."""
        with self._lock:
            self._by_worker[worker] = (owner, door, cut_off)

    def ended(self, worker: int, owner: object) -> None:
        """`owner`'s push ended (applied, refused or cut off)."""
        with self._lock:
            cur = self._by_worker.get(worker)
            if cur is not None and cur[0] is owner:
                del self._by_worker[worker]
