"""Silent wrong training on library layers (issue 59): a layer subclass keeps its own forward, its
extra parameters and its children under every style, and a forward that reads the batch size
before a point where the layout could change is planned and run without a hand-off there.

Nets of tests/subclass_nets.py (batch norms that apply an activation and dropout, weight-
standardised convolutions with a gain, a linear layer with a per-row gain, a positional encoding
built for the batch read at the forward's top) train under every plan the planner exports (each
scenario's best) and the `ddp` preset, with global and adaptive batch norm, exactly as one process
does: float64, rtol 1e-7 after 3 steps, P = 2 and 3, one spawn per P for every cell. State-dict
keys are the original's and the ledger's bytes per (layer, term) are the plan's prediction."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import batches, optimizer, train_reference
from subclass_nets import CLASSES, NETS, SHAPE, BatchReadNet, StdConvNet
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import trace
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import ParallelPlan, Style, assign_styles
from hybridpar.core.rules import why_not
from hybridpar.core.terms import Term
from hybridpar.planning.presets import plan_preset
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import SCENARIOS, plan_for
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel import HybridTrainer
from hybridpar.runtime.parallel.layout import resolve

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
SLOW = Cluster("slow-net", alpha=1e-4, beta=1e-7, flops=1e12)  # model splits win here
B, STEPS = 12, 3


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return NETS[name]().double()


def _data():
    return [(x.double(), y) for x, y in batches(SHAPE, STEPS, B)]


def _plans(name: str, P: int, bn: str) -> dict:
    """label -> plan: each scenario's best as plan_for(...).export() gives it (a scenario with no
    plan at all for this model is left out), and the ddp preset; plans of equal styles once."""
    choices = Choices(bn=bn)
    model = _model(name)
    out, seen = {}, set()
    for net in (NET, SLOW):
        for scenario in SCENARIOS:
            try:
                kw = dict(elem_bytes=8, scenarios=[scenario], choices=choices)
                plan = plan_for(model, SHAPE, P, B, net, **kw).export()
            except ConfigError as e:
                assert "no plan fits" in str(e) or "no grid" in str(e), e
                continue
            key = (plan.engine, tuple((k, v.label) for k, v in plan.styles.items()))
            if key not in seen:
                seen.add(key)
                out[f"{scenario}@{net.name}"] = plan
    layers = cost_layers(trace(model, SHAPE).specs)
    kw = dict(choices=choices, input_shape=SHAPE, elem_bytes=8)
    out["ddp"] = plan_preset("ddp", layers, PlanRequest(P, B, NET, **kw))
    return out


def _bytes_are_predicted(ledger: Ledger, plan, P: int, tag: str) -> None:
    """Per (layer, term); torch DDP's buckets carry no layer names: per term there."""
    by_layer = plan.engine != "ddp"
    every = [None] * P
    dist.all_gather_object(
        every, ledger.bytes_by_layer_term() if by_layer else ledger.bytes_by_term()
    )
    measured: dict = {}
    skip = {str(Term.CODEC_OVERHEAD), str(Term.METRICS)}
    for d in every:
        for key, v in d.items():
            key = (key[0], str(key[1])) if by_layer else str(key)
            if (key[1] if by_layer else key) not in skip:
                measured[key] = measured.get(key, 0.0) + v / STEPS / P
    predicted = plan.predicted_bytes(by_layer=by_layer)
    predicted = {(k if by_layer else str(k)): v for k, v in predicted.items()}
    assert set(measured) == set(predicted), f"{tag}: {set(measured) ^ set(predicted)}"
    for k, v in predicted.items():
        assert measured[k] == pytest.approx(v, rel=1e-12), f"{tag}: {k}"


def _cells(P: int) -> list[str]:
    """Every (net, plan, bn) cell on this rank; returns their tags (rank 0's)."""
    done = []
    data = _data()
    for name in NETS:
        want = train_reference(_model(name), data)
        for bn in ("global", "adaptive"):
            for label, plan in _plans(name, P, bn).items():
                tag = f"{name} P={P} bn={bn} {label} [{plan.engine}: " + ", ".join(
                    sorted({str(s) for s in plan.styles.values()})
                )
                tag += "]"
                ledger = Ledger()
                t = HybridTrainer(_model(name), plan, optimizer, ledger=ledger)
                switch = t.model.bn_switch
                if switch is not None:  # adaptive: global from the first step, so that it
                    switch.mode = "global"  # must equal one process
                for x, y in data:
                    t.train_step(x, y)
                got = t.full_state_dict()
                assert list(got) == list(want), f"{tag}: state-dict keys differ"
                for k, v in want.items():
                    torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{tag}: {k}")
                _bytes_are_predicted(ledger, plan, P, tag)
                done.append(tag)
    return done


