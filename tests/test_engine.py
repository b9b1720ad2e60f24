"""One engine: `hybridpar train` runs the library's step (HybridTrainer.train_step), checkpoints of a
user's own loop (HybridTrainer.save/load) reshard onto another grid and P, both engines keep one
contract, the planner and the runtime answer "can this layer take this style?" with one rule, and
the imports the README documents keep working."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import TVAlexNet, assert_same_state, batches, make, optimizer, preset, train_reference
from torch import nn

import hybridpar
from hybridpar.core.cluster import Cluster
from hybridpar.core.config import build
from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.core.rules import EXECUTED, why_not
from hybridpar.runtime.parallel import HybridTrainer
from hybridpar.runtime.parallel.kinds import STYLES
from hybridpar.runtime.train.config import TrainConfig

SRC = pathlib.Path(hybridpar.__file__).parent
NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)


# --- the command line's training goes through HybridTrainer ------------------------------------


def _cli_steps(job):
    """train_worker (what `hybridpar train` runs on every rank), counting the library's steps."""
    from hybridpar.runtime.train.loop import train_worker

    calls = []
    step = HybridTrainer.train_step

    def counted(self, x, y, count=False):
        calls.append(len(x))
        return step(self, x, y, count)

    HybridTrainer.train_step = counted
    try:
        train_worker(job)
    finally:
        HybridTrainer.train_step = step
    return calls


def test_the_cli_steps_through_hybrid_trainer(tmp_path):
    """Every optimizer step of `hybridpar train` is HybridTrainer.train_step: 2 epochs x 3 steps
    on each rank, after the plan's check, a step of its own copy's trainer (verify.py). If
    train/ ran a step of its own this count would be 0."""
    from hybridpar.runtime.train.run import prepare

    cfg = build(
        TrainConfig,
        model="digits-cnn",
        nproc=2,
        preset="grid:2x1",
        batch=32,
        epochs=2,
        max_steps=3,
        quiet=True,
        progress=False,
        save=str(tmp_path / "w.pt"),
    )
    job = prepare(cfg)
    assert job.layout is not None and job.layout.plan is job.plan  # resolved once, in the parent
    for calls in run_ranks(_cli_steps, 2, job, timeout_s=180):
        assert calls[1:] == [32] * 6 and calls[0] < 32, calls


