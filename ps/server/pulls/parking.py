"""Waits that park a call instead of a thread (issue #18: waiting pulls held gRPC threads).

A sync-mode pull waits for its round to close, an SSP pull for the slowest worker,
GetJob(wait) for rank 0's Init. Each waited on the shard's condition in a gRPC handler
thread, so `--rpc-threads` waiting calls starved everything else (Stats, the push that would
close the round). Now such a call is an asyncio coroutine on the server's loop
(ps/server/doors/aio_host.py): it registers a predicate here and awaits an asyncio.Event.

One watcher thread per condition waits on it for every parked call: each notify_all of
the shard wakes it, it re-evaluates the parked predicates under the shard's lock and
wakes (loop.call_soon_threadsafe) only those now true. It evaluates them before every
wait, under the same lock a state change is made under, so no wakeup is lost between a
call's own check and its parking. It exits when nothing has been parked for a while.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

log = logging.getLogger("psar.server")

T = TypeVar("T")

_RECHECK_S = 0.25
"""The watcher re-evaluates parked predicates this often even without a notify: some
state a wait depends on changes without one (a rank-0 init failure report)."""
_IDLE_EXIT_S = 5.0
"""An idle watcher (nothing parked) exits after this long; the next park starts one."""


class _Waiter:
    __slots__ = ("ready", "wake")

    def __init__(self, ready: Callable[[], bool], wake: Callable[[], None]) -> None:
        self.ready = ready
        self.wake = wake


class Parking:
    """Calls parked on `cond` (a threading.Condition whose every state change is followed
    by notify_all, as ShardState's is). Register with park() while holding `cond`."""

    def __init__(self, cond: threading.Condition, name: str = "psar-parking") -> None:
        self.cond = cond
        self.name = name
        self._mu = threading.Lock()  # guards _waiters; taken after cond, never before
        self._waiters: set[_Waiter] = set()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._mu:
            return len(self._waiters)

    def park(self, ready: Callable[[], bool], wake: Callable[[], None]) -> _Waiter:
        """Call `wake` (from the watcher thread) once `ready()` holds. The caller holds
        `cond` and has just seen `ready()` false; `wake` must not block."""
        waiter = _Waiter(ready, wake)
        with self._mu:
            self._waiters.add(waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name=self.name, daemon=True)
                self._thread.start()  # it takes `cond` once the caller lets it go
        return waiter

    def unpark(self, waiter: _Waiter | None) -> None:
        """Forget a waiter (woken, timed out or cancelled); needs no lock of the caller."""
        if waiter is not None:
            with self._mu:
                self._waiters.discard(waiter)

    def _watch(self) -> None:
        idle = 0.0
        with self.cond:
            while True:
                with self._mu:
                    waiters = list(self._waiters)
                for w in waiters:
                    if getattr(w.wake, "closed", False):  # its call is gone (cancelled)
                        self.unpark(w)
                        continue
                    try:
                        go = w.ready()
                    except Exception:  # noqa: BLE001 - the woken call re-checks and raises it
                        go = True
                    if go:
                        self.unpark(w)
                        try:
                            w.wake()
                        except RuntimeError:  # its event loop is closed: the server stopped
                            pass
                with self._mu:
                    if self._waiters:
                        idle = 0.0
                    elif idle >= _IDLE_EXIT_S:
                        self._thread = None
                        return
                    else:
                        idle += _RECHECK_S
                self.cond.wait(_RECHECK_S)


def parking_of(owner: Any) -> Parking:
    """The Parking of an object with a `cond` (a shard), made on first use (no lock:
    dict.setdefault is atomic, and this runs on the event loop)."""
    p = owner.__dict__.get("_parking")
    if p is None:
        p = owner.__dict__.setdefault("_parking", Parking(owner.cond))
    return p


async def in_pool(executor: Executor | None, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run a short blocking call (it takes the shard's lock) off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(fn, *args, **kw))


class Wake:
    """An asyncio.Event a thread may set: the `wake` of a parked call."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self.closed = False
        """Set when its call ends: the watcher drops a waiter parked by a locked step
        whose caller was cancelled meanwhile (nobody left to unpark it)."""

    def __call__(self) -> None:
        self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> bool:
        """True once woken, False when `timeout` seconds pass first; re-armed either way."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.event.clear()


async def wait_until(
    owner: Any, ready: Callable[[], bool], timeout: float, executor: Executor | None = None
) -> bool:
    """Await `ready()` (evaluated under `owner.cond`) for at most `timeout` seconds
    without holding a thread; returns whether it holds."""
    parking = parking_of(owner)
    wake = Wake()

    def check_or_park() -> Any:
        with owner.cond:
            return True if ready() else parking.park(ready, wake)

    waiter = None
    try:
        waiter = await in_pool(executor, check_or_park)
        return True if waiter is True else await wake.wait(timeout)
    finally:
        wake.closed = True
        if waiter is not True:
            parking.unpark(waiter)
