"""A plan that checks itself (issue 71, runtime/parallel/verify.py): before the first step each
rank compares one step of the plan on a small float64 copy with one process's. A planted fault
(a halo row that never arrives, a gradient sum that is off) is refused in one line naming the
module and its style; a sound plan passes, and training after the check is bit for bit training
without it."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from library_nets import PSPNetish
from torch import nn

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export, plan_for
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
SHAPE = (3, 24, 16)


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return UNet(SHAPE[1:], 3, width=4)


def _domain_plan():
    """Every layer on bands (the planner's domain scenario may split some by channels: on
    images this small it splits all of them, its transposed convolutions included)."""
    P = dist.get_world_size()
    layers = cost_layers(analyze(_unet(), SHAPE))
    plan = evaluate(layers, [Style.domain(P, 1)] * len(layers), PlanRequest(P, 1, NET))
    return export(plan, procs=P, batch=1, choices=Choices(), input_shape=SHAPE)


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _refused(plant: str) -> str:
    """The check's words with a fault planted in this rank's runtime."""
    from hybridpar.runtime.parallel import sync
    from hybridpar.runtime.parallel.domain import halo

    if plant == "halo":  # the rows from the band above arrive as zeros
        wait = halo._Wait.forward

        def lost(ctx, x, exchange, call):
            got = wait(ctx, x, exchange, call)  # a tensor per piece, and one empty
            above = [p.at < exchange.band[0] for p in exchange.pieces] + [False]
            return tuple(t * 0 if a else t for t, a in zip(got, above, strict=True))

        halo._Wait.forward = staticmethod(lost)
    else:  # one parameter's gradient sum is half what it should be
        done = sync.GradSync.wait

        def halved(self):
            out = done(self)
            self.pairs[0][1][0][1].grad.mul_(0.5)
            return out

        sync.GradSync.wait = halved
    try:
        HybridTrainer(_unet(), _domain_plan(), _optimizer, input_shape=SHAPE)
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    "plant, named",
    [
        ("halo", r"on rank 1, \S+'s output differs by .* \(domain\(2x1\)\)"),
        ("sum", r"the gradient of \S+ differs by .* \(domain\(2x1\)\)"),
    ],
)
def test_a_planted_fault_is_refused_naming_the_module(plant, named):
    import re

    got = run_ranks(_refused, 2, plant)
    assert got[0] == got[1] and re.search(named, got[0]), got
    assert "--no-verify" in got[0] and len(got[0].splitlines()) == 1


def _with_and_without() -> list:
    """Three steps of PSPNet-ish (batch norms, dropout) on bands after the check, and without."""
    x = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (2, 48, 48), generator=torch.Generator().manual_seed(4))
    runs = []
    for verify in (True, False):
        torch.manual_seed(0)
        model = PSPNetish()
        model.stages[0].insert(0, nn.Dropout(0.3))
        plan = plan_for(model, (3, 48, 48), 2, 2, NET, scenarios=["domain"]).export()
        t = HybridTrainer(model, plan, _optimizer, input_shape=(3, 48, 48), verify=verify)
        losses = [t.step(x, y) for _ in range(3)]
        state = t.full_state_dict()
        moments = [s["momentum_buffer"].clone() for s in t.optimizer.state.values()]
        runs.append((losses, state, moments, torch.get_rng_state(), t.checked))
    return runs


def test_training_after_the_check_is_training_without_it():
    """Bit for bit: the losses, every parameter and running statistic, the momentum, torch's
    random state; and the check ran on a smaller copy than the data's."""
    for on, off in run_ranks(_with_and_without, 2):
        assert on[0] == off[0]
        assert list(on[1]) == list(off[1])
        assert all(torch.equal(on[1][k], off[1][k]) for k in on[1])
        assert all(torch.equal(a, b) for a, b in zip(on[2], off[2], strict=True))
        assert torch.equal(on[3], off[3])
        checked = on[4]
        assert not checked.skipped and checked.shape[1] < 48 and off[4] is None, checked
        assert "passed" in str(checked)