def test_train_has_no_step_of_its_own():
    """runtime/train holds data, the epoch loop, reports and the job: no backward pass, no
    optimizer step, no engine of its own (those are HybridTrainer's and parallelize's)."""
    for path in (SRC / "runtime" / "train").glob("*.py"):
        tree = ast.parse(path.read_text())
        calls = {
            node.func.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        assert not calls & {"backward", "finish_backward", "zero_grad"}, path.name
        assert "DistributedDataParallel" not in path.read_text(), path.name


# --- checkpoints in a user's own loop --------------------------------------------------------

PLAN_4 = {"features.3": Style.model(2, 2), "classifier.*": Style.model(2, 2)}
PLAN_3 = {"features.3": Style.model(3, 1), "classifier.*": Style.model(3, 1)}


def _trainer(styles: dict) -> HybridTrainer:
    P = dist.get_world_size()
    plan = ParallelPlan(P, 12, styles, input_shape=(1, 8, 8))
    return HybridTrainer(make("tv-alexnet"), plan, optimizer)


def _first_half(folder: str):
    """4 ranks, 2x2: 2 steps, save, 2 more; the uninterrupted run's weights."""
    t = _trainer(PLAN_4)
    data = batches(steps=4)
    for x, y in data[:2]:
        t.train_step(x, y)
    t.save(folder, meta={"note": "half way"})
    for x, y in data[2:]:
        t.train_step(x, y)
    return t.full_state_dict()


def _second_half(folder: str, styles: dict):
    """Load the checkpoint into a fresh trainer (another plan, maybe another P), 2 steps."""
    torch.manual_seed(1 + dist.get_rank())  # fresh weights everywhere: the load decides
    t = _trainer(styles)
    meta = t.load(folder)
    assert meta["note"] == "half way" and t.steps == 2
    for x, y in batches(steps=4)[2:]:
        t.train_step(x, y)
    return t.full_state_dict(), t.resharded


def test_hybrid_trainer_checkpoints_reshard_onto_another_grid_and_p(tmp_path):
    """HybridTrainer.save on a 2x2 plan on 4 ranks, .load on a 3x1 plan on 3 ranks: the same
    parameters as the uninterrupted run (rtol 1e-5); loaded on the same grid: bit for bit. Both
    match single-process SGD (momentum resumed as well)."""
    folder = str(tmp_path / "ck")
    whole = run_ranks(_first_half, 4, folder, timeout_s=180)[0]
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000002"
    other, resharded = run_ranks(_second_half, 3, folder, PLAN_3, timeout_s=180)[0]
    assert resharded
    assert_same_state(other, whole, "2x2 -> 3x1")
    same, resharded = run_ranks(_second_half, 4, folder, PLAN_4, timeout_s=180)[0]
    assert not resharded
    assert all(torch.equal(same[k], v) for k, v in whole.items())
    assert_same_state(whole, train_reference(make("tv-alexnet"), batches(steps=4)), "oracle")


# --- both engines, one contract ----------------------------------------------------------------


def _ddp_engine():
    P = dist.get_world_size()
    plan = preset("tv-alexnet", "ddp", P)
    t = HybridTrainer(make("tv-alexnet"), plan, optimizer)
    assert type(t.model).__name__ == "DDPEngine"
    losses = [t.step(x, y) for x, y in batches()]
    assert_same_state(t.full_state_dict(), train_reference(make("tv-alexnet"), batches()), "ddp")
    return losses


def test_the_ddp_engine_keeps_the_one_step_contract():
    """A plan with engine ddp: torch DDP behind parallelize, the same step (loss summed over the
    rank's rows, divided by the global batch, hybridpar's reducer summing) equals one process;
    step() returns the same global mean loss on every rank."""
    losses = run_ranks(_ddp_engine, 2)
    assert losses[0] == losses[1]


# --- plan = run: one rule ----------------------------------------------------------------------


class Shared(nn.Module):
    """One Linear applied twice (shared weights): it cannot be split over a model group."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 12)
        self.twice = nn.Linear(12, 12)
        self.out = nn.Linear(12, 5)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.out(self.twice(torch.relu(self.twice(self.inp(x)))))


def test_planner_and_runtime_refuse_with_one_rule():
    """The runtime's style kinds are the rules' executed kinds; the planner never proposes a model
    split of a layer called twice, and the runtime refuses one in the rule's own words."""
    from hybridpar.planning.search import plan_for
    from hybridpar.runtime.parallel.layout import resolve

    assert set(STYLES) == set(EXECUTED)
    with torch.device("meta"):
        model = Shared()
    r = plan_for(model, (1, 4, 4), 2, 8, NET)
    for plans in r.candidates.values():
        for p in plans:
            if p.feasible:
                assert all(x.style.is_batch for x in p.layers if x.layer.name == "twice")
    layer = next(x for x in r.scenario("batch").layers if x.layer.name == "twice").layer
    words = why_not(layer, Style.model(2, 1), 8)
    assert "called 2 times" in words
    bad = ParallelPlan(2, 8, {"twice": Style.model(2, 1)}, input_shape=(1, 4, 4))
    with pytest.raises(ConfigError) as err:
        resolve(model, bad, world=2)
    assert str(err.value) == words


def test_one_bn_default_for_library_and_command_line():
    """plan_for(model).export(), the CLI's train and plan configs and a bare plan all use global
    BN, the default that keeps the equivalence invariant (they used to disagree)."""
    from hybridpar.planning.config import PlanConfig
    from hybridpar.planning.search import plan_for

    with torch.device("meta"):
        model = TVAlexNet()
    exported = plan_for(model, (1, 8, 8), 2, 12, NET).export()
    assert exported.choices.bn == TrainConfig().choices.bn == "global"
    assert PlanConfig(model="mlp", batch=8).choices.bn == ParallelPlan(2, 8).choices.bn == "global"


# --- what the README documents keeps working -----------------------------------------------------


def test_documented_imports_keep_working():
    """Every import path the README shows; a module has one name (no alias loads a copy with its
    own state)."""
    from hybridpar import HybridTrainer as Trainer
    from hybridpar import ParallelPlan as Plan
    from hybridpar import Style as S
    from hybridpar import load_cluster, make_plan, parallelize, plan_for
    from hybridpar.runtime.comm import shutdown
    from hybridpar.runtime.comm.codecs import get_codec
    from hybridpar.runtime.comm.hooks import (
        HostReducer,
        HostState,
        ReducerState,
        allreduce_hook,
        compressed_hook,
        dynamic8,
        host_hook,
        linear8,
    )
    from hybridpar.runtime.parallel import (
        GlobalBatchNorm2d,
        convert_global_batchnorm,
        split_units,
    )

    assert all(callable(f) for f in (shutdown, get_codec, plan_for, make_plan, load_cluster))
    assert Trainer is HybridTrainer and Plan is ParallelPlan and S is Style
    assert parallelize.__module__ == "hybridpar.runtime.parallel.api"
    assert GlobalBatchNorm2d.__module__ == "hybridpar.runtime.parallel.batchnorm"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hybridpar.comm")  # no second name for the runtime's modules
    assert type(hybridpar.core.plan).__name__ == "module"  # no function shadows the plan module
    del (HostReducer, HostState, ReducerState, allreduce_hook, compressed_hook, dynamic8)
    del (host_hook, linear8, split_units, convert_global_batchnorm)


def test_planning_a_zoo_model_imports_no_torch():
    """`hybridpar plan` is arithmetic: a cold process plans AlexNet at P = 512 without importing
    torch (the zoo's layers come from the analysis cache, warmed by the first call)."""
    code = (
        "import sys\n"
        "from hybridpar.commands.cli import main\n"
        "main(['plan', '--model', 'alexnet', '--procs', '512', '--batch', '2048', '--json'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-m", "hybridpar", "plan", "--model", "alexnet", "--procs",
                    "4", "--batch", "8"], check=True, capture_output=True)  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
