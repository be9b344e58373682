"""The `psar` argument parser: subcommands, and the train and server flags generated from
their config dataclasses (trainkit/cli_gen.py). `psar launch` validates train flags with it."""

from __future__ import annotations

import argparse

from psar.trainkit import cli_gen
from psar.trainkit.cli_strict import StrictParser
from psar.trainkit.config import TrainConfig

CONFIG_HELP = (
    "TOML file of settings, one [section] per part of the config tree as --help-all "
    "groups them: top-level keys, then [optimizer], [ps], [ddp], [local], [loss_scale] "
    "(e.g. steps = 200, then [optimizer] lr = 0.1); flags on the command line win"
)

EPILOG_TRAIN = """\
examples:
  # two shards and two workers by hand (four terminals):
  psar server --bind 127.0.0.1:50051
  psar server --bind 127.0.0.1:50052
  psar train --arch ps --servers 127.0.0.1:50051,127.0.0.1:50052 --rank 0 --world-size 2
  psar train --arch ps --servers 127.0.0.1:50051,127.0.0.1:50052 --rank 1 --world-size 2

  # the same job under DDP (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...):
  torchrun --nproc-per-node 2 $(which psar) train --arch allreduce
"""


def _train_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help=SUMMARIES["train"],
        usage="%(prog)s [-h] [--help-all] [--config FILE] [--dry-run] [FLAG ...]",
        description="Train a workload under a parameter server (--arch ps) or DDP (--arch "
        "allreduce).\nBelow: the everyday flags; --help-all lists every one. Any setting can "
        "also come\nfrom a TOML file given with --config.",
        epilog=EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate flags and environment, print the resolved config as JSON, start nothing",
    )
    cli_gen.add_flags(p, TrainConfig)
    return p


def _server_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # Here, not at the top: only the CLI knows both the shard and the worker, and a
    # worker (prepare(), psar launch) that parses train flags must not load the shard.
    from psar.ps.server.config import ServerConfig

    p = sub.add_parser(
        "server",
        help=SUMMARIES["server"],
        usage="%(prog)s [-h] [--help-all] [--config FILE] [--dry-run] [FLAG ...]",
        description="A parameter-server shard. It is model-agnostic: the worker of rank 0 "
        "tells it its tensors, optimizer, consistency mode and number of workers. Below: "
        "the everyday flags; --help-all lists every one.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of settings, keys as the flags' names with _ for - (e.g. "
        'bind = "0.0.0.0:50051"); flags on the command line win',
    )
    p.add_argument("--dry-run", action="store_true", help="validate flags, start nothing")
    cli_gen.add_flags(p, ServerConfig)
    return p


def train_parser() -> argparse.ArgumentParser:
    """`psar train`'s parser alone (prepare() and psar launch check train flags with it):
    parse the flags without the word `train`."""
    parser = StrictParser(prog="psar")
    return _train_parser(parser.add_subparsers(dest="command"))


SUMMARIES = {
    "server": "run one parameter-server shard",
    "train": "run one worker of a training job",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole `psar` parser; with `command` ("train" or "server") only that
    subcommand's flags are built (the other is a name), so `psar train` never loads the
    shard's config and `psar server` never the worker's; with "" neither (`psar --help`)."""
    parser = StrictParser(
        prog="psar",
        description="Train the same PyTorch model under a parameter server or ring-allreduce.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, build in (("server", _server_parser), ("train", _train_parser)):
        if command in (None, name):
            build(sub)
        else:  # a name only (`psar --help` lists it), which loads nothing
            sub.add_parser(name, help=SUMMARIES[name], add_help=False)
    sub.add_parser("plan", help="predict per-step communication and memory", add_help=False)
    sub.add_parser("report", help="plots and a markdown table from a --run-dir", add_help=False)
    sub.add_parser("launch", help="start shards and workers on this machine", add_help=False)
    sub.add_parser("compare", help="one workload under every architecture", add_help=False)
    return parser
