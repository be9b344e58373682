"""The `psar` argument parser: subcommands, and the train and server flags generated from
their config dataclasses (trainkit/cli_gen.py). `psar launch` validates train flags with it."""

from __future__ import annotations

import argparse

from psar.trainkit import cli_gen
from psar.trainkit.config import TrainConfig

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
        help="run one worker of a training job",
        description="Train a workload under a parameter server (--arch ps) or DDP "
        "(--arch allreduce). Every flag can also be set in a TOML file given with "
        "--config; flags on the command line win.",
        epilog=EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with the same keys as the flags")
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
        help="run one parameter-server shard",
        description="A parameter-server shard. It is model-agnostic: the worker of rank 0 "
        "tells it its tensors, optimizer, consistency mode and number of workers.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with the same keys as the flags")
    p.add_argument("--dry-run", action="store_true", help="validate flags, start nothing")
    cli_gen.add_flags(p, ServerConfig)
    return p


def train_parser() -> argparse.ArgumentParser:
    """`psar train`'s parser alone (prepare() and psar launch check train flags with it):
    parse the flags without the word `train`."""
    parser = argparse.ArgumentParser(prog="psar", allow_abbrev=False)
    return _train_parser(parser.add_subparsers(dest="command"))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole `psar` parser; with `command` ("train" or "server") only that
    subcommand's flags are built (the other is a name), so `psar train` never loads the
    shard's config and `psar server` never the worker's."""
    parser = argparse.ArgumentParser(
        prog="psar",
        description="Train the same PyTorch model under a parameter server or ring-allreduce.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, build in (("server", _server_parser), ("train", _train_parser)):
        if command in (None, name):
            build(sub)
        else:
            sub.add_parser(name, add_help=False)
    sub.add_parser("plan", help="predict per-step communication and memory", add_help=False)
    sub.add_parser("report", help="plots and a markdown table from a --run-dir", add_help=False)
    sub.add_parser("launch", help="start shards and workers on this machine", add_help=False)
    sub.add_parser("compare", help="one workload under every architecture", add_help=False)
    return parser
