"""`psar`: one console script, several subcommands.

psar server   one parameter-server shard (gRPC)
psar train    one worker of a training job (--arch ps | allreduce)
psar plan     predict communication and memory of both architectures
psar report   plots and a table from a run folder
psar launch   start a whole job (shards + workers, or torchrun) on this machine
psar compare  the same workload under allreduce, ps-sync, ps-async and ps-ssp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ps.server.config import ServerConfig
from worker import cli_gen
from worker.cli_parser import build_parser
from worker.config import TrainConfig


def _run_server(args: argparse.Namespace) -> int:
    from ps.server.serve import serve

    cfg = cli_gen.build(ServerConfig, args, args.config)
    if args.dry_run:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    return serve(cfg)


class Terminated(Exception):
    """SIGTERM arrived while training."""


TERM_GRACE_S = 10.0
"""After SIGTERM, exit 143 at the latest this much later, even if the exception raised in
the main thread was swallowed (e.g. by logging, whose handlers catch everything raised
while they write, the very moment a supervisor often picks to stop us)."""


def _raise_terminated(signum: int, _frame: object) -> None:
    threading.Thread(target=_exit_soon, daemon=True, name="psar-sigterm").start()
    raise Terminated(f"signal {signum}")


def _exit_soon() -> None:
    time.sleep(TERM_GRACE_S)
    print("psar: terminated (SIGTERM)", file=sys.stderr, flush=True)
    os._exit(143)


def _run_train(args: argparse.Namespace) -> int:
    cfg = cli_gen.build(TrainConfig, args, args.config)
    if args.dry_run:
        from worker.loop import resolve_ranks

        rank, world, local_rank = resolve_ranks(cfg, dict(os.environ))
        servers = cfg.ps.server_list() if cfg.arch == "ps" else []
        resolved = {"rank": rank, "world_size": world, "local_rank": local_rank, "servers": servers}
        print(json.dumps({**dataclasses.asdict(cfg), "resolved": resolved}, indent=2))
        return 0
    from worker.loop import train

    # torchrun, Kubernetes and Slurm stop workers with SIGTERM: leave like Ctrl-C does,
    # through the normal exception path, so connections close and the exit code says so.
    signal.signal(signal.SIGTERM, _raise_terminated)
    summary = train(cfg)
    if summary.get("rank", 0) == 0:
        keys = (
            "arch",
            "mode",
            "steps",
            "samples_per_sec",
            "final_train_loss",
            "val_loss",
            "skipped_steps",
        )
        print(json.dumps({k: summary.get(k) for k in keys}))
    if cfg.arch == "allreduce":
        # Everything is written and the process group is destroyed. Skip interpreter
        # teardown: gloo's background threads can abort it ("terminate called without
        # an active exception"), which torchrun would report as a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


def _delegated(name: str) -> Callable[[list[str]], int]:
    if name == "plan":
        from worker.plan import main
    elif name == "report":
        from worker.report import main
    elif name == "launch":
        from worker.launch import main
    elif name == "compare":
        from worker.compare import main
    else:  # pragma: no cover - guarded by the caller
        raise KeyError(name)
    return main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plan", "report", "launch", "compare"):
        return _delegated(argv[0])(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        if args.command == "server":
            return _run_server(args)
        return _run_train(args)
    except ValueError as e:
        # User errors (bad flag values, bad config files): one clear line, exit 2.
        parser.exit(2, f"psar {args.command}: error: {e}\n")
    except (KeyboardInterrupt, Terminated) as e:
        # Stop now: exit without joining client threads that may still be retrying a
        # shard (they would hold the process for up to --timeout-s). Cleanup in
        # `finally` blocks has already run while the exception unwound.
        sigterm = isinstance(e, Terminated)
        print(
            f"psar {args.command}: {'terminated (SIGTERM)' if sigterm else 'interrupted'}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(143 if sigterm else 130)


if __name__ == "__main__":
    sys.exit(main())
