"""Never silently wrong on the nets people bring (issue 71): segmentation nets written the way
MONAI, torchvision and segmentation libraries write them (tests/library_nets.py) train exactly
as one process does through the public API, under every scenario the planner exports and under
plans that mix bands with channel and batch splits: float64, 3 steps of SGD with momentum and
weight decay, rtol 1e-7, the ledger's bytes per (layer, term) the plan's, the state dict's keys
and shapes the original's, and the model left as it was by planning.

Root causes, each with a test that fails on c7baddc:
- the trace swapped a module registered under two names twice and left it holding its zeros (no
  longer Parameters; meta tensors for a large model): the net trained on them;
- a parameter tied into two modules was split twice, into two parameters;
- a batch norm of a pooled value (whole on every rank of a domain layout) summed its statistics
  over the ranks holding copies of it: its running variance was another batch's;
- a size read from a band (the input's, at the top of a forward) sized an interpolation in a
  layout after the bands.
"""

import pytest
import torch
from dist_helpers import bytes_are_predicted, run_ranks
from library_nets import (
    CLASSES,
    DeepLabish,
    NNUNetish,
    PSPNetish,
    SizeReadHead,
    SlicedEncoderUNet,
    TiedDecoder,
)
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import analyze, trace
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import SCENARIOS, evaluate, export, plan_for
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
STEPS = 3

# name -> (builder, per-example input, global batch)
NETS = {
    "nnunet": (lambda: NNUNetish(2), (3, 16, 12), 1),
    "nnunet3d": (lambda: NNUNetish(3), (3, 8, 8, 8), 1),
    "tied": (TiedDecoder, (3, 13, 10), 1),
    "sliced": (SlicedEncoderUNet, (3, 16, 12), 1),
    "psp": (PSPNetish, (3, 24, 24), 2),
    "deeplab": (DeepLabish, (3, 16, 16), 2),
    "sizeread": (SizeReadHead, (3, 16, 16), 2),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return NETS[name][0]().double()


def _data(name: str):
    _, shape, b = NETS[name]
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randn(b, *shape, generator=g, dtype=torch.float64)
        out.append((x, torch.randint(0, CLASSES, (b, *shape[1:]), generator=g)))
    return out


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def _reference(name: str):
    m = _model(name)
    opt = _optimizer(m.parameters())
    for x, y in _data(name):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return m.state_dict()


def _mixed(name: str, P: int, first: Style, then: Style, k: int):
    """The plan whose first k segments take `first` and the rest `then` (None: it cannot run)."""
    _, shape, b = NETS[name]
    layers = cost_layers(analyze(_model(name), shape))
    order = list(dict.fromkeys(x.segment for x in layers))
    styles = [first if order.index(x.segment) < k else then for x in layers]
    plan = evaluate(layers, styles, PlanRequest(P, b, NET, elem_bytes=8))
    if not plan.feasible:
        return None
    return export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape, model=name)


def _plans(name: str, P: int) -> dict:
    """label -> plan: each scenario's export (those that fit), and bands followed by channel
    splits and by batch splits, channel splits followed by bands; on an even P, tiles, and tiles
    followed by channel splits."""
    _, shape, b = NETS[name]
    out = {}
    for scenario in SCENARIOS:
        r = plan_for(_model(name), shape, P, b, NET, scenarios=[scenario], elem_bytes=8)
        if r.scenario(scenario).feasible:
            out[scenario] = r.export(r.scenario(scenario))
    dom, mod, bat = Style.domain(P, 1), Style.model(P, 1), Style.batch(P)
    mixes = [(dom, mod, 1), (dom, mod, 3), (dom, bat, 2), (mod, dom, 1)]
    if P % 2 == 0 and len(shape) == 3:  # tiles of 2-d images: P/2 x 2
        tiles = Style.domain(P, 1, 2)
        mixes += [(tiles, tiles, 99), (tiles, mod, 2)]
    for first, then, k in mixes:
        plan = _mixed(name, P, first, then, k)
        if plan is not None:
            out[f"{first}>{then}@{k}"] = plan
    return out