@pytest.mark.parametrize("P", [2, 3])
def test_subclasses_train_as_one_process_under_every_plan(P):
    done = run_ranks(_cells, P, P, timeout_s=600)[0]
    for name in NETS:
        mine = [t for t in done if t.startswith(name)]
        assert any("[ddp" in t for t in mine), mine
        assert any("model(" in t for t in mine), f"{name} never split by model: {mine}"
    for name in ("bn-act", "std-conv"):
        assert any("domain(" in t for t in done if t.startswith(name)), done


def _adaptive_local(P: int) -> None:
    """Adaptive batch norm while it is local: the subclass's batch norm books no statistics
    all-reduce; once switched, it books one per forward."""
    plan = _plans("bn-act", P, "adaptive")["ddp"]
    ledger = Ledger()
    t = HybridTrainer(_model("bn-act"), plan, optimizer, ledger=ledger)
    x, y = _data()[0]
    t.train_step(x, y)
    assert not [e for e in ledger.entries if e.term == Term.BN_STATS], "local, yet all-reduced"
    t.model.bn_switch.mode = "global"
    t.train_step(x, y)
    stats = [e for e in ledger.entries if e.term == Term.BN_STATS]
    assert len(stats) == 4, [e.layers for e in stats]  # the four BatchNormAct2d


def test_adaptive_batch_norm_of_a_subclass_is_local_then_global():
    run_ranks(_adaptive_local, 2, 2)


# --- a forward that reads the batch size --------------------------------------------------------


def test_the_trace_pins_the_cut_between_a_batch_read_and_its_use():
    """The stem's second convolution and the embedding lie between `b = x.shape[0]` and the
    positions expanded for b images: a layout change at either hands them another batch. The
    head (after the use) is free, and so is the input."""
    layers = {x.name: x for x in cost_layers(trace(BatchReadNet(), SHAPE).specs)}
    for name in ("stem.3", "embed"):
        assert "batch size" in layers[name].pinned and name in layers[name].pinned, layers[name]
    assert not layers["stem.0"].pinned and not layers["head.1"].pinned


def test_the_planner_puts_no_handoff_where_the_batch_was_read():
    """On a network where the split convolutions win, every plan of every scenario keeps one
    batch layout across the pinned cut."""
    model = BatchReadNet().double()
    for P in (2, 3, 4):
        for scenario in SCENARIOS:
            try:
                plan = plan_for(model, SHAPE, P, B, SLOW, scenarios=[scenario]).export()
            except ConfigError:
                continue
            names = [x.name for x in cost_layers(trace(model, SHAPE).specs)]
            styles = assign_styles(plan.styles, [n for n, _ in model.named_modules()], names, P)
            pcs = {styles[n].pc for n in ("stem.0", "stem.3", "embed")}
            assert len(pcs) == 1, (P, scenario, styles)


def _handoff_after_the_read() -> dict:
    """A plan file as the planner wrote it on 2264525 (fc-grid): the stem batch, the embedding
    and the head model-split."""
    model = BatchReadNet().double()
    plan = plan_for(model, SHAPE, 2, B, NET, scenarios=["batch"]).export()
    d = plan.to_dict()
    d["styles"] = {"embed": Style.model(2, 1).label, "head.1": Style.model(2, 1).label}
    d["redistributions"], d["predicted"] = [], []
    return d


def test_a_plan_with_a_handoff_after_the_batch_read_is_refused_in_one_line():
    plan = ParallelPlan.from_dict(_handoff_after_the_read())
    with pytest.raises(ConfigError) as e:
        resolve(BatchReadNet().double(), plan, SHAPE, 2)
    msg = str(e.value)
    assert "\n" not in msg and "embed" in msg and "batch size" in msg, msg


def test_train_refuses_that_plan_file_before_spawning(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_handoff_after_the_read()))
    cmd = [sys.executable, "-m", "hybridpar", "train", "--model", "subclass_nets:BatchReadNet"]
    cmd += ["--input-shape", "3,8,8", "--plan", str(path), "--nproc", "2", "--batch", str(B)]
    cmd += ["--data", "synthetic:48", "--epochs", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="tests")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "embed" in lines[0] and "batch size" in lines[0], r.stderr
    assert "rank" not in r.stderr, r.stderr  # nothing spawned


