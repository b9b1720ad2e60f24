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


def bn_model():
    """Batch norm in the trunk (over all P ranks) and in the FC tail (over the batch group)."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 5),
    )  # fmt: skip


MODELS = {"odd": odd_model, "bn": bn_model}


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(B, 1, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g))
        for _ in range(STEPS)
    ]


def reference(which="odd"):
    torch.manual_seed(0)
    model = MODELS[which]()
    opt = KrizhevskySGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _worker(pr, pc, kind, which="odd"):
    torch.manual_seed(0)
    model = MODELS[which]()
    grid = ProcessGrid(pr, pc)
    ledger = Ledger()
    layer_of, _ = layer_map(model, (1, 8, 8))
    # tiny buckets: several per group; global batch norm, as on one process
    cfg = TrainConfig(lr=0.1, batch=B, bucket_mb=0.0005, bn="global")
    t = Trainer(cfg, model, grid, ledger, kind, layer_of)
    for x, y in batches():
        t.step(x, y)
    state = t.full_state_dict()
    ref = reference(which)
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


@pytest.mark.parametrize(
    "P,grid,kind", [(2, (2, 1), "hybrid"), (4, (2, 2), "hybrid"), (2, (1, 2), "ddp")]
)
def test_global_batchnorm_training_equals_single_process(P, grid, kind):
    """Running statistics are buffers in the state dict, so they are compared too."""
    for r in run_ranks(_worker, P, *grid, kind, "bn"):
        assert r["keys"] and r["close"], r


def _bytes_worker(pr, pc, which="odd", bn="local", codec="none"):
    from hybridpar.train.report import predicted_bytes

    torch.manual_seed(0)
    model = MODELS[which]()
    grid = ProcessGrid(pr, pc)
    ledger = Ledger()
    layer_of, layers = layer_map(model, (1, 8, 8))
    cfg = TrainConfig(lr=0.1, batch=B, bucket_mb=0.0005, bn=bn, codec=codec, codec_block=16)
    t = Trainer(cfg, model, grid, ledger, "hybrid", layer_of)
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
        layers, pr * pc, B, "hybrid", (pr, pc), layer_of, model, by_layer=True, bn=bn,
        codec=codec, compress=frozenset({"grads", "activations"}),
    )  # fmt: skip
    kinds = {(e.term, e.kind) for e in ledger.entries}
    return total, predicted, kinds


@pytest.mark.parametrize(
    "pr,pc,which,bn,codec",
    [(2, 2, "odd", "local", "none"), (4, 1, "odd", "local", "none"), (1, 4, "odd", "local", "none"),
     (2, 1, "odd", "local", "none"), (2, 2, "bn", "global", "none"),
     (2, 2, "odd", "local", "dynamic-tree"), (2, 1, "odd", "local", "fp16")],
)  # fmt: skip
def test_ledger_bytes_equal_prediction_per_layer_and_collective(pr, pc, which, bn, codec):
    """With a codec, the payload (elements x its bytes) is what the cost model predicts; the
    8-bit scales and the padding of uneven pieces are booked apart, under codec_overhead."""
    P = pr * pc
    total, predicted, kinds = run_ranks(_bytes_worker, P, pr, pc, which, bn, codec)[0]
    total = {k: v for k, v in total.items() if k[1] != "codec_overhead"}
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
    if bn == "global":
        expected_kinds |= {("bn_stats", "all_reduce"), ("bn_grad", "all_reduce")}
    if codec != "none":  # reductions become all-to-all + all-gather
        reduce_terms = {t for t, k in expected_kinds if k == "all_reduce"}
        expected_kinds = {(t, k) for t, k in expected_kinds if k != "all_reduce"}
        expected_kinds |= {(t, k) for t in reduce_terms for k in ("all_to_all", "all_gather")}
        expected_kinds.add(("codec_overhead", "all_gather"))  # padding of uneven pieces, scales
        if codec != "fp16":
            expected_kinds.add(("codec_overhead", "all_to_all"))  # the scales of the sent chunks
    assert kinds == expected_kinds
