"""DESIGN.md invariant 1, the correctness oracle: hybrid training on P gloo ranks gives the same
parameters as single-process SGD on the same global batches (rtol 1e-5, atol 1e-6); and
invariant 2: the ledger's bytes per layer and per collective equal the cost model's volume terms."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn

from hybridpar.comm.grid import ProcessGrid
from hybridpar.comm.ledger import Ledger
from hybridpar.train.config import TrainConfig
from hybridpar.train.loop import Trainer, layer_map
from hybridpar.train.optim import KrizhevskySGD

STEPS, B = 5, 12


def odd_model():
    """Conv trunk and an FC tail whose widths (13, 7, 5) no Pr in {2, 4} divides."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 13), nn.ReLU(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5),
    )  # fmt: skip


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 1, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g))
        for _ in range(STEPS)
    ]


def reference():
    torch.manual_seed(0)
    model = odd_model()
    opt = KrizhevskySGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _worker(pr, pc, kind):
    torch.manual_seed(0)
    model = odd_model()
    grid = ProcessGrid(pr, pc)
    ledger = Ledger()
    layer_of, _ = layer_map(model, (1, 8, 8))
    cfg = TrainConfig(lr=0.1, batch=B, bucket_mb=0.0005)  # tiny buckets: several per group
    t = Trainer(cfg, model, grid, ledger, kind, layer_of)
    for x, y in batches():
        t.step(x, y)
    state = t.full_state_dict()
    ref = reference()
    worst = max(float(((state[k] - v).abs() / (v.abs() + 1e-6)).max()) for k, v in ref.items())
    close = all(torch.allclose(state[k], v, rtol=1e-5, atol=1e-6) for k, v in ref.items())
    return {"close": close, "worst": worst, "keys": sorted(state) == sorted(ref)}


@pytest.mark.parametrize(
    "P,grid,kind",
    [(2, (1, 2), "hybrid"), (2, (2, 1), "hybrid"), (4, (1, 4), "hybrid"), (4, (4, 1), "hybrid"),
     (4, (2, 2), "hybrid"), (4, (1, 4), "ddp")],
)  # fmt: skip
def test_parallel_equals_single_process(P, grid, kind):
    for r in run_ranks(_worker, P, *grid, kind):
        assert r["keys"] and r["close"], r


def _bytes_worker(pr, pc):
    from hybridpar.train.report import predicted_bytes

    torch.manual_seed(0)
    model = odd_model()
    grid = ProcessGrid(pr, pc)
    ledger = Ledger()
    layer_of, layers = layer_map(model, (1, 8, 8))
    t = Trainer(
        TrainConfig(lr=0.1, batch=B, bucket_mb=0.0005), model, grid, ledger, "hybrid", layer_of
    )
    for x, y in batches():
        t.step(x, y)
    mine = ledger.bytes_by_layer_term()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    total = {}
    for d in every:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    predicted = predicted_bytes(
        layers, pr * pc, B, "hybrid", (pr, pc), layer_of, model, by_layer=True
    )
    kinds = {(e.term, e.kind) for e in ledger.entries}
    return total, predicted, kinds


@pytest.mark.parametrize("pr,pc", [(2, 2), (4, 1), (1, 4), (2, 1)])
def test_ledger_bytes_equal_prediction_per_layer_and_collective(pr, pc):
    P = pr * pc
    total, predicted, kinds = run_ranks(_bytes_worker, P, pr, pc)[0]
    # summed over ranks and steps, per (layer, term); the model predicts per rank and per step
    measured = {k: v / STEPS / P for k, v in total.items()}
    assert set(measured) == set(predicted)
    for k, v in predicted.items():
        assert measured[k] == pytest.approx(v, rel=1e-12), k
    expected_kinds = {("dw_allreduce", "all_reduce")}
    if pr > 1:
        expected_kinds |= {
            ("allgather", "all_gather"),
            ("dx_allreduce", "all_reduce"),
            ("redistribute", "all_gather"),
        }
    assert kinds == expected_kinds
