"""Joining and leaving torch.distributed's default process group.

Leaving is the delicate half. A collective's work object carries the thread-local state of
the thread that issued it, and for collectives DDP issues from its backward hooks that
state holds a Python object (torch stashes the autograd context in it during backward), so
destroying the work takes the GIL. Gloo's worker thread drops its reference right after it
completes the work, and when that is the last one, the destructor runs on that thread:

- if the main thread has meanwhile reached interpreter shutdown, taking the GIL ends the
  thread by forced unwind through a noexcept destructor: "terminate called without an
  active exception", the rank dies by SIGABRT after its last step (a CI run of
  bench/plain_ddp.py under torchrun);
- if the main thread is in ~ProcessGroupGloo, which joins the worker threads with the GIL
  held, the rank hangs at exit (py-spy: main in thread::join, worker in
  ~AsyncBarrierWork -> gil_scoped_acquire).

`end_process_group` waits for every rank (barrier), then sleeps without the GIL so the
worker threads finish dropping their work before anything is torn down. Reproduced with
the non-main threads starved: at nice 19 under four CPU hogs on 2 cores, 4 of 10 runs
aborted at exit without it, 0 of 8 with it; on SCHED_IDLE, every run aborts without it
(tests/test_process_group_exit.py).
"""

import datetime
import os
import time

import torch.distributed as dist

# Long enough for a descheduled worker thread to run the few microseconds it needs on a
# loaded machine, short enough not to matter once a run has ended.
DRAIN_S = 0.05


def init_process_group(backend: str, timeout_s: float) -> None:
    """Join torchrun's process group (env://) with an explicit timeout."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A relaunch (torchrun --max-restarts) reuses the agent's store: keep this
        # attempt's keys apart, or a rank may read a dead rank's address and fail to
        # connect ("Gloo connectFullMesh failed ... Connection refused").
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"/psar/attempt_{attempt}", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def end_process_group() -> None:
    """Leave the default group without aborting or hanging at exit (module docstring)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    time.sleep(DRAIN_S)  # releases the GIL: the worker threads drop their work now
    dist.destroy_process_group()
