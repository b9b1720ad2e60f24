"""Issues 43 and 64: every `hybridpar` example of the README, as written, through the real command
line in a sandbox, so that the README cannot drift from the program.

- `plan` and `simulate` examples run (on a `localhost` calibration written here, the compute
  priced by FLOPs: no profile is measured);
- `train` examples train, shortened to one step of one epoch (and `--compile` on torch.compile's
  aot_eager backend: inductor's code generation is test_compute's), on real ranks, and each exits
  0; what each example's comment promises is asserted on the job its parent built (a searched
  preset's plan is made as rank 0 would make it);
- the GPU examples must be refused in one line on a machine without a GPU;
- `codecs`, `calibrate`, `profile` and `validate` are parsed (they run for minutes; their own
  tests run them).
`mynets.py` is the README's own."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), flags=re.S)


def examples() -> list[tuple[str, str]]:
    """(command, comment) of every line of a code block that runs `hybridpar`, a line ending in a
    backslash joined to the next, a comment on the line below kept with it."""
    out: list[tuple[str, str]] = []
    for block in _blocks():
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if line.startswith("hybridpar ") and not line.split()[1].endswith(":"):  # not output
                command, _, comment = line.partition("  #")
                out.append((command.strip(), comment.strip()))
            elif out and line.strip().startswith("#") and line.startswith(" "):
                out[-1] = (out[-1][0], (out[-1][1] + " " + line.strip(" #")).strip())
    return out


def _mynets() -> str:
    return next(b for b in _blocks() if "def small_cnn" in b)


def _promise(command: str, job, plan) -> None:
    """What the example's comment says, on the job the parent built."""
    cfg, styles = job.cfg, {s.label for s in plan.styles.values()}
    if command == "hybridpar train":  # digits-wide on digits, 4 ranks, the planner's plan
        assert (job.model, cfg.data, job.procs, cfg.preset) == ("digits-wide", "digits", 4, "auto")
    if "--plan p.json" in command:
        assert plan.scenario == "per-layer" and cfg.data == "synthetic:256"
    if "grid:2x2 --epochs" in command:  # conv batch, FC on a 2 x 2 grid
        assert "model(2x2)" in styles and any(s.kind == "batch" for s in plan.styles.values())
    if "--preset domain" in command:  # images split by height
        assert any(s.kind == "domain" for s in plan.styles.values()), styles
    if "--shard-states" in command:  # 1/4 of the weights, gradients and momentum (FSDP2)
        assert plan.choices.shard_states and {(s.pr, s.pc) for s in plan.styles.values()
                                              if s.kind == "domain"} == {(4, 1)}, styles  # fmt: skip
    elif "--model unet --data digits-seg:128" in command:  # a U-Net on bands end to end
        assert {s.kind for s in plan.styles.values()} == {"domain"}, styles
    if "--memory-limit 0.03" in command:  # the fastest plan whose bytes per rank fit
        assert 0 < plan.memory_bytes <= 0.03 * 2**30
    if "--preset ddp" in command:
        assert plan.engine == "ddp"
    if "mynets:small_cnn --preset model" in command:
        assert styles == {"model(4x1)"}
    if "per-layer" in command and "resnet20" in command:
        assert cfg.choices.bn == "global" and plan.scenario == "per-layer"
    if "--checkpoint-every 50" in command:
        assert cfg.checkpoint_dir == "ck" and cfg.checkpoint_every == 50
    if "--resume auto" in command:  # onto 3 ranks: the 4 ranks' batch of 64 in uneven groups
        assert job.procs == 3 and job.batch == 64 and "model(3x1)" in styles
    if "--codec dynamic-tree" in command:
        assert plan.choices.codec == "dynamic-tree" and plan.choices.compress == (
            "activations",
            "grads",
        )
    if "--handoff c --rounds 2" in command:
        assert [(r.scheme, r.rounds) for r in plan.redistributions] == [("c", 2)]
    if "--variable-batch" in command:
        assert cfg.runtime.variable_batch and plan.redistributions[0].scheme == "b"
    if "--bn adaptive" in command:
        assert plan.choices.bn == "adaptive" and cfg.runtime.bn_max_batch == 256
    if "--reducer host" in command:
        assert plan.choices.reducer == "host"
    if "--profile-trace runs/trace" in command:
        assert cfg.profile_trace == "runs/trace"
    if "--tensorboard runs/tb" in command:
        assert cfg.tensorboard == "runs/tb"
    if "--compile" in command:
        assert cfg.runtime.compile and "model(2x2)" in styles
    if "'layer?.?'" in command:  # each residual block recomputed in backward
        assert cfg.choices.activation_checkpointing == ("layer?.?",)
    if "checkpointing 0..12" in command:  # the convolutions as one recomputed segment
        assert cfg.choices.activation_checkpointing == ("0..12",)
    if "--config run.toml" in command:  # the options printed by the line before it
        # (the last --epochs, the shortening's, overrides the file's as the example's own does)
        assert (cfg.preset, cfg.lr, cfg.epochs, plan.engine) == ("ddp", 0.1, 1, "ddp")