class MixingConv(nn.Conv2d):
    """Each output channel's filter mixed with the mean filter: no row of the weight stands
    alone, so a split by output channels cannot be exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + self.weight.mean(0, keepdim=True)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class ChannelsLastBN(nn.BatchNorm2d):
    """A batch norm that normalises a channels-last copy of its input, not the input itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.contiguous(memory_format=torch.channels_last))


def _net(conv: nn.Module, bn: nn.Module) -> nn.Module:
    return nn.Sequential(conv, bn, nn.ReLU(), nn.Flatten(), nn.Linear(6 * 8 * 8, CLASSES))


def test_the_split_is_offered_for_standardised_convs_and_refused_by_name_where_rows_mix():
    """ScaledStdConv2d and GainLinear standardise or scale row by row: the model split is offered
    (the equivalence test above runs it). A convolution whose weight mixes rows is refused by the
    planner and by a plan file, in the rule's words."""
    layers = {x.name: x for x in cost_layers(trace(StdConvNet(), SHAPE).specs)}
    for name in ("stem", "conv1", "conv2", "fc"):
        assert why_not(layers[name], Style.model(2, 1), B) == "", name
    model = _net(MixingConv(3, 6, 3, padding=1), nn.BatchNorm2d(6))
    with pytest.raises(ConfigError) as e:
        plan_for(model, SHAPE, 2, B, NET, scenarios=["model"]).export()
    assert "0 cannot take model(2x1)" in str(e.value) and "mixes rows" in str(e.value)
    plan = ParallelPlan(2, B, {"0": Style.model(2, 1)}, input_shape=SHAPE)
    with pytest.raises(ConfigError, match="mixes rows of its parameter weight"):
        resolve(model, plan, SHAPE, 2)


def test_a_batch_norm_not_applied_to_its_input_cannot_take_global_statistics():
    """Global statistics swap a batch norm's F.batch_norm on its input; one that normalises a copy
    is refused by name before anything runs, and plans with --bn local."""
    model = _net(nn.Conv2d(3, 6, 3, padding=1), ChannelsLastBN(6))
    with pytest.raises(ConfigError) as e:
        plan_for(model, SHAPE, 2, B, NET, scenarios=["batch"]).export()
    assert "1: its forward applies batch_norm to its input 0 times" in str(e.value), e.value
    assert "--bn local" in str(e.value)
    plan_for(model, SHAPE, 2, B, NET, scenarios=["batch"], choices=Choices(bn="local")).export()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("tracked", [True, False])
def test_the_swap_of_a_torch_batch_norm_takes_the_arguments_its_forward_gives(momentum, tracked):
    """core.ops.call skips the TorchFunctionMode for a forward that is torch's own
    `_BatchNorm.forward` (issue 70: 11 us a call, 1.14x a step of a net of 50 batch norms):
    the stand-in gets the arguments torch's forward gives F.batch_norm, in training and in
    evaluation, and the module's count and running statistics move alike."""
    import inspect

    from hybridpar.core import ops

    calls = {"fast": [], "mode": []}

    def stand_in(into):
        def to(*args, **kwargs):
            given = inspect.signature(F.batch_norm).bind(*args, **kwargs)
            given.apply_defaults()
            into.append(list(given.arguments.values())[1:])
            return F.batch_norm(*args, **kwargs)

        return to

    torch.manual_seed(0)
    a = nn.BatchNorm2d(4, momentum=momentum, track_running_stats=tracked).double()
    b = nn.BatchNorm2d(4, momentum=momentum, track_running_stats=tracked).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for training in (True, True, False):
        a.train(training), b.train(training)
        fast = ops.call(a, a.forward, stand_in(calls["fast"]), x)
        mode = ops.call(b, lambda t: nn.BatchNorm2d.forward(b, t), stand_in(calls["mode"]), x)
        torch.testing.assert_close(fast, mode, rtol=0, atol=0)
    assert len(calls["fast"]) == len(calls["mode"]) == 3
    for got, want in zip(calls["fast"], calls["mode"], strict=True):
        for g, w in zip(got, want, strict=True):  # each module's own tensors, the same numbers
            same = torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w
            assert same and type(g) is type(w), (got, want)
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], rtol=0, atol=0)
