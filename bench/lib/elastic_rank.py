"""One allreduce rank under torchrun's elastic agent, for bench/elastic.py:

    torchrun ... bench/lib/elastic_rank.py PROCS_DIR -- PSAR_TRAIN_FLAGS...

torchrun starts a new process for every rank of every rendezvous round, with its rank,
world size and the round's master port in its environment. This process writes them to
PROCS_DIR/p<pid>/meta.json and becomes `psar train --arch allreduce` logging there, so
every round's steps stay apart (psar train writes its step log afresh at start) and the
bench can count what each round trained (bench/lib/elastic_count.py), from the checkpoint
it resumed from (the newest in --checkpoint-dir as it starts: the agents stop a round's
processes before the next round starts).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path


def newest_checkpoint(flags: list[str]) -> int:
    """The step of the newest checkpoint in --checkpoint-dir (0: none): the one this
    round resumes from (allreduce/backend.py list_checkpoints' names, read without
    importing torch: a restart should not pay for it twice)."""
    folder = (
        Path(flags[flags.index("--checkpoint-dir") + 1]) if "--checkpoint-dir" in flags else None
    )
    if folder is None or not folder.is_dir():
        return 0
    steps = [
        int(m.group(1)) for p in folder.iterdir() if (m := re.match(r"^ddp-(\d{12})\.pt$", p.name))
    ]
    return max(steps, default=0)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        sys.exit("usage: elastic_rank.py PROCS_DIR -- PSAR_TRAIN_FLAGS...")
    folder = Path(argv[0]) / f"p{os.getpid()}"
    folder.mkdir(parents=True)
    env = os.environ
    meta = {
        "rank": int(env["RANK"]),
        "world": int(env["WORLD_SIZE"]),
        # The processes of one rendezvous round share its master address and port.
        "round": f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}",
        "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "start_wall": time.time(),
        # In the steps of the world that wrote it (a round that rebases saves its own).
        "resume_step": newest_checkpoint(argv[2:]),
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    train = ["-m", "psar.worker.cli", "train", "--arch", "allreduce", "--run-dir", str(folder),
             "--report", str(folder / "report-{rank}.json"), *argv[2:]]  # fmt: skip
    os.execv(sys.executable, [sys.executable, *train])


if __name__ == "__main__":
    main(sys.argv[1:])
