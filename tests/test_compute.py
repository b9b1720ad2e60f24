"""Issue 41: --compile and --activation-checkpointing under any plan. The same 3 steps run plain,
with the model's compute compiled and with modules checkpointed, on 2, 3 and 4 gloo ranks
under batch, model and domain plans (and DDP's engine): the parameters and batch-norm
statistics equal the plain run's (the float32 oracle tolerance). Compiled tests use torch.compile's aot_eager backend (Dynamo's
graph capture and AOTAutograd, what meets the collectives; inductor's code generation is the same
for hybridpar as for any model and costs seconds per graph), and one test inductor itself."""

from types import SimpleNamespace

import pytest
import torch
from dist_helpers import run_ranks
from nets import MAKERS, B, assert_same_state, batches, make, preset, train_parallel
from torch import nn
from torch._dynamo.utils import counters

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices, covered
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import cost_layers
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import plan_layers
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import parallelize
from hybridpar.runtime.parallel.compute import checkpoint_modules, compile_plain, matching

STEPS = 3
# per model: what is checkpointed (a part with collectives in it under model and domain plans;
# under the batch plan, one segment, a run of a Sequential's children)
CHECKPOINT = {"tv-alexnet": ("features", "classifier"), "resnet20": ("layer*",)}
BATCH = {
    "tv-alexnet": ("features.0..features.4", "classifier"),
    "resnet20": ("layer1.0..layer1.2",),
}


# where --compile must find something to compile (elsewhere every plain part between two
# collectives is a single operation: left eager); resnet20's compiled runs with local BN, its
# global BN's all-reduce sits between every convolution and the next
COMPILES = {
    ("tv-alexnet", "batch"): 3,
    ("tv-alexnet", "ddp"): 3,
    ("tv-alexnet", "model"): 1,
    ("resnet20", "batch"): 1,
}


def _runs(name: str, P: int, backend: str = "aot_eager") -> dict:
    data = batches(MAKERS[name][1], steps=STEPS)
    out = {}
    for which in ("batch", "model", "domain", *(("ddp",) if name == "tv-alexnet" else ())):
        plan = preset(name, which, P, bn="global")
        local = preset(name, which, P, bn="local") if name == "resnet20" else plan
        runs = {
            "plain": (plan, RuntimeOptions()),
            "checkpointed": (
                plan.with_choices(
                    activation_checkpointing=(BATCH if which in ("batch", "ddp") else CHECKPOINT)[
                        name
                    ]
                ),
                RuntimeOptions(),
            ),
            "plain-local": (local, RuntimeOptions()),
            "compiled": (local, RuntimeOptions(compile=True, compile_backend=backend)),
        }
        got = {}
        for kind, (p, options) in runs.items():
            if kind == "plain-local" and local is plan:
                got[kind] = got["plain"]
                continue
            torch._dynamo.reset()
            counters.clear()
            ledger = Ledger()
            hp = parallelize(make(name), p, options, ledger=ledger)
            state = train_parallel(hp, data)
            terms = ledger.bytes_by_term()
            # what Dynamo captured (twins share a graph), and where it broke a graph
            graphs = (counters["stats"]["unique_graphs"], dict(counters["graph_break"]))
            got[kind] = (state, hp.compiled, hp.checkpointed, terms, graphs)
        out[which] = got
    return out


def _check(name: str, P: int, out: dict) -> None:
    for which, got in out.items():
        label = f"{name} P={P} {which}"
        assert_same_state(got["checkpointed"][0], got["plain"][0], f"{label} checkpointed")
        assert_same_state(got["compiled"][0], got["plain-local"][0], f"{label} compiled")
        compiled, checkpointed = got["compiled"][1], got["checkpointed"][2]
        graphs, breaks = got["compiled"][4]
        assert len(compiled) == COMPILES.get((name, which), 0), f"{label}: {compiled}"
        assert graphs >= min(1, len(compiled)) and not breaks, f"{label}: {graphs} {breaks}"
        assert checkpointed, f"{label}: nothing checkpointed"
        terms, plain_terms = got["checkpointed"][3], got["plain"][3]
        recomputed = terms.pop("recompute", 0.0)  # the checkpointed parts' collectives, again
        assert terms == plain_terms, label
        if which in ("batch", "ddp") and name == "tv-alexnet":  # no collective in a batch part
            assert recomputed == 0, label
        else:  # a split layer's gathers, a band's halos or a global BN's sums run again
            assert recomputed > 0, label


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("name", ["tv-alexnet", "resnet20"])
def test_compiled_and_checkpointed_runs_equal_the_plain_run(name, P):
    out = run_ranks(_runs, P, name, P, timeout_s=400)[0]
    _check(name, P, out)