def test_every_readme_example_does_what_its_comment_says(tmp_path, monkeypatch, capsys, localhost):
    from hybridpar.commands import cli
    from hybridpar.core.cluster import BYTES_ONLY
    from hybridpar.runtime.train import run
    from hybridpar.runtime.train.plans import preset_plan

    monkeypatch.chdir(tmp_path)
    localhost(device="cpu")  # no cores: priced by FLOPs, no profile measured in rank 0
    (tmp_path / "mynets.py").write_text(_mynets())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the ranks import mynets too
    jobs: list = []
    launch = run.launch

    def launched(fn, procs, job, **kwargs):  # keep the job the parent built, and run it
        jobs.append(job)
        return launch(fn, procs, job, **kwargs)

    monkeypatch.setattr("hybridpar.runtime.train.run.launch", launched)
    gpu = torch.cuda.is_available()
    ran = []
    for command, _comment in examples():
        argv = shlex.split(command)[1:]  # as a shell reads it (quotes)
        name = argv[0]
        if name in ("codecs", "calibrate", "profile", "validate"):
            cli.build_parser().parse_args(argv)  # the options exist, with these values
            continue
        if "--device cuda" in command and not gpu:
            code = cli.main(argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and "GPU" in err[0], (command, err)
            continue
        into = None
        if ">" in argv:  # stdout into a file, as the shell would
            argv, into = argv[: argv.index(">")], argv[argv.index(">") + 1]
        if name == "train" and "--print-config" not in argv:
            argv += ["--max-steps", "1", "--epochs", "1", "--quiet"]
            argv += ["--compile-backend", "aot_eager"] if "--compile" in argv else []
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"{command}: {err}"
        if into:
            Path(into).write_text(out)
        if name == "predict":  # a mask per image, written by the ranks
            assert len(list(Path("masks").glob("*.mask.npy"))) == 4, out
        if "--fit" in argv:  # the largest image, and the next size refused
            assert re.search(r"predicts under 0.05 GiB a rank: \d+ x \d+", out), out
        if name == "train" and "--print-config" not in argv:
            job = jobs[-1]
            plan = job.plan or preset_plan(job, BYTES_ONLY)
            _promise(command, job, plan)
        ran.append(command)
    assert sum(c.startswith("hybridpar train") for c in ran) >= 14, ran
    assert sum(c.startswith("hybridpar plan") for c in ran) >= 5, ran
    sys.modules.pop("mynets", None)


def test_the_examples_are_read_from_the_readme():
    """The parser finds the README's examples, joined continuations and comments included."""
    found = dict(examples())
    assert "hybridpar train" in found and found["hybridpar train"].startswith("digits-wide")
    domain = next(c for c in found if "--preset domain" in c)
    assert "images split by height" in found[domain]  # the comment on the line below
    assert any(c.endswith("--scenario per-layer --out p.json") for c in found)  # a continuation


@pytest.fixture(autouse=True)
def _no_stray_mynets():
    yield
    sys.modules.pop("mynets", None)


def test_the_own_loop_on_a_zarr_group_runs_as_pasted(tmp_path):
    """The README's MONAI-style loop (a loss object, a Zarr group read by band, Dice per class),
    saved as seg.py next to a small scans.zarr and run under torchrun on 2 ranks as it says."""
    import os
    import subprocess

    import numpy as np
    import zarr

    block = next(b for b in _blocks() if "DiceCE" in b and "scans.zarr" in b)
    (tmp_path / "seg.py").write_text(block)
    g = np.random.default_rng(0)
    z = zarr.open_group(tmp_path / "scans.zarr", mode="w")
    z.create_array(
        "x", data=g.standard_normal((5, 1, 32, 32)).astype(np.float32), chunks=(1, 1, 8, 32)
    )
    z.create_array("y", data=g.integers(0, 3, (5, 32, 32)), chunks=(1, 8, 32))
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "seg.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "Dice per class" in x)
    assert len(re.findall(r"\d\.\d+", line.split("Dice per class")[1])) == 3, line
