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
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from psar.trainkit import cli_gen
from psar.trainkit.config import TrainConfig
from psar.trainkit.writable import check_folder_writable
from psar.worker.cli_parser import build_parser


def _run_server(args: argparse.Namespace) -> int:
    from psar.ps.server.config import ServerConfig
    from psar.ps.server.serve import serve

    cfg = cli_gen.build(ServerConfig, args, args.config)
    if cfg.checkpoint_dir:  # before serving: a shard that cannot checkpoint is not durable
        check_folder_writable(cfg.checkpoint_dir, "--checkpoint-dir")
    if args.dry_run:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    return serve(cfg)


class Terminated(BaseException):
    """SIGTERM arrived while training. A BaseException, like KeyboardInterrupt: a request
    to stop is no error, so `except Exception` handlers (an init failure reported to the
    shards, logging's own error handling) let it through."""


TERM_GRACE_S = 10.0
"""After SIGTERM, exit at the latest this much later, even if the exception raised in
the main thread was swallowed (e.g. by logging, whose handlers catch everything raised
while they write, the very moment a supervisor often picks to stop us)."""


def _on_sigterm(code: int) -> Callable[[int, object], None]:
    """The SIGTERM handler of `psar train`: raise Terminated in the main thread, and make
    sure the process is gone TERM_GRACE_S later with `code` (--sigterm-exit-code)."""

    def handler(signum: int, _frame: object) -> None:
        # Once: launchers often signal twice (Slurm's scancel, then srun's own stop), and a
        # second Terminated would cut short the cleanup the first one is running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=_exit_soon, args=(code,), daemon=True, name="psar-sigterm").start()
        raise Terminated(f"signal {signum}")

    return handler


def _exit_soon(code: int) -> None:
    time.sleep(TERM_GRACE_S)
    print("psar: terminated (SIGTERM)", file=sys.stderr, flush=True)
    os._exit(code)


def _leave(code: int) -> None:
    """End `psar train` with `code` now: flush what it wrote, then os._exit, skipping
    interpreter teardown. A worker holds native threads (gRPC's, gloo's, torch's) that may
    still run when Python finalizes; one that then needs the GIL is unwound through C++
    and aborts the process ("terminate called without an active exception", exit 134),
    whatever the exit it was heading for. A second signal cannot change the code now."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        logging.shutdown()
    os._exit(code)


def _dry_run_train(args: argparse.Namespace) -> int:
    """`psar train --dry-run`: apply every rule a start applies, print the result."""
    from psar.worker.loop import check_outputs, resolve_ranks
    from psar.worker.workloads.loader import resolve_factory

    cfg = cli_gen.build(TrainConfig, args, args.config)
    rank, world, local_rank = resolve_ranks(cfg, dict(os.environ))
    check_outputs(cfg, rank)
    servers = cfg.ps.server_list() if cfg.arch in ("ps", "hybrid") else []
    factory = resolve_factory(cfg.workload)  # an unknown workload fails here, as at start
    resolved = {"rank": rank, "world_size": world, "local_rank": local_rank, "servers": servers,
                "workload": f"{factory.__module__}:{factory.__qualname__}"}  # fmt: skip
    print(json.dumps({**dataclasses.asdict(cfg), "resolved": resolved}, indent=2))
    return 0


def _run_train(cfg: TrainConfig) -> None:
    from psar.worker.loop import train

    # torchrun, Kubernetes and Slurm stop workers with SIGTERM: leave like Ctrl-C does,
    # through the normal exception path, so connections close and the exit code says so.
    signal.signal(signal.SIGTERM, _on_sigterm(cfg.sigterm_exit_code))
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
        # and the workload's extra held-out metrics (recsys: val_logloss, val_auc)
        keys += tuple(summary.get("val_extra_metrics") or ())
        print(json.dumps({k: summary.get(k) for k in keys}))


def _train_exit_code(args: argparse.Namespace) -> int:
    """Run `psar train`; its exit code, whatever ended it (each exception has its own)."""
    sigterm_code = TrainConfig.sigterm_exit_code
    try:
        cfg = cli_gen.build(TrainConfig, args, args.config)
        sigterm_code = cfg.sigterm_exit_code
        _run_train(cfg)
        return 0
    except ValueError as e:
        # User errors (bad flag values, bad config files): one clear line, exit 2.
        print(f"psar train: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        # Stop now: _leave does not join client threads that may still be retrying a
        # shard (they would hold the process for up to --timeout-s). Cleanup in
        # `finally` blocks has already run while the exception unwound.
        sigterm = isinstance(e, Terminated)
        print(f"psar train: {'terminated (SIGTERM)' if sigterm else 'interrupted'}",
              file=sys.stderr)  # fmt: skip
        return sigterm_code if sigterm else 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except ConnectionRefusedError as e:  # nothing listens where a flag points: one line
        print(f"psar train: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _delegated(name: str) -> Callable[[list[str]], int]:
    if name == "plan":
        from psar.worker.plan import main
    elif name == "report":
        from psar.worker.report import main
    elif name == "launch":
        from psar.worker.launch import main
    elif name == "compare":
        from psar.worker.compare import main
    else:  # pragma: no cover - guarded by the caller
        raise KeyError(name)
    return main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plan", "report", "launch", "compare"):
        return _delegated(argv[0])(argv[1:])
    words = [a for a in argv if not a.startswith("-")]
    # Only the chosen subcommand's flags are built ("": none, for `psar --help`), so no
    # --help loads torch or the other side's config.
    parser = build_parser(words[0] if words and words[0] in ("train", "server") else "")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        if args.command == "server":
            return _run_server(args)
        if args.dry_run:
            return _dry_run_train(args)
    except ValueError as e:
        # User errors (bad flag values, bad config files): one clear line, exit 2.
        parser.exit(2, f"psar {args.command}: error: {e}\n")
    except OSError as e:  # a shard's port in use, a folder it cannot write: one line
        parser.exit(1, f"psar {args.command}: error: {e}\n")
    _leave(_train_exit_code(args))  # `psar train` always ends there (see _leave)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