def test_inductor_compiles_the_batch_parts_and_equals_the_plain_run():
    out = run_ranks(_runs, 2, "tv-alexnet", 2, "inductor", timeout_s=400)[0]
    _check("tv-alexnet", 2, out)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x))))


def test_a_checkpointed_module_updates_its_batch_norm_once_and_recomputes_the_same_masks():
    """One process: the recompute restores torch's random state (the dropout masks) and the
    running statistics (updated once per step, as without checkpointing)."""
    torch.manual_seed(0)
    plain = nn.Sequential(_Block(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    ckpt = nn.Sequential(_Block(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_modules(ckpt, ("0",), None, None) == ["0"]
    seg = nn.Sequential(_Block(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    seg.load_state_dict(plain.state_dict())
    assert checkpoint_modules(seg, ("0..1",), None, None) == ["0..1"]
    x = torch.randn(B, 2, 4, 4)
    for m in (plain, ckpt, seg):
        torch.manual_seed(1)
        m(x).square().sum().backward()
    for other in (ckpt, seg):
        for (k, a), b in zip(plain.state_dict().items(), other.state_dict().values(), strict=True):
            assert torch.equal(a, b), k
        assert int(other[0].bn.num_batches_tracked) == 1
        for a, b in zip(plain.parameters(), other.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)


def test_only_plain_torch_parts_are_compiled():
    class Ours(nn.Module):  # a module of hybridpar's stays eager
        pass

    Ours.__module__ = "hybridpar.runtime.parallel.model"  # the zoo's models are plain torch
    m = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), Ours(), nn.Linear(2, 2))
    m[2].register_forward_pre_hook(lambda mod, args: None)  # a hook (a hand-off) stays eager
    assert compile_plain(m, "eager") == ["0"]


def test_checkpointing_patterns_that_match_nothing_or_a_handoff_in_rounds_are_refused():
    m = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        ConfigError, match="matches no module; the model's top-level modules are: 0"
    ):
        matching(m, ("features",))
    with pytest.raises(ConfigError, match="--handoff a"):
        matching(m, ("0",), SimpleNamespace(handoffs={1: object()}))
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    assert matching(nested, ("0*",)) == [["0"]]
    assert matching(nested, ("0.0..0.1", "1")) == [["0.0", "0.1"], ["1"]]
    assert matching(nested, ("0..1", "0.1", "0..1")) == [["0", "1"]]  # inside: recomputed with it
    with pytest.raises(ConfigError, match="overlaps another segment in part"):
        matching(nn.Sequential(*[nn.ReLU() for _ in range(4)]), ("0..2", "1..3"))
    for wrong in ("0.0..1", "1..0", "x.0..x.1"):  # not siblings, backwards, no such parent
        with pytest.raises(ConfigError, match=r"two children of one nn\.Sequential"):
            matching(nested, (wrong,))
    assert Choices(activation_checkpointing="a, b*").activation_checkpointing == ("a", "b*")
    with pytest.raises(ConfigError, match="--compile-backend must be one of inductor"):
        RuntimeOptions(compile=True, compile_backend="inductr")
    with pytest.raises(ConfigError, match=r"matches none of the model's layers; e\.g\. 0\.0, 1"):
        covered(["0.0", "1"], ("features",))


def test_a_hook_inside_a_checkpointed_segment_runs_once_and_again_in_the_recompute():
    """A segment of a Sequential's children runs from the Sequential's forward under one
    checkpoint: a forward pre-hook on a module inside it (a layout change of the plan, a user's)
    runs once in the forward and once in the recompute, and the gradients are the plain run's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ckpt = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ckpt.load_state_dict(plain.state_dict())
    calls = []
    for m in (plain, ckpt):
        m[2].register_forward_pre_hook(lambda mod, args: (calls.append(mod), (2 * args[0],))[1])
    assert checkpoint_modules(ckpt, ("0..2",), None, None) == ["0..2"]
    x = torch.randn(5, 3)
    plain(x).square().sum().backward()
    assert len(calls) == 1
    ckpt(x).square().sum().backward()
    assert len(calls) == 3  # the forward and the recompute
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


CROSSING = ("features.0..features.4", "classifier.0..classifier.6")  # whole Sequentials' runs


def _crossing(P: int) -> list[str]:
    """tv-alexnet's feature and classifier runs checkpointed under plans that change the layout
    inside them (the hand-off into the split classifier at classifier.1, domain convolutions,
    the random state of model groups at every entry): the same state as the plain run."""
    data = batches(MAKERS["tv-alexnet"][1], steps=STEPS)
    done = []
    for which in ("model", "domain", f"grid:{P}x1"):
        plan = preset("tv-alexnet", which, P)
        want = train_parallel(parallelize(make("tv-alexnet"), plan), data)
        ledger = Ledger()
        checkpointed = plan.with_choices(activation_checkpointing=CROSSING)
        hp = parallelize(make("tv-alexnet"), checkpointed, ledger=ledger)
        assert hp.checkpointed == ["features.0..features.4", "classifier.0..classifier.6"]
        got = train_parallel(hp, data)
        assert_same_state(got, want, f"P={P} {which} checkpointed across its segments")
        assert ledger.bytes_by_term().get("recompute", 0) > 0, which
        done.append(which)
    return done


@pytest.mark.parametrize("P", [2, 3])
def test_checkpointed_segments_across_layout_changes_equal_the_plain_run(P):
    assert run_ranks(_crossing, P, P)[0] == ["model", "domain", f"grid:{P}x1"]


@pytest.mark.parametrize(
    "name, patterns",
    [
        ("tv-alexnet", ("features", "classifier.4")),
        ("tv-alexnet", ("features.0..features.3", "classifier.*")),
        ("resnet20", ("layer?.?",)),
        ("resnet20", ("layer1.1..layer1.2", "layer3", "fc")),
        ("alexnet-owt", ("0..12",)),
        ("alexnet-owt", ("1?",)),
    ],
)
def test_the_planner_prices_the_modules_the_runtime_recomputes(name, patterns):
    """Plan = run: the leaves the planner prices as recomputed are those under what the runtime
    checkpoints; their backward grows by their forward and their memory by less."""
    model = make(name)
    runs = matching(model, patterns)
    under = {
        f"{top}.{n}" if n else top
        for run in runs
        for top in run
        for n, m in model.get_submodule(top).named_modules()
        if not list(m.children())
    }
    layers = cost_layers(analyze(model, MAKERS[name][1]))
    leaves = [m for x in layers for m in x.members]
    assert covered(leaves, patterns) == under & set(leaves)
    net = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
    plain, ckpt = (
        plan_layers(
            layers,
            PlanRequest(
                2, B, net, choices=Choices(activation_checkpointing=p), scenarios=["batch"]
            ),
        ).candidates["batch"][0]
        for p in ((), patterns)
    )
    # each layer's forward again, for the share of its modules the runtime recomputes
    forward = sum(
        x.forward_s * len(under & set(x.layer.members)) / len(x.layer.members) for x in plain.layers
    )
    assert ckpt.compute_s - plain.compute_s == pytest.approx(forward, rel=1e-9) and forward > 0
    assert ckpt.memory_bytes < plain.memory_bytes


def test_a_memory_limit_that_only_recompute_meets_is_met_with_it():
    """--memory-limit prices the recompute: a limit between resnet20's batch plan with and without
    its blocks recomputed refuses the plain plan and accepts the checkpointed one, slower."""
    layers = cost_layers(analyze(make("resnet20"), MAKERS["resnet20"][1]))
    net = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)

    def batch(limit, patterns=()):
        choices = Choices(activation_checkpointing=patterns)
        r = plan_layers(
            layers, PlanRequest(2, B, net, choices=choices, scenarios=["batch"], memory_limit=limit)
        )
        return r.candidates["batch"][0]

    plain, ckpt = batch(None), batch(None, ("layer?.?",))
    limit = (plain.memory_bytes + ckpt.memory_bytes) / 2
    assert "over the limit" in batch(limit).reason
    fits = batch(limit, ("layer?.?",))
    assert fits.feasible and fits.memory_bytes <= limit and fits.total_s > plain.total_s
