"""The command line as a user meets it: output, JSON, files, and one-line errors with exit code 2."""

import argparse
import csv
import json
import os
import re
import subprocess
import sys

import pytest


def run(*args, cwd=None, env=None):
    e = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hybridpar", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=e,
        timeout=120,
    )


def test_plan_table_and_json():
    r = run(
        "plan", "--model", "alexnet", "--procs", "512", "--batch", "2048", "--cluster", "cori-knl"
    )
    assert r.returncode == 0, r.stderr
    assert "fc-grid" in r.stdout and "best:" in r.stdout
    j = run(
        "plan",
        "--model",
        "alexnet",
        "--procs",
        "64",
        "--batch",
        "256",
        "--json",
        "--scenario",
        "fc-grid",
    )
    d = json.loads(j.stdout)
    assert [s["name"] for s in d["scenarios"]] == ["fc-grid"] and d["best"]["name"] == "fc-grid"
    assert d["speedup_vs_batch"]["comm"] > 1


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "--model", "nope", "--procs", "4", "--batch", "8"], "unknown model"),
        (
            ["plan", "--model", "alexnet", "--procs", "4", "--batch", "8", "--cluster", "mars"],
            "unknown cluster",
        ),
        (["plan", "--model", "digits-cnn", "--procs", "1024", "--batch", "1"], "no plan fits"),
        (
            ["plan", "--model", "alexnet", "--procs", "8", "--batch", "4", "--scenario", "batch"],
            "needs at least Pc=8 examples (one per batch group), got B=4",
        ),
        (["plan", "--model", "alexnet", "--procs", "0", "--batch", "8"], "at least 1"),
        (["plan", "--model", "alexnet", "--procs", "4"], "required"),
        (["simulate", "--model", "alexnet", "--procs", "8,x", "--batch", "8"], "comma-separated"),
    ],
)
def test_bad_input_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_malformed_cluster_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("alpha = [\n")
    r = run("plan", "--model", "alexnet", "--procs", "4", "--batch", "8", "--cluster", str(f))
    assert r.returncode == 2 and "malformed" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_simulate_writes_csv_and_figures(tmp_path):
    r = run(
        "simulate",
        "--model",
        "alexnet",
        "--batch",
        "512",
        "--procs",
        "8,64,1024",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "simulate.csv").open()))
    assert {row["scenario"] for row in rows} == {
        "batch",
        "model",
        "same-grid",
        "fc-grid",
        "domain",
        "per-layer",
    }
    assert sum(row["best_overall"] == "True" for row in rows) == 3  # one per P
    for png in ("fig6_same_grid.png", "fig7_fc_grid.png", "fig10_domain.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_then_plan_on_any_cluster_with_measured_compute(tmp_path):
    """`hybridpar profile` writes the profile `localhost` plans with (every batch a rank of the
    job runs, its ranks sharing this machine's cores), and `plan --compute` prices a plan on any
    cluster with it; a per-sample table of an older release is refused in one line."""
    table = tmp_path / "digits.json"
    r = run(
        *("profile", "--model", "digits-cnn", "--procs", "4", "--batch", "64"),
        *("--repeats", "2", "--out", str(table)),
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(table.read_text())
    assert sorted(map(int, data["per_count"])) == [16, 32, 64]  # B / Pc for Pc = 4, 2, 1
    assert data["procs"] == 4 and data["update_s"] > 0
    plan = ["plan", "--model", "digits-cnn", "--procs", "4", "--batch", "64", "--compute"]
    p = run(*plan, str(table), "--scenario", "batch", "--cluster", "fdr-infiniband", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    threads = max(1, data["cores"] // 4)
    slowdown = max(1.0, 4 * threads / data["cores"])  # 4 ranks sharing the profiled cores
    leaves = sum(f + b for f, b in data["per_count"]["16"].values())
    update = sum(x["params"] for x in d["best"]["layers"]) * data["update_s"]
    assert d["best"]["compute_s"] == pytest.approx(slowdown * (leaves + update), rel=1e-9)
    bad = run(*plan, str(tmp_path / "none.json"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model": "digits-cnn", "per_sample_s": {"0": [1e-5, 2e-5]}}))
    bad = run(*plan, str(old))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "per_sample_s" in bad.stderr and "hybridpar profile" in bad.stderr, bad.stderr


def test_plan_with_a_codec_predicts_a_quarter_of_the_bytes():
    base = ["plan", "--model", "alexnet", "--procs", "64", "--batch", "256", "--json"]
    fp32 = json.loads(run(*base).stdout)
    eight = json.loads(run(*base, "--codec", "dynamic-tree", "--compress", "grads").stdout)
    assert eight["codec"] == "dynamic-tree" and eight["compress"] == ["grads"]
    batch = {s["name"]: s for s in fp32["scenarios"]}["batch"]
    batch8 = {s["name"]: s for s in eight["scenarios"]}["batch"]
    dw = sum(x["bytes"]["dw_allreduce"] for x in batch["layers"])
    dw8 = sum(x["bytes"]["dw_allreduce"] for x in batch8["layers"])
    assert dw8 == pytest.approx(dw / 4)
    r = run("plan", "--model", "alexnet", "--procs", "8", "--batch", "64", "--codec", "int3")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_codecs_command_prints_table_2():
    r = run("codecs", "--no-speed", "--size", "20000", "--mlp-steps", "2")
    assert r.returncode == 0, r.stderr
    for needle in (
        "normal(0, 0.01)",
        "mlp grads L3",
        "mlp acts L1",
        "rel % tensor",
        "rel % 4096",
    ):
        assert needle in r.stdout
    # the worked examples, each next to the paper's printed value and whether ours equals it
    assert re.search(r"mantissa +0\.234568 +-> ours 0\.2 +paper 0\.2 +equal", r.stdout), r.stdout
    assert re.search(
        r"dynamic-tree +0\.234568 +-> ours 0\.2367\d+ +paper 0\.236719 +equal", r.stdout
    )
    assert re.search(
        r"static-tree +0\.234568 +-> ours 0\.2531\d+ +paper 0\.23125 +differs", r.stdout
    )
    assert run("codecs", "--block", "0").returncode == 2


def test_every_command_prints_its_help(capsys):
    """`hybridpar CMD --help` for every command: argparse %-formats help texts, and one option's
    help with a bare "%" ("75 %") made `hybridpar train --help` raise instead of printing."""
    from hybridpar.commands.cli import build_parser, main

    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"plan", "train"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0, name
        assert "usage: hybridpar " + name in capsys.readouterr().out


def test_a_bare_hybridpar_lists_the_commands_and_version_answers(capsys):
    from hybridpar import __version__
    from hybridpar.commands.cli import main

    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("plan", "train", "validate", "calibrate"))
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hybridpar {__version__}"


def test_every_command_takes_both_spellings_of_the_rank_count(capsys):
    """plan, simulate and validate named it --procs, train and calibrate --nproc: each takes both."""
    from hybridpar.commands.cli import build_parser

    parser = build_parser()
    model = ["--model", "alexnet", "--batch", "8"]
    for spelling in ("--procs", "--nproc"):
        assert parser.parse_args(["plan", *model, spelling, "4"]).procs == 4
        assert parser.parse_args(["simulate", *model, spelling, "4,8"]).procs == [4, 8]
        assert parser.parse_args(["validate", *model, spelling, "4"]).procs == 4
        assert parser.parse_args(["train", spelling, "3"]).nproc == 3
        assert parser.parse_args(["calibrate", spelling, "2,4"]).nproc == [2, 4]
    with pytest.raises(SystemExit):
        parser.parse_args(["validate", "--help"])
    assert "(default: localhost)" in capsys.readouterr().out  # where validate runs


def test_every_option_has_help_and_no_internal_name():
    """Issue 43: `train --help` showed RUNTIME.SEED and CHOICES.COMPRESS as metavars, and options
    of plan, simulate, profile and codecs had no help at all."""
    from hybridpar.commands.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        text = parser.format_help()
        assert "RUNTIME." not in text and "CHOICES." not in text, name
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
            if isinstance(action, argparse._StoreFalseAction):
                # a switch that turns off a default says so, not what the default does
                assert action.help.startswith("turn off"), (name, action.help)


def test_train_help_is_grouped_by_concern():
    """Issue 43 item 7: `train --help` was one flat list of 47 options (and the nested configs'
    under their class names); now every option sits under one of eight concerns, in order, and
    an option added without one fails the parser's construction."""
    import argparse

    from hybridpar.commands.cli import TRAIN_CONCERNS, build_parser
    from hybridpar.core.config import add_arguments
    from hybridpar.runtime.train.config import TrainConfig

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    titles = [g.title for g in train._action_groups if g._group_actions]
    concerns = ["model and data", "optimisation", "plan", "communication", "batch norm"]
    assert titles == ["options", *concerns, "compute", "checkpoints", "runtime"]
    (helps,) = [g for g in train._action_groups if g.title == "options"]
    # nothing left unsorted but the command-wide options
    assert [a.dest for a in helps._group_actions] == ["help", "config", "print_config"]
    text = train.format_help()
    assert (
        text.index("\nbatch norm:") < text.index("\n  --bn-window") < text.index("\ncheckpoints:")
    )
    fewer = {t: tuple(d for d in ds if d != "runtime.seed") for t, ds in TRAIN_CONCERNS.items()}
    with pytest.raises(TypeError, match=r"runtime\.seed has no concern"):
        add_arguments(argparse.ArgumentParser(), TrainConfig, concerns=fewer)


def test_the_closing_table_says_where_the_host_reducers_bytes_went(capsys):
    """Issue 43: with --reducer host the closing table showed 0 bytes measured and predicted while
    the plan's table had predicted 12595 KB (the sums' volume, through shared memory)."""
    from hybridpar.commands.training import _print_report

    sums = {"layer": "6", "term": "dw_allreduce", "bytes": 12595200.0, "seconds": 0.0}
    report = {
        "model": "digits-wide",
        "data": "digits",
        "procs": 4,
        "preset": "grid:1x4",
        "plan_file": None,
        "plan": {"scenario": "fc-grid", "predicted": [sums]},
        "final": {"test_acc": 0.5},
        "iteration": {"steps": 3, "time_s": 0.1, "compute_s": 0.09, "comm_wait_s": 0.01},
        "bytes": {"measured": {"dw_allreduce": 0.0}, "predicted": {"dw_allreduce": 0.0}},
        "reducer": "host",
    }
    _print_report(report)
    out = capsys.readouterr().out
    assert "dw_allreduce's 12595 KB a rank in host shared memory" in out, out


# --- a config file (issue 41 item 1) -------------------------------------------------------------


@pytest.mark.parametrize(
    "command, flags",
    [
        ("train", ["--lr", "0.1", "--codec", "linear", "--compress", "grads", "--no-progress"]),
        ("plan", ["--model", "resnet20", "--procs", "8", "--batch", "64", "--bn", "local"]),
        ("validate", ["--model", "digits-wide", "--batch", "16", "--procs", "2", "--top", "1"]),
    ],
)
def test_print_config_is_a_file_that_config_reads_back_unchanged(tmp_path, capsys, command, flags):
    from hybridpar.commands.cli import _in_effect, _parse, build_parser, main
    from hybridpar.core.config import from_namespace
    from hybridpar.planning.config import PlanConfig
    from hybridpar.runtime.train.config import TrainConfig

    assert main([command, *flags, "--print-config"]) == 0
    text = capsys.readouterr().out
    if command == "train":  # every option in effect: what the run takes when none is given too
        assert {'model = "digits-wide"', "nproc = 4", "batch = 64"} <= set(text.splitlines())
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main([command, "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == text
    # the file gives the configuration the flags run with (train's model, nproc and batch
    # written out), and a flag overrides the file
    cls = TrainConfig if command == "train" else PlanConfig
    by_flags = _in_effect(build_parser().parse_args([command, *flags]))
    by_file = _parse(build_parser(), [command, "--config", str(path)])
    assert from_namespace(cls, by_file) == from_namespace(cls, by_flags)
    over = _parse(build_parser(), [command, "--config", str(path), "--codec", "fp16"])
    assert from_namespace(cls, over).choices.codec == "fp16"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[runtime]\nsed = 3\n", "unknown key 'runtime.sed'"),
        ("codec = 'fp16'\n", "unknown key 'codec'; did you mean 'choices.codec'?"),
        ("lr = 'fast'\n", "lr: 'fast' is not a number"),
        ("epochs = 2.5\n", "epochs: '2.5' is not an integer"),
        ("[choices]\ncodec = 'zip'\n", "choices.codec must be one of none"),
        ("quiet = 1\n", "quiet must be true or false"),
        ("lr =\n", "not TOML"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, capsys, text, needle):
    from hybridpar.commands.cli import main

    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert main(["plan", "--config", str(tmp_path / "none.toml")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_calibrate_check_is_refused_under_torchrun_in_one_line(capsys, monkeypatch):
    from hybridpar.commands.cli import main

    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["calibrate", "--check"]) == 2
    err = capsys.readouterr().err
    assert "without torchrun" in err and len(err.strip().splitlines()) == 1, err
