"""A CLI a person can read (issue #44 item 5): short default --help and --help-all for the
rest, settings from a sectioned TOML file, no prefix matches, typos answered with the
command's usage and the closest spellings, defaults stated once and the same across
train/launch/compare, and no torch for any --help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import pytest

from psar.ps.server.config import ServerConfig
from psar.trainkit import cli_gen
from psar.trainkit.cli_gen import EVERYDAY, flag_names
from psar.trainkit.config import PSConfig, TrainConfig
from psar.worker import cli, cli_parser, compare, launch, plan, report

COMMANDS = ("train", "server", "launch", "compare", "plan", "report")


def _help(capsys, *argv: str) -> str:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == 0
    return capsys.readouterr().out


def _everyday(cls: type) -> set[str]:
    return {
        flag for _, flag, _, f, _ in cli_gen._walk(cls) if f.metadata.get(EVERYDAY)
    }  # fmt: skip


@pytest.mark.parametrize(("command", "cls"), [("train", TrainConfig), ("server", ServerConfig)])
def test_default_help_is_short_and_shows_the_everyday_flags_only(capsys, command, cls) -> None:  # noqa: ANN001
    out = _help(capsys, command, "--help")
    assert len(out.splitlines()) <= 120, len(out.splitlines())
    usage = out.split("\n\n", 1)[0]
    assert len(usage.splitlines()) <= 2, usage
    shown = set(re.findall(r"^\s+(--[a-z0-9-]+)", out, re.MULTILINE))
    everyday = _everyday(cls)
    assert 8 <= len(everyday) < len(flag_names(cls)) / 2
    assert shown - {"--help", "--help-all", "--config", "--dry-run"} == everyday
    assert "--help-all" in out


@pytest.mark.parametrize(("command", "cls"), [("train", TrainConfig), ("server", ServerConfig)])
def test_help_all_lists_every_flag_of_the_tree(capsys, command, cls) -> None:  # noqa: ANN001
    out = _help(capsys, command, "--help-all")
    shown = set(re.findall(r"^\s+(--[a-z0-9-]+)", out, re.MULTILINE))
    assert set(flag_names(cls)) <= shown, set(flag_names(cls)) - shown
    assert len(out.splitlines()) > 150  # the long view really is the long one


def test_the_everyday_mark_lives_on_the_field() -> None:
    # No list to drift: the mark is the field's metadata, so the optimizer's lr (a field of
    # a nested section) carries it where it is declared.
    lr = {f.name: f for f in dataclasses.fields(TrainConfig().optimizer)}["lr"]
    assert lr.metadata.get(EVERYDAY) is True
    assert {"--lr", "--steps", "--arch", "--mode", "--servers"} <= _everyday(TrainConfig)


def _parser(command: str) -> argparse.ArgumentParser:
    if command in ("train", "server"):
        top = cli_parser.build_parser(command)
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[command]
    return {"launch": launch, "compare": compare, "plan": plan, "report": report}[
        command
    ].build_parser()


@pytest.mark.parametrize("command", COMMANDS)
def test_no_parser_takes_a_flag_by_its_prefix(command: str) -> None:
    assert _parser(command).allow_abbrev is False
    assert cli_parser.build_parser().allow_abbrev is False


# A prefix of a real flag (argparse's allow_abbrev would take it) and a transposition, per
# command, with the spelling the answer must offer.
TYPOS = {
    "train": (["--step", "3"], "--steps"),
    "server": (["--bnd", "h:1"], "--bind"),
    "launch": (["--worker", "3"], "--workers"),
    "compare": (["--repeat", "2"], "--repeats"),
    "plan": (["--params", "1M", "--workers", "2", "--bandwidht", "1Gbit/s"], "--bandwidth"),
    "report": (["somewhere", "--no-plot"], "--no-plots"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_mistyped_flag_gets_its_commands_usage_and_the_closest_spelling(
    capsys, command: str
) -> None:  # noqa: ANN001
    argv, near = TYPOS[command]
    with pytest.raises(SystemExit) as e:
        cli.main([command, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: psar {command} "), err
    assert f"did you mean {near}" in err, err


def test_launch_and_compare_pass_train_flags_on_but_refuse_typos(capsys) -> None:  # noqa: ANN001
    spec = launch.parse(["--workers", "2", "--lr", "0.1", "--optimizer-impl", "loop"])
    assert spec.train_args == ["--lr", "0.1", "--optimizer-impl", "loop"]
    with pytest.raises(SystemExit) as e:
        launch.parse(["--workers", "2", "--optimiser", "adamw"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: psar launch") and "did you mean --optimizer" in err


def _dry(capsys, *argv: str) -> dict:  # noqa: ANN001
    assert cli.main(["train", "--dry-run", "--servers", "h:1", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_toml_sections_follow_the_config_tree(tmp_path, capsys) -> None:  # noqa: ANN001
    f = tmp_path / "run.toml"
    f.write_text(
        'steps = 9\nworkload = "recsys"\n[optimizer]\nlr = 1\nimpl = "loop"\n'
        '[ps]\nmode = "ssp"\nstaleness = 4\noverlap = false\n[ddp]\nbucket_cap_mb = 5.0\n'
        "[local]\nouter_momentum = 0.5\n[loss_scale]\ngrowth_interval = 7\n"
    )
    out = _dry(capsys, "--config", str(f), "--staleness", "2")
    assert (out["steps"], out["workload"]) == (9, "recsys")
    assert out["optimizer"]["lr"] == 1.0 and isinstance(out["optimizer"]["lr"], float)
    assert out["optimizer"]["impl"] == "loop"
    assert (out["ps"]["mode"], out["ps"]["staleness"], out["ps"]["overlap"]) == ("ssp", 2, False)
    assert out["ddp"]["bucket_cap_mb"] == 5.0 and out["local"]["outer_momentum"] == 0.5
    assert out["loss_scale"]["growth_interval"] == 7


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("lr = 0.1\n", "unknown key lr; did you mean [optimizer] lr?"),
        ("batch-size = 3\n", "unknown key batch-size; did you mean batch_size?"),
        ("[optimizer]\nlrr = 0.1\n", "unknown key [optimizer] lrr; did you mean [optimizer] lr?"),
        ("[optimiser]\nlr = 0.1\n", "unknown key optimiser; did you mean [optimizer]"),
        ("[ps]\nstalenes = 2\n", "did you mean [ps] staleness?"),
        ("steps = 'ten'\n", "steps: expected an integer, got 'ten'"),
        ("[optimizer]\nlr = true\n", "[optimizer] lr: expected a number, got True"),
        ("ps = 3\n", "ps is a section: write it as [ps]"),
        ("steps = \n", "not valid TOML"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_key(tmp_path, capsys, text, needle) -> None:  # noqa: ANN001
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--dry-run", "--servers", "h:1", "--config", str(f)])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_server_reads_a_config_file_too(tmp_path, capsys) -> None:  # noqa: ANN001
    f = tmp_path / "shard.toml"
    f.write_text('bind = "127.0.0.1:0"\ncheckpoint_keep = 5\n')
    assert cli.main(["server", "--dry-run", "--config", str(f)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["bind"], out["checkpoint_keep"]) == ("127.0.0.1:0", 5)
    f.write_text("bnd = 1\n")
    with pytest.raises(SystemExit):
        cli.main(["server", "--dry-run", "--config", str(f)])
    assert "unknown key bnd; did you mean bind?" in capsys.readouterr().err


_STATED = re.compile(r"\(default\b|\bdefault \(|\(the default\b", re.IGNORECASE)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_default_is_stated_at_most_once(command: str) -> None:
    parser = _parser(command)
    for action in parser._actions:
        text = getattr(action, "full_help", action.help) or ""
        text = re.sub(r"%\(\w+\)s", "X", text)  # argparse's %(default)s, filled in at print
        assert len(_STATED.findall(text)) <= 1, (action.option_strings, text)


def test_a_default_the_docstring_explains_is_not_contradicted(capsys) -> None:  # noqa: ANN001
    out = " ".join(_help(capsys, "train", "--help-all").split())
    assert "(default: env RANK, else 0)." in out and "(default: -1)" not in out
    assert "(default: env WORLD_SIZE, else 1)." in out and "else 1). (default: 0)" not in out


def test_workload_help_lists_every_builtin(capsys) -> None:  # noqa: ANN001
    from psar.worker.workloads import BUILTINS

    train = " ".join(_help(capsys, "train", "--help").split())
    workload = next(a.help for a in _parser("compare")._actions if "--workload" in a.option_strings)
    for name in BUILTINS:
        assert re.search(rf"--workload WORKLOAD .*\b{name}\b", train), name
        assert name in workload, name


# compare's own run: longer and in fp32 (ps-sync and allreduce then end at the same bits),
# a bigger batch, H for its *-local rows; --servers of launch/compare counts shards to
# start where train's lists their addresses. Any other shared flag has train's default.
DIFFERENT_ON_PURPOSE = {
    "launch": {"--servers"},
    "compare": {"--servers", "--steps", "--precision", "--batch-size", "--sync-every"},
}


def _train_defaults() -> dict[str, object]:
    cfg = TrainConfig()
    out = {}
    for path, flag, *_ in cli_gen._walk(TrainConfig):
        node = cfg
        for name in path:
            node = getattr(node, name)
        out[flag] = node
    return out


@pytest.mark.parametrize("command", ["launch", "compare"])
def test_launch_and_compare_share_trains_defaults(command: str) -> None:
    train = _train_defaults()
    shared = [a for a in _parser(command)._actions if a.option_strings[0] in train]
    names = {a.option_strings[0] for a in shared}
    assert "--staleness" in names and "--workload" in train
    differ = {a.option_strings[0] for a in shared if a.default != train[a.option_strings[0]]}
    assert differ == DIFFERENT_ON_PURPOSE[command]
    assert {a.option_strings[0]: a.default for a in shared}["--staleness"] == PSConfig.staleness


def test_no_help_loads_torch() -> None:
    # One fresh interpreter runs every --help in turn; torch must never appear in
    # sys.modules. The last line proves the check can see torch where it is loaded.
    code = (
        "import sys, contextlib, io\n"
        "from psar.worker.cli import main\n"
        f"for argv in [['--help'], *[[c, '--help'] for c in {COMMANDS!r}],"
        " ['train', '--help-all'], ['server', '--help-all']]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    print(' '.join(argv), 'torch' in sys.modules)\n"
        "import psar.trainkit.optim\n"
        "print('control', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[-1] == "control True", out.stdout
    assert all(line.endswith(" False") for line in lines[:-1]), out.stdout
    assert len(lines) == 10


def test_python_m_psar_help_loads_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "psar", "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "train" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "psar.worker.cli" in imported  # the console script's module itself answered
    assert "torch" not in imported


def test_server_defaults_written_out_match_their_sources() -> None:
    from psar.ps import wire
    from psar.ps.server.durability import checkpoints

    assert ServerConfig.message_bytes == wire.DEFAULT_MESSAGE_BYTES
    assert ServerConfig.checkpoint_keep == checkpoints.DEFAULT_KEEP
