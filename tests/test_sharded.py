"""States sharded beside bands (issue 75, item 3): the domain style's parameters, gradients and
optimizer state sharded over the model group by torch's FSDP2."""

import pytest
import torch
from dist_helpers import bytes_are_predicted, run_ranks
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
STEPS, CLASSES = 3, 3
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def _model(shape):
    torch.manual_seed(0)
    return UNet(shape[1:], CLASSES, width=4, dims=len(shape) - 1).double()


def _batches(shape, b):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(b, *shape, generator=g, dtype=torch.float64),
         torch.randint(0, CLASSES, (b, *shape[1:]), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip


def _one_process(model, data, opt) -> dict:
    opt = OPTIMIZERS[opt](model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _sharded(P: int, shape, opt: str) -> str:
    b = 1
    data = _batches(shape, b)
    want = _one_process(_model(shape), data, opt)
    layers = cost_layers(analyze(_model(shape), shape))
    style = Style.domain(P, 1)
    choices = Choices(shard_states=True)
    req = PlanRequest(P, b, NET, elem_bytes=8, choices=choices)
    plan = evaluate(layers, [style] * len(layers), req)
    plan = export(plan, procs=P, batch=b, choices=choices, input_shape=shape, model="unet")
    t = HybridTrainer(_model(shape), plan, OPTIMIZERS[opt], input_shape=shape)
    for x, y in data:
        t.step(x, y)
    got = t.full_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{opt}: {k}")
    bytes_are_predicted(t.ledger, plan, f"P={P} {opt}", STEPS)
    return opt


@pytest.mark.parametrize("P", [2, 3])
def test_a_unet_trains_with_sharded_states_as_one_process(P):
    for opt in OPTIMIZERS:
        assert run_ranks(_sharded, P, P, (3, 12, 12), opt, timeout_s=300)[0] == opt
