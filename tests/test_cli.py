"""The CLI: flags are generated from the config tree, validated, and frozen."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from psar.ps.server.config import ServerConfig
from psar.trainkit.cli_gen import accepted_flags, field_docs, flag_names
from psar.trainkit.config import DDPConfig, PSConfig, TrainConfig
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig
from psar.worker import cli

# Users' scripts depend on these names: add freely, never rename or remove.
TRAIN_FLAGS = [
    "--arch", "--workload", "--workload-option", "--steps", "--epochs", "--batch-size",
    "--grad-accum", "--seed", "--precision", "--wire-dtype", "--worker-weights", "--device",
    "--threads", "--save", "--report", "--run-dir", "--eval-batches", "--log-every",
    "--metrics-port", "--metrics-addr", "--slowdown", "--inject-overflow-step", "--optimizer",
    "--lr", "--momentum", "--nesterov", "--weight-decay", "--beta1", "--beta2", "--eps",
    "--schedule", "--warmup-steps", "--total-steps", "--min-lr-ratio", "--loss-scale-enabled",
    "--loss-scale-init-scale", "--loss-scale-growth-factor", "--loss-scale-backoff-factor",
    "--loss-scale-growth-interval", "--servers", "--rank", "--world-size", "--mode",
    "--staleness", "--chunk-mib", "--timeout-s", "--pull-timeout-s", "--job-id", "--buffers", "--overlap", "--bucket-mib", "--pull-overlap", "--early-pull", "--overlap-trial", "--overlap-host-busy", "--data-plane", "--backend",
    "--pg-timeout-s", "--bucket-cap-mb", "--find-unused-parameters",
    "--metrics-linger-s", "--emulate-compute-ms", "--reconnect-timeout-s", "--tls-ca",
    "--tls-cert", "--tls-key", "--tls-server-name", "--auth-token-file", "--sparse-optimizer",
    "--sparse-lr", "--sparse-eps", "--sparse-wire-dtype", "--checkpoint-dir", "--checkpoint-every",
    "--sync-every", "--outer-optimizer", "--outer-lr", "--outer-momentum",
    "--staleness-rule", "--staleness-lr", "--delay-compensation", "--momentum-correction",
    "--staleness-lr-power", "--dc-adaptive", "--sigterm-exit-code",
]  # fmt: skip
SERVER_FLAGS = ["--bind", "--threads", "--message-bytes", "--max-message-bytes",
                "--metrics-port", "--metrics-addr", "--shard", "--torch-threads", "--lease-s",
                "--join-grace-s", "--checkpoint-dir", "--checkpoint-every", "--checkpoint-interval",
                "--checkpoint-keep", "--restore", "--drain-timeout-s", "--tls-cert", "--tls-key",
                "--tls-ca", "--auth-token-file", "--data-port", "--chunk-rounds",
                "--restore-or-fresh", "--data-idle-s", "--data-max-conns-per-peer",
                "--data-tls-records", "--data-sealed-records"]  # fmt: skip


def test_flag_lists_are_frozen() -> None:
    missing = set(TRAIN_FLAGS) - set(accepted_flags(TrainConfig))
    assert not missing, f"train flags renamed or removed: {missing}"
    assert not set(SERVER_FLAGS) - set(accepted_flags(ServerConfig))


@pytest.mark.parametrize("cls", [TrainConfig, ServerConfig])
def test_every_flag_is_in_exactly_one_help_group(cls: type) -> None:
    placed = [f for flags in cls.HELP_GROUPS.values() for f in flags]
    assert len(placed) == len(set(placed)), "a flag in two help groups"
    assert set(placed) == set(flag_names(cls)), set(flag_names(cls)) ^ set(placed)


# Names both commands have, each with one meaning in both (issue #34: --threads had two).
SHARED_MEANINGS = {
    "--torch-threads": "torch's threads of this process",
    "--metrics-port": "this process's Prometheus endpoint",
    "--metrics-addr": "the address it binds",
    "--checkpoint-dir": "the folder this process writes its checkpoints to",
    "--checkpoint-every": "how often, in steps (rounds/versions on a shard)",
    "--tls-cert": "this process's own certificate",
    "--tls-key": "its private key",
    "--tls-ca": "the CA that signed the peers' certificates",
    "--auth-token-file": "the bearer token",
}


def test_a_flag_name_means_one_thing_in_every_command() -> None:
    shared = set(flag_names(TrainConfig)) & set(flag_names(ServerConfig))
    assert shared == set(SHARED_MEANINGS), shared ^ set(SHARED_MEANINGS)
    # The old --threads (train: torch's threads; server: gRPC handler threads) is an old
    # name only now, on both, and says so when used.
    assert "--threads" not in flag_names(TrainConfig) + flag_names(ServerConfig)


def test_old_flag_names_still_work_and_say_the_new_one(capsys) -> None:  # noqa: ANN001
    from psar.worker.cli_parser import build_parser

    ns = build_parser().parse_args(["train", "--threads", "3"])
    assert vars(ns)["threads"] == 3
    assert "--threads is now --torch-threads" in capsys.readouterr().err
    ns = build_parser().parse_args(["server", "--threads", "9"])
    assert vars(ns)["threads"] == 9
    assert "--threads is now --rpc-threads" in capsys.readouterr().err
    build_parser().parse_args(["server", "--rpc-threads", "9", "--torch-threads", "2"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "cls", [TrainConfig, PSConfig, DDPConfig, OptimizerConfig, LossScaleConfig, ServerConfig]
)
def test_every_config_field_has_a_docstring(cls: type) -> None:
    import dataclasses

    docs = field_docs(cls)
    assert {f.name for f in dataclasses.fields(cls)} <= set(docs)


def _dry(capsys, *argv: str) -> dict:
    assert cli.main(["train", "--dry-run", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_dry_run_resolves_flags_and_config_file(tmp_path, capsys) -> None:
    cfg_file = tmp_path / "job.toml"
    cfg_file.write_text('steps = 7\nworkload = "lm"\n[optimizer]\nname = "adamw"\nlr = 0.001\n'
                        '[ps]\nmode = "ssp"\nstaleness = 3\nservers = "h:1,h:2"\n')  # fmt: skip
    out = _dry(capsys, "--config", str(cfg_file), "--lr", "0.01", "--workload-option", "seq_len=32")
    assert out["steps"] == 7 and out["workload"] == "lm"
    assert out["optimizer"] == {**out["optimizer"], "name": "adamw", "lr": 0.01}  # flag wins
    assert out["ps"]["mode"] == "ssp" and out["ps"]["staleness"] == 3
    assert out["workload_option"] == ["seq_len=32"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--arch", "horovod"], "--arch: unknown 'horovod'; accepted: ps, allreduce"),
        (["--mode", "eventual"], "--mode: unknown 'eventual'; accepted: sync, async, ssp, local"),
        (["--data-plane", "udp"], "--data-plane: unknown 'udp'; accepted: auto, tcp, grpc"),
        (["--bucket-mib", "0"], "--bucket-mib must be > 0"),
        (["--overlap-trial", "-1"], "--overlap-trial must be >= 0"),
        (["--overlap-host-busy", "1.5"], "--overlap-host-busy must be a fraction in [0, 1]"),
        (["--optimizer", "lamb"], "--optimizer: unknown 'lamb'; accepted: sgd, adamw"),
        (["--precision", "fp8"], "--precision: unknown 'fp8'"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--slowdown", "0.5"], "--slowdown must be >= 1"),
        (["--servers", "nohost"], "--servers: 'nohost' is not HOST:PORT"),
        (["--servers", ""], "--servers: give the shards"),
        (
            ["--rank", "3", "--world-size", "2", "--servers", "h:1"],
            "--rank 3 must be in [0, --world-size 2)",
        ),
    ],
)
def test_bad_flags_name_the_flag_and_accepted_values(capsys, monkeypatch, argv, needle) -> None:
    monkeypatch.delenv("PSAR_SERVERS", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--dry-run", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_bad_server_bind(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["server", "--dry-run", "--bind", "nowhere"])
    assert "--bind: expected HOST:PORT" in capsys.readouterr().err


def test_unknown_config_key_is_refused(tmp_path, capsys) -> None:
    f = tmp_path / "c.toml"
    f.write_text("stpes = 3\n")
    with pytest.raises(SystemExit):
        cli.main(["train", "--dry-run", "--config", str(f), "--servers", "h:1"])
    assert "unknown key stpes; did you mean steps?" in capsys.readouterr().err


def test_console_script_help_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psar.worker.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    for sub in ("server", "train", "plan", "report"):
        assert sub in out.stdout


@pytest.mark.parametrize(("extra", "code"), [([], 143), (["--sigterm-exit-code", "1"], 1)])
def test_sigterm_stops_a_worker_with_its_exit_code(extra, code) -> None:
    # No shard listens on this port, so the worker keeps retrying; SIGTERM must end it
    # promptly (not after its retry budget) with 143, or --sigterm-exit-code (Slurm).
    import queue
    import signal
    import threading

    from tests.procs import ENV, free_port

    p = subprocess.Popen(
        [sys.executable, "-m", "psar.worker.cli", "train", "--arch", "ps",
         "--servers", f"127.0.0.1:{free_port()}", "--steps", "1", "--timeout-s", "600", *extra],
        stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stderr], daemon=True).start()
    seen = ""
    try:
        while "setting up" not in seen:  # it logs this line, then connects to the shards
            seen += lines.get(timeout=120)
    finally:
        p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    time.sleep(0.2)  # let the reader thread drain the pipe
    while not lines.empty():
        seen += lines.get()
    assert p.returncode == code, seen
    assert "terminated (SIGTERM)" in seen


def test_sigterm_exit_code_is_checked(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--dry-run", "--servers", "h:1", "--sigterm-exit-code", "256"])
    assert e.value.code == 2
    assert "--sigterm-exit-code must be in [0, 255], got 256" in capsys.readouterr().err


def test_dry_run_resolves_the_workload(capsys) -> None:
    assert (
        _dry(capsys, "--servers", "h:1")["resolved"]["workload"] == "psar.worker.workloads.mlp:make"
    )
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--dry-run", "--servers", "h:1", "--workload", "bogus"])
    assert e.value.code == 2  # as a start would: the Slurm scripts check a job this way
    assert "unknown workload 'bogus'" in capsys.readouterr().err


def test_a_shard_on_a_port_in_use_says_so_and_exits_1() -> None:
    """Even when the port's holder is a gRPC server with SO_REUSEPORT (gRPC's default),
    which a shard with gRPC's defaults would silently share the port with."""
    from concurrent import futures

    import grpc

    from tests.procs import ENV

    holder = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "psar.worker.cli", "server", "--bind", f"127.0.0.1:{port}",
             "--shard", "3", "--data-port", "-1"],
            capture_output=True, text=True, env=ENV, timeout=120,
        )  # fmt: skip
    finally:
        holder.stop(0)
    assert p.returncode == 1, p.stderr
    err = f"psar server: error: shard 3: could not bind 127.0.0.1:{port}; is the port in use?"
    assert err in p.stderr
    assert "Traceback" not in p.stderr