def _train(P: int, names: list[str]) -> list[str]:
    done = []
    for name in names:
        want, shape = _reference(name), NETS[name][1]
        for label, plan in _plans(name, P).items():
            tag = f"{name} P={P} {label}"
            model = _model(name)
            t = HybridTrainer(model, plan, _optimizer, input_shape=shape, verify=False)
            for x, y in _data(name):
                t.step(x, y)
            got = t.full_state_dict()
            assert list(got) == list(want), tag  # every key, aliases included, in order
            for k, v in want.items():
                assert got[k].shape == v.shape, f"{tag}: {k} {tuple(got[k].shape)}"
                torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{tag}: {k}")
            bytes_are_predicted(t.ledger, plan, tag, STEPS)
            done.append(tag)
    return done


# every net on 2 ranks; on 3 the 2-d ones but the sliced encoder; on 4 (2 x 2 tiles) three
WHICH = {2: list(NETS), 3: ["nnunet", "tied", "psp", "deeplab", "sizeread"]}
WHICH[4] = ["nnunet", "psp", "sizeread"]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_library_shaped_nets_train_as_one_process_under_every_plan(P):
    names = WHICH[P]
    done = run_ranks(_train, P, P, names, timeout_s=600)[0]
    assert {d.split()[0] for d in done} == set(names), done
    assert any(">" in d and d.startswith("psp") for d in done), done  # a size read after bands


class _Aliased(nn.Module):
    """A convolution registered under two names, as DynUNet registers its encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.input_block = nn.Conv2d(1, 4, 3, padding=1)
        self.skip = nn.Sequential(self.input_block)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.skip(x))


@pytest.mark.parametrize("on_meta", [False, True])
def test_planning_leaves_the_model_as_it_was(on_meta):
    """The trace swaps each parameter slot once: a module registered twice keeps its Parameter
    objects and values (on c7baddc it came back holding the trace's zeros, no longer Parameters,
    or meta tensors where the trace ran on the meta device), and so does a tied weight."""
    for model in (_Aliased(), NNUNetish(2), TiedDecoder()):
        kept = {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}
        shape = (1, 8, 8) if isinstance(model, _Aliased) else (3, 16, 12)
        if on_meta:  # what a large model gets (core.analysis.SMALL_STATE)
            import hybridpar.core.analysis as analysis

            old, analysis.SMALL_STATE = analysis.SMALL_STATE, 0
            try:
                trace(model, shape)
            finally:
                analysis.SMALL_STATE = old
        else:
            plan_for(model, shape, 2, 1, NET, scenarios=["domain"]).export()
        now = model.state_dict(keep_vars=True)
        for k, (v, copy) in kept.items():
            assert now[k] is v and not now[k].is_meta, k
            assert torch.equal(now[k].detach(), copy), k
            assert isinstance(now[k], nn.Parameter) == isinstance(v, nn.Parameter), k


def test_a_tied_weight_is_priced_once_and_never_split():
    """One parameter in two modules: the model split would make two of it, so both modules are
    refused it by name; its elements count once (with its first holder)."""
    model = TiedDecoder()
    layers = {x.name: x for x in cost_layers(analyze(model, (3, 13, 10)))}
    assert layers["dec"].params == model.dec.bias.numel()
    assert layers["enc"].params == model.enc.weight.numel() + model.enc.bias.numel()
    with pytest.raises(ConfigError, match=r"enc cannot take model.*tied"):
        plan_for(model, (3, 13, 10), 2, 1, NET, scenarios=["model"]).export()


def _aliased_dropout() -> bool:
    from hybridpar.runtime.parallel.dropout import CounterDropout

    model = TiedDecoder().double()
    model.drop.p = 0.5
    plan = _mixed("tied", 2, Style.domain(2, 1), Style.domain(2, 1), 9)
    t = HybridTrainer(model, plan, _optimizer, input_shape=(3, 13, 10), verify=False)
    m = t.model.module
    return isinstance(m.drop, CounterDropout) and m.again is m.drop


def test_a_dropout_under_two_names_is_one_counter_based_dropout():
    """Replaced under every name it has (on c7baddc the second name kept torch's dropout)."""
    assert run_ranks(_aliased_dropout, 2) == [True, True]
