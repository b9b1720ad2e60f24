"""A catalogue of user mistakes, each with its one-line message and where it is caught.

CLI cases run `hybridpar.commands.cli.main` in this process with the launcher replaced by a tripwire, so a
case passes only if it ends with exit code 2 and one line on stderr *before any process is
spawned*. Python API cases check the exception and its message; the ones that need ranks share one
spawn."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import TVAlexNet, batches

from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.runtime.launcher import RankFailure


@pytest.fixture
def cli(monkeypatch, capsys, tmp_path):
    """main(argv) -> (exit code, stderr); spawning anything fails the test."""
    from hybridpar.commands import cli as cli_module

    def tripwire(*args, **kwargs):
        raise AssertionError("a process was spawned for bad input")

    monkeypatch.setattr("hybridpar.runtime.train.run.launch", tripwire)
    monkeypatch.setattr("hybridpar.runtime.launcher.launch", tripwire)
    monkeypatch.setattr("hybridpar.runtime.train.calibration.launch", tripwire)

    def run(*argv):
        try:
            code = cli_module.main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        return code, capsys.readouterr().err

    return run


def npz(tmp_path, name="d.npz", **arrays):
    defaults = {"x": np.random.rand(20, 1, 8, 8).astype(np.float32), "y": np.arange(20) % 4}
    path = tmp_path / name
    np.savez(path, **{**defaults, **arrays})
    return path


def seg_npz(tmp_path):
    """Images of 1 x 8 x 8 with a class per pixel (3 classes)."""
    y = np.arange(20 * 64).reshape(20, 8, 8) % 3
    return npz(tmp_path, "seg.npz", y=y)


def checkpoint_dir(tmp_path):
    """A folder that looks like it holds a checkpoint (latest -> a step with metadata)."""
    ck = tmp_path / "ck"
    (ck / "step-00000003").mkdir(parents=True)
    (ck / "step-00000003" / "hybridpar.json").write_text(
        json.dumps({"format": "hybridpar-checkpoint/1"})
    )
    (ck / "latest").write_text("step-00000003")
    return ck


def plan_file(tmp_path, **changes):
    d = {
        "format": "hybridpar-plan/1",
        "procs": 2,
        "batch": 64,
        "model": "digits-cnn",
        "styles": {"6": "model(2x1)"},
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**d, **changes}))
    return path


def rounds_plan_file(tmp_path):
    """digits-cnn's fc-grid plan on 2 ranks with its hand-off sent by scheme (c) in 2 rounds,
    edited to recompute the convolutions."""
    from hybridpar.core.cluster import load_cluster
    from hybridpar.planning.search import make_plan

    r = make_plan("digits-cnn", 2, 64, load_cluster("cori-knl"), scenarios=["fc-grid"], handoff="c")
    plan = r.export(r.best).with_choices(activation_checkpointing=("0..6",))
    return plan.save(tmp_path / "rounds.json")


TRAIN = ["train", "--quiet"]
PLAN = ["plan", "--model", "alexnet", "--procs", "4", "--batch", "8"]


def VALIDATE(t):
    return ["validate", "--model", "digits-wide", "--batch", "16", "--out", t / "v"]


def SIM(t):
    return ["simulate", "--model", "alexnet", "--batch", "64", "--out", t / "sim", "--procs"]


CASES = [
    ("user model not importable", lambda t: [*TRAIN, "--model", "no_such_pkg.nets:small"], "cannot import no_such_pkg.nets"),
    ("user model attribute missing", lambda t: [*TRAIN, "--model", "user_models:nope"], "has no attribute 'nope'"),
    ("user model not a function", lambda t: [*TRAIN, "--model", "user_models:NOT_A_FUNCTION"], "not a function"),
    ("user model not a module", lambda t: [*TRAIN, "--model", "user_models:returns_a_tensor"], "not a torch.nn.Module"),
    ("user model needs arguments", lambda t: [*TRAIN, "--model", "user_models:needs_arguments"], "calling it failed"),
    ("user model, input shape not the data's", lambda t: [*TRAIN, "--model", "user_models:small", "--input-shape", "3,8,8"], "the data's examples are 1,8,8"),
    ("user model, wrong input shape", lambda t: [*TRAIN, "--model", "user_models:small", "--data", "synthetic:32", "--input-shape", "3,9,9"], "cannot run Small on input shape (3, 9, 9)"),
    ("user model, synthetic data without a shape", lambda t: [*TRAIN, "--model", "user_models:small", "--data", "synthetic:32"], "needs --input-shape"),
    ("input shape garbage", lambda t: [*TRAIN, "--model", "user_models:small", "--input-shape", "3,x"], "--input-shape must be positive sizes"),
    ("input shape with a zoo model", lambda t: [*TRAIN, "--input-shape", "1,8,8"], "zoo models take --input-size"),
    ("plan: user model without a shape", lambda t: ["plan", "--model", "user_models:small", "--procs", "2", "--batch", "8"], "needs --input-shape"),
    ("plan: user model not importable", lambda t: ["plan", "--model", "nope:small", "--procs", "2", "--batch", "8", "--input-shape", "1,8,8"], "cannot import nope"),
    ("plan: user model, wrong shape", lambda t: ["plan", "--model", "user_models:small", "--procs", "2", "--batch", "8", "--input-shape", "2,8,8"], "cannot run Small"),
    ("plan: user model with dettmers", lambda t: ["plan", "--model", "user_models:small", "--procs", "2", "--batch", "8", "--input-shape", "1,8,8", "--model-of", "dettmers"], "prices a zoo model"),
    # (name, argv builder (tmp_path -> argv), the message's telling part)
    ("grid of another P", lambda t: [*TRAIN, "--preset", "grid:3x2", "--nproc", "4"], "has 6 ranks"),
    ("unknown preset", lambda t: [*TRAIN, "--preset", "pipeline"], "unknown preset"),
    ("a dense net on labels", lambda t: [*TRAIN, "--model", "unet", "--data", "digits", "--nproc", "2"], "--model unet predicts a class per pixel (an output of 10x8x8 per example) but --data digits gives one label per example"),
    ("a classifier on masks", lambda t: [*TRAIN, "--model", "resnet20", "--data", "digits-seg:64", "--nproc", "2"], "--data digits-seg:64 gives a class per pixel (64 x 64 masks) but --model resnet20 outputs 11 per example"),
    ("masks of another size", lambda t: [*TRAIN, "--model", "user_models:small_dense", "--data", str(seg_npz(t))], "gives a class per pixel (8 x 8 masks) but --model user_models:small_dense outputs 3x4x4"),
    ("a Dice on labels", lambda t: [*TRAIN, "--loss", "dice", "--nproc", "2"], "--loss dice compares a class per pixel but --data digits gives one label per example"),
    ("unknown loss", lambda t: [*TRAIN, "--loss", "focal"], "--loss 'focal': give one of cross-entropy, dice, dice+ce, a torch.nn.functional loss (cross_entropy, nll_loss"),
    ("a loss of values on class labels", lambda t: [*TRAIN, "--loss", "mse_loss"], "--loss mse_loss compares the outputs with values of their shape but --data digits gives class labels"),
    ("a loss factory that returns no loss", lambda t: [*TRAIN, "--loss", "user_models:returns_a_tensor"], "--loss 'user_models:returns_a_tensor': it returned a Tensor, not a loss"),
    ("a loss factory that is not there", lambda t: [*TRAIN, "--loss", "user_models:nope"], "--loss 'user_models:nope': user_models has no attribute"),
    ("unknown model", lambda t: [*TRAIN, "--model", "gpt5"], "unknown model"),
    ("unknown schedule", lambda t: [*TRAIN, "--schedule", "warp"], "invalid choice"),
    ("unknown codec", lambda t: [*TRAIN, "--codec", "int4"], "invalid choice"),
    ("unknown compress", lambda t: [*TRAIN, "--compress", "weights"], "--compress takes"),
    ("unknown bn", lambda t: [*TRAIN, "--bn", "sync"], "invalid choice"),
    ("negative lr", lambda t: [*TRAIN, "--lr", "-1"], "--lr must be positive"),
    ("NaN lr", lambda t: [*TRAIN, "--lr", "nan"], "not a finite number"),
    ("momentum 1", lambda t: [*TRAIN, "--momentum", "1"], "--momentum must be in [0, 1)"),
    ("zero epochs", lambda t: [*TRAIN, "--epochs", "0"], "--epochs must be positive"),
    ("epochs not a number", lambda t: [*TRAIN, "--epochs", "x"], "is not an integer"),
    ("negative weight decay", lambda t: [*TRAIN, "--weight-decay", "-0.1"], "--weight-decay must be at least 0"),
    ("batch no plan splits", lambda t: [*TRAIN, "--batch", "3", "--nproc", "4", "--preset", "batch"], "needs at least Pc=4 examples"),
    ("batch no searched plan splits", lambda t: [*TRAIN, "--batch", "7", "--nproc", "16", "--preset", "domain", "--model", "mlp"], "no plan fits P=16, B=7"),
    ("zero bucket", lambda t: [*TRAIN, "--bucket-mb", "0"], "--bucket-mb must be positive"),
    ("zero timeout", lambda t: [*TRAIN, "--timeout", "0"], "--timeout must be positive"),
    ("negative codec block", lambda t: [*TRAIN, "--codec-block", "-1"], "--codec-block must be at least 0"),
    ("negative host stage", lambda t: [*TRAIN, "--host-stage-mb", "-1"], "--host-stage-mb must be at least 0"),
    ("host stage not a number", lambda t: [*TRAIN, "--host-stage-mb", "lots"], "is not a number"),
    ("missing data file", lambda t: [*TRAIN, "--data", "/nonexistent/d.npz"], "does not exist"),
    ("garbage npz", lambda t: [*TRAIN, "--data", (t / "g.npz", (t / "g.npz").write_bytes(b"zip?"))[0]], "not a readable .npz"),
    ("npz without y", lambda t: [*TRAIN, "--data", _np_without_y(t)], "needs arrays named x and y"),
    ("1-D npz for a CNN", lambda t: [*TRAIN, "--data", npz(t, x=np.random.rand(20, 64).astype(np.float32))], "cannot run"),
    ("x and y lengths", lambda t: [*TRAIN, "--data", npz(t, y=np.arange(19) % 4)], "with the same N"),
    ("negative labels", lambda t: [*TRAIN, "--data", npz(t, y=np.arange(20) % 4 - 1)], "negative labels"),
    ("float labels", lambda t: [*TRAIN, "--data", npz(t, y=(np.arange(20) % 4).astype(np.float64))], "integer class labels"),
    ("one class", lambda t: [*TRAIN, "--data", npz(t, y=np.zeros(20, dtype=np.int64))], "at least 2"),
    ("labels 50-59", lambda t: [*TRAIN, "--data", npz(t, y=50 + np.arange(20) % 10)], "have no training example"),
    ("NaN data", lambda t: [*TRAIN, "--data", npz(t, x=np.full((20, 1, 8, 8), np.nan, dtype=np.float32))], "must be finite"),
    ("synthetic:abc", lambda t: [*TRAIN, "--data", "synthetic:abc"], "write synthetic:N"),
    ("unknown data", lambda t: [*TRAIN, "--data", "imagenet"], "unknown data"),
    ("image folder of one class", lambda t: [*TRAIN, "--data", _folder(t, 1)], "one sub-folder per class"),
    ("image folder with an empty class", lambda t: [*TRAIN, "--data", _folder(t, 2)], "'class0' holds no image"),
    ("unwritable report", lambda t: [*TRAIN, "--report", "/proc/hybridpar/r.json"], "cannot write"),
    ("unwritable weights", lambda t: [*TRAIN, "--save", "/proc/hybridpar/w.pt"], "cannot write"),
    ("unwritable checkpoint dir", lambda t: [*TRAIN, "--checkpoint-dir", "/proc/hybridpar"], "cannot write"),
    ("checkpoints already there", lambda t: [*TRAIN, "--checkpoint-dir", checkpoint_dir(t)], "already holds checkpoints"),
    ("resume from nothing", lambda t: [*TRAIN, "--resume", t / "none"], "no checkpoint there"),
    ("resume auto without a folder", lambda t: [*TRAIN, "--resume", "auto"], "give one"),
    ("negative checkpoint interval", lambda t: [*TRAIN, "--checkpoint-every", "-3"], "--checkpoint-every must be at least 0"),
    ("missing plan file", lambda t: [*TRAIN, "--plan", t / "none.json"], "does not exist"),
    ("plan not JSON", lambda t: [*TRAIN, "--plan", (t / "b.json", (t / "b.json").write_text("{"))[0]], "not valid JSON"),
    ("plan and preset", lambda t: [*TRAIN, "--plan", plan_file(t), "--preset", "owt"], "not both"),
    ("plan for another P", lambda t: [*TRAIN, "--plan", plan_file(t), "--nproc", "4"], "the plan is for --nproc 2"),
    ("plan naming no module", lambda t: [*TRAIN, "--plan", plan_file(t, styles={"fc9": "batch"})], "names no module"),
    ("plan for another model", lambda t: [*TRAIN, "--plan", plan_file(t), "--model", "resnet20"], "the plan was made for digits-cnn, not resnet20"),
    ("plan and another codec", lambda t: [*TRAIN, "--plan", plan_file(t), "--codec", "fp16"], "the plan says codec none"),
    ("style of another P", lambda t: [*TRAIN, "--plan", plan_file(t, styles={"6": "model(3x1)"})], "the plan is for P=2"),
    ("plan file for another P", lambda t: [*TRAIN, "--plan", plan_file(t, procs=4)], "has 2 ranks but the plan is for P=4"),
    ("plan file of another format", lambda t: [*TRAIN, "--plan", plan_file(t, format="nope")], "not a hybridpar plan"),
    ("plan splitting more than a layer has", lambda t: [*TRAIN, "--plan", plan_file(t, model="resnet20", procs=32, styles={"conv1": "model(32x1)"})], "conv1 has 16 output channels, fewer than Pr=32"),
    ("style on a ReLU", lambda t: [*TRAIN, "--plan", plan_file(t, styles={"1": "model(2x1)"})], "has no Linear or Conv2d"),
    ("domain on a Linear", lambda t: [*TRAIN, "--plan", plan_file(t, styles={"6": "domain(2x1)"})], "cannot be split by height"),
    ("domain where the segment flattens", lambda t: [*TRAIN, "--plan", plan_file(t, styles={"2": "domain(2x1)"})], "Flatten mixes rows"),
    ("domain over more ranks than rows", lambda t: [*TRAIN, "--plan", plan_file(t, procs=16, styles={"0": "domain(16x1)"})], "the largest Pr that works is 8"),
    ("domain with 8-bit activations", lambda t: [*TRAIN, "--plan", plan_file(t, codec="linear", compress=["activations"], styles={"0": "domain(2x1)"})], "travel unencoded"),
    ("unknown cluster", lambda t: [*TRAIN, "--cluster", "mars"], "unknown cluster"),
    ("broken calibration", lambda t: [*TRAIN, "--preset", "auto", _broken_localhost(t)], "run `hybridpar calibrate` again"),
    ("plan: NaN bytes per element", lambda t: ["plan", "--model", "alexnet", "--procs", "4", "--batch", "8", "--bytes-per-element", "nan"], "not a finite number"),
    ("plan: zero processes", lambda t: ["plan", "--model", "alexnet", "--procs", "0", "--batch", "8"], "at least 1"),
    ("plan: unwritable --out", lambda t: [*PLAN, "--out", "/proc/hybridpar/p.json"], "cannot write"),
    ("plan: absurd --procs", lambda t: ["plan", "--model", "alexnet", "--procs", str(10**12), "--batch", "8"], "give a real count"),
    ("plan: zero batch", lambda t: ["plan", "--model", "alexnet", "--procs", "4", "--batch", "0"], "--batch must be a positive"),
    ("plan: unknown model", lambda t: ["plan", "--model", "gpt5", "--procs", "4", "--batch", "8"], "unknown model"),
    ("plan: unknown cluster", lambda t: [*PLAN, "--cluster", "mars"], "unknown cluster"),
    ("plan: unknown codec", lambda t: [*PLAN, "--codec", "int4"], "invalid choice"),
    ("plan: compress garbage", lambda t: [*PLAN, "--compress", "weights"], "--compress takes"),
    ("simulate: empty item in --procs", lambda t: [*SIM(t), "8,,16"], "not a comma-separated list"),
    ("simulate: trailing comma in --procs", lambda t: [*SIM(t), "8,16,"], "not a comma-separated list"),
    ("simulate: --procs twice", lambda t: [*SIM(t), "8,8"], "names a count twice"),
    ("simulate: --procs zero", lambda t: [*SIM(t), "0,8"], "positive integers"),
    ("simulate: absurd P", lambda t: [*SIM(t), f"8,{10**12}"], "give a real count"),
    ("simulate: --handoffs zero", lambda t: [*SIM(t), "8", "--handoffs", "0"], "must be at least 1"),
    ("simulate: --handoffs on one worker", lambda t: [*SIM(t), "1", "--handoffs", "16"], "2 or more in --procs"),
    ("simulate: --handoffs, no hand-off", lambda t: ["simulate", "--model", "mlp", "--batch", "64", "--out", t / "sim", "--procs", "2", "--handoffs", "16"], "no batch -> model hand-off"),
    ("simulate: unwritable --out", lambda t: ["simulate", "--model", "alexnet", "--batch", "64", "--out", "/proc/hybridpar", "--procs", "8"], "cannot write"),
    ("profile: unknown model", lambda t: ["profile", "--model", "gpt5"], "unknown model"),
    ("profile: unwritable --out", lambda t: ["profile", "--model", "mlp", "--out", "/proc/hybridpar/t.json"], "cannot write"),
    ("profile: zero repeats", lambda t: ["profile", "--model", "mlp", "--repeats", "0"], "must be at least 1"),
    ("codecs: size beyond memory", lambda t: ["codecs", "--size", str(10**13)], "give smaller sizes"),
    ("codecs: zero block", lambda t: ["codecs", "--block", "0"], "--block must be a positive"),
    ("codecs: speed size not a number", lambda t: ["codecs", "--speed-size", "big"], "is not an integer"),
    ("validate on one process", lambda t: [*VALIDATE(t), "--procs", "1"], "--procs 2 or more"),
    ("validate: one step", lambda t: [*VALIDATE(t), "--procs", "2", "--steps", "1"], "--steps must be at least 2"),
    ("validate: auto as a preset", lambda t: [*VALIDATE(t), "--procs", "2", "--presets", "auto"], "fixed presets"),
    ("validate: a grid of another P", lambda t: [*VALIDATE(t), "--procs", "2", "--presets", "grid:3x1"], "grid 3x1 has 3 ranks"),
    ("validate: a preset with more batch groups than examples", lambda t: [*VALIDATE(t), "--procs", "4", "--batch", "3", "--presets", "ddp"], "needs at least Pc=4 examples"),
    ("validate: unknown preset", lambda t: [*VALIDATE(t), "--procs", "2", "--presets", "nope"], "unknown preset"),
    ("validate: no such cluster file", lambda t: [*VALIDATE(t), "--procs", "2", "--cluster", "nowhere.toml"], "does not exist"),
    ("validate: unknown model", lambda t: [*VALIDATE(t), "--procs", "2", "--model", "nope"], "unknown model"),
    ("validate: user model without a shape", lambda t: [*VALIDATE(t), "--procs", "2", "--model", "user_models:small"], "needs --input-shape"),
    ("calibrate on one process", lambda t: ["calibrate", "--nproc", "1"], "--nproc 2 or more"),
    ("calibrate: zero repeats", lambda t: ["calibrate", "--repeats", "0"], "must be at least 1"),
    ("rounds without scheme c", lambda t: [*TRAIN, "--rounds", "2"], "--rounds is for --handoff c"),
    ("checkpointing a plan file's hand-off in rounds", lambda t: [*TRAIN, "--plan", rounds_plan_file(t)], "cannot recompute a hand-off sent in rounds"),
    ("checkpointing with --handoff c", lambda t: [*TRAIN, "--handoff", "c", "--activation-checkpointing", "0..6"], "cannot recompute a hand-off sent in rounds (--handoff c)"),
    ("plan: checkpointing with --handoff b", lambda t: [*PLAN, "--handoff", "b", "--activation-checkpointing", "features"], "cannot recompute a hand-off sent in rounds (--handoff b)"),
    ("hand-off scheme on a plan without one", lambda t: [*TRAIN, "--preset", "ddp", "--handoff", "c"], "has no batch -> model hand-off"),
    ("hand-off scheme b with rounds", lambda t: [*TRAIN, "--handoff", "b", "--rounds", "3"], "--rounds is for --handoff c"),
    ("hand-off (c) with more rounds than examples", lambda t: [*TRAIN, "--nproc", "2", "--preset", "grid:2x1", "--batch", "8", "--handoff", "c", "--rounds", "5"], "at most 4 rounds"),
    ("hand-off (b) with 8-bit activations", lambda t: [*TRAIN, "--nproc", "2", "--preset", "grid:2x1", "--handoff", "b", "--codec", "dynamic-tree", "--compress", "activations"], "broadcasts its rounds unencoded"),
    ("hand-off scheme unknown", lambda t: [*TRAIN, "--handoff", "d"], "invalid choice: 'd'"),
    ("plan: rounds without scheme c", lambda t: ["plan", "--model", "mlp", "--procs", "2", "--batch", "8", "--rounds", "2"], "--rounds is for --handoff c"),
    ("variable batch without rounds", lambda t: [*TRAIN, "--variable-batch"], "--handoff b or c"),
    ("predict: weights of another net", lambda t: [*PREDICT, _state(t, x=torch.zeros(3))], "are not of --model unet for 3 classes and 1 input channels (Missing key(s)"),
    ("predict: weights not a state dict", lambda t: [*PREDICT, _state(t, text="no")], "cannot be read"),
    ("predict: no such images", lambda t: ["predict", "--model", "unet", "--data", t / "none", "--weights", _state(t)], "none: no such file or folder"),
    ("predict: a classifier", lambda t: ["predict", "--model", "resnet20", "--data", "digits-seg:32:2", "--weights", _state(t, "resnet20")], "predict writes a class per pixel"),
    ("predict: a plan and a preset", lambda t: [*PREDICT, _state(t), "--preset", "batch", "--plan", "p.json"], "give --plan or --preset, not both"),
    ("variable batch on a 2x2 head", lambda t: [*TRAIN, "--preset", "grid:2x2", "--handoff", "c", "--variable-batch"], "on one model group (grid Px1)"),
]  # fmt: skip


PREDICT = ["predict", "--model", "unet", "--data", "digits-seg:32:2", "--weights"]


def _state(t, model="unet", text=None, **tensors):
    """A weights file: a zoo model's state_dict for 1 x 32 x 32 and 11 classes, `tensors`, or
    `text`."""
    from hybridpar.core.models import build_any

    path = t / "w.pt"
    if text is not None:
        path.write_text(text)
        return path
    torch.save(tensors or build_any(model, (1, 32, 32), 11).state_dict(), path)
    return path


def _np_without_y(t):
    path = t / "noy.npz"
    np.savez(path, x=np.zeros((4, 1, 8, 8)), labels=np.zeros(4))
    return path


def _folder(t, classes):
    root = t / "images"
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
    return root


def _broken_localhost(t):
    cache = t / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "localhost.json").write_text(
        json.dumps({"alpha": 1e-5, "beta": float("inf"), "flops": 1e9})
    )
    return "--quiet"  # the case's last argument


@pytest.mark.parametrize("name, argv, needle", CASES, ids=[c[0] for c in CASES])
def test_cli_mistakes_end_in_one_line_before_spawning(cli, tmp_path, name, argv, needle):
    args = argv(tmp_path)
    before = set(tmp_path.rglob("*"))
    code, err = cli(*args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert needle in lines[-1], err
    # argparse prints its usage above the line; ours is the one line alone
    assert len(lines) == 1 or lines[0].startswith("usage:"), err
    # nothing written: no plan, no simulation table or chart (the cache aside)
    written = {p for p in set(tmp_path.rglob("*")) - before if "cache" not in p.parts}
    assert not {p for p in written if p.is_file()}, written


def test_the_catalogue_is_long_enough():
    assert len(CASES) + len(API_CASES) >= 40


API_CASES = [
    ("plan of no processes", lambda: ParallelPlan(procs=0, batch=1), ConfigError, "positive integer"),
    ("style grid of another P", lambda: Style.parse("model(3x3)", 4), ConfigError, "P=4"),
    ("plan with a ddp engine and a split", lambda: ParallelPlan(2, 8, {"fc": Style.model(2, 1)}, engine="ddp"),
     ConfigError, "batch parallelism only"),
    ("parallelize without torch.distributed", lambda: _parallelize_alone(), RuntimeError, "initialised"),
    ("trainer given an optimizer object", lambda: _trainer_with_optimizer(), TypeError, "pass a function"),
]  # fmt: skip


def _parallelize_alone():
    from hybridpar.runtime.parallel import parallelize

    parallelize(TVAlexNet(), ParallelPlan(1, 4, input_shape=(1, 8, 8)))


def _trainer_with_optimizer():
    from hybridpar import HybridTrainer

    m = TVAlexNet()
    HybridTrainer(m, ParallelPlan(1, 4), torch.optim.SGD(m.parameters(), lr=0.1))


@pytest.mark.parametrize("name, call, error, needle", API_CASES, ids=[c[0] for c in API_CASES])
def test_python_api_mistakes_raise_clear_errors(name, call, error, needle):
    with pytest.raises(error, match=needle):
        call()


def _misuses():
    """Mistakes with a parallelized model, each one line, none a hang or a C++ abort."""
    from hybridpar.runtime.parallel import parallelize

    P = dist.get_world_size()
    plan = ParallelPlan(P, 12, {"classifier.*": Style.model(P, 1)}, input_shape=(1, 8, 8))
    hp = parallelize(TVAlexNet(), plan)
    x, _ = batches()[0]
    caught = {}
    for name, step in (("no set_batch", lambda: hp(x)),
                       ("set_batch(0)", lambda: hp.set_batch(0)),
                       ("wrong rows", lambda: (hp.set_batch(12), hp(x[:5]))),
                       ("no finish_backward", lambda: (hp.set_batch(12), hp(x[hp.input_rows(12)]).sum().backward(),
                                                       hp(x[hp.input_rows(12)])))):  # fmt: skip
        try:
            step()
        except (RuntimeError, ValueError) as exc:
            caught[name] = str(exc)
    hp.finish_backward()  # leaves the ranks in step
    try:
        parallelize(TVAlexNet(), ParallelPlan(P + 1, 12, input_shape=(1, 8, 8)))
    except ConfigError as exc:
        caught["plan of another P"] = str(exc)
    return caught


def test_misuse_of_a_parallelized_model():
    caught = run_ranks(_misuses, 2)[0]
    assert "call set_batch(n)" in caught["no set_batch"]
    assert "positive int" in caught["set_batch(0)"]
    assert "this rank feeds 6 of the 12 examples" in caught["wrong rows"]
    assert "call finish_backward()" in caught["no finish_backward"]
    assert "the plan is for P=3" in caught["plan of another P"]


def _unpicklable():
    return lambda: None


def test_a_result_that_cannot_be_sent_back_is_named():
    with pytest.raises(RankFailure, match="cannot be sent back"):
        from hybridpar.runtime.launcher import launch

        launch(_unpicklable, 2, backend="gloo", timeout_s=30)


def _tensors():
    return {"w": torch.arange(1000, dtype=torch.float32) * dist.get_rank()}  # fits the pipe


def test_a_result_with_tensors_arrives_after_its_rank_is_gone(monkeypatch):
    """A rank's result travels by value: read only once every rank has exited (what a loaded
    machine can do), its tensors still arrive. torch's multiprocessing pickler would have sent
    their storage as a file descriptor to fetch from the rank later ('Connection reset by
    peer')."""
    from hybridpar.runtime import launcher

    watch = launcher._watch

    def late(procs, *args):
        for p in procs:
            p.join(60)
        return watch(procs, *args)

    monkeypatch.setattr(launcher, "_watch", late)
    got = launcher.launch(_tensors, 2, backend="gloo", timeout_s=30)
    assert [float(r["w"][-1]) for r in got] == [0.0, 999.0]


def test_a_refusal_the_arguments_decide_comes_before_any_profile(cli, tmp_path, monkeypatch):
    """On a calibrated localhost a fixed preset is priced with a compute profile measured here (23 s
    on 5135867 before `--nproc 3 --preset grid:2x2` was refused): the refusal comes first."""
    cache = tmp_path / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    calibrated = {"name": "localhost", "alpha": 1e-5, "beta": 1e-9, "flops": 1e10, "cores": 2}
    (cache / "localhost.json").write_text(json.dumps({**calibrated, "device": "cpu"}))

    def tripwire(*args, **kwargs):
        raise AssertionError("a compute profile was measured for a refused preset")

    monkeypatch.setattr("hybridpar.planning.profile.profile_compute", tripwire)
    code, err = cli(*TRAIN, "--nproc", "3", "--preset", "grid:2x2")
    assert code == 2 and "grid" in err and len(err.strip().splitlines()) == 1, err
