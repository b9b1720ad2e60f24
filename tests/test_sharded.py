"""States sharded beside bands (issue 75, item 3): the domain style's parameters, gradients and
optimizer state sharded over the model group by torch's FSDP2 (`--shard-states`). A 2-d and a
3-d U-Net train as one process does (float64, rtol 1e-7, SGD with momentum and Adam, P = 2 and
3), each rank holding 1/Pr of every parameter and of its optimizer state, the ledger's bytes the
plan's per (layer, term); a checkpoint written sharded goes on at another P, sharded or not, and
loads into a plain module; the planner's peak is what torch's MemTracker measures (P = 2, 4);
what sharded states cannot run is refused by name."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from dist_helpers import bytes_are_predicted, run_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.core.terms import Term
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


def _plan(shape, P: int, shard: bool = True, pc: int = 1):
    layers = cost_layers(analyze(_model(shape), shape))
    choices = Choices(shard_states=shard)
    req = PlanRequest(P, pc, NET, elem_bytes=8, choices=choices)
    plan = evaluate(layers, [Style.domain(P // pc, pc)] * len(layers), req)
    return export(plan, procs=P, batch=pc, choices=choices, input_shape=shape, model="unet")


def _is_sharded(t: HybridTrainer, P: int) -> None:
    """Every parameter a DTensor of which this rank holds its chunk of the first dim (FSDP2:
    ceil(d0 / P) rows, the last ranks fewer), its optimizer state alike."""
    for p in t.model.parameters():
        assert isinstance(p, DTensor), p.shape
        chunk = -(-p.shape[0] // P)
        assert p.to_local().shape[0] <= chunk and p.to_local().shape[1:] == p.shape[1:]
        for v in t.optimizer.state[p].values():
            if v.dim():
                assert isinstance(v, DTensor) and v.to_local().shape == p.to_local().shape


class _Collectives(TorchDispatchMode):
    """Counts the c10d operations dispatched while it is on, as CommDebugMode counts them
    (CommDebugMode's module tracker fails on the forwards hybridpar installs: torch 2.13's
    _comm_mode.py:106, an IndexError)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _sharded(P: int, shapes, opt: str, pc: int = 1) -> list[str]:
    done = []
    for shape in shapes:
        data = _batches(shape, pc)
        want = _one_process(_model(shape), data, opt)
        plan = _plan(shape, P, pc=pc)
        t = HybridTrainer(_model(shape), plan, OPTIMIZERS[opt], input_shape=shape)
        with _Collectives() as seen:  # the collectives FSDP2 ran, as torch dispatches them
            for x, y in data:
                t.step(x, y)
        _is_sharded(t, P // pc)
        booked = [e.term for e in t.ledger.entries]
        assert seen.counts["_allgather_base_"] == booked.count(Term.PARAM_ALLGATHER) > 0
        assert seen.counts["_reduce_scatter_base_"] == booked.count(Term.DW_REDUCE_SCATTER) > 0
        got, tag = t.full_state_dict(), f"P={P} {opt} {shape}"
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{tag}: {k}")
        bytes_are_predicted(t.ledger, plan, tag, STEPS)
        done.append(tag)
    return done


# a 2-d U-Net and a 3-d one (12 slices: 3 at its deepest level, one a rank at P = 3)
SHAPES = [(3, 12, 12), (3, 12, 8, 8)]


@pytest.mark.parametrize("P", [2, 3])
def test_unets_train_with_sharded_states_as_one_process(P):
    for opt in OPTIMIZERS:
        assert len(run_ranks(_sharded, P, P, SHAPES, opt, timeout_s=300)[0]) == len(SHAPES)


def test_bands_beside_batch_groups_shard_their_states_too():
    """domain(2x2) on 4 ranks, two images: each shard summed over the other batch group's
    ranks after the scatter (FSDP2's HSDP, in its all-reduce hook), priced and booked."""
    assert len(run_ranks(_sharded, 4, 4, SHAPES[:1], "adam", 2, timeout_s=300)[0]) == 1


def _written(folder: str) -> None:
    """(At P = 2, the states sharded.) Two steps, then a checkpoint into `folder`."""
    shape = SHAPES[0]
    t = HybridTrainer(_model(shape), _plan(shape, 2), OPTIMIZERS["sgd"], input_shape=shape,
                      verify=False)  # fmt: skip
    for x, y in _batches(shape, 1)[:2]:
        t.step(x, y)
    t.save(folder)


def _resumed(P: int, folder: str, shard: bool) -> str:
    """(At P, sharded or not.) The checkpoint and the third step: one process's 3 steps (the
    momentum resharded with the parameters)."""
    shape = SHAPES[0]
    data = _batches(shape, 1)
    want = _one_process(_model(shape), data, "sgd")
    t = HybridTrainer(_model(shape), _plan(shape, P, shard), OPTIMIZERS["sgd"],
                      input_shape=shape, verify=False)  # fmt: skip
    t.load(folder)
    t.step(*data[2])
    got = t.full_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"P={P} {k}")
    return f"P={P} shard={shard}"


def test_a_sharded_checkpoint_goes_on_at_another_p_and_loads_into_a_plain_module(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hybridpar.runtime.parallel.checkpoint import latest

    folder = str(tmp_path / "ck")
    run_ranks(_written, 2, folder, timeout_s=300)
    for P, shard in ((3, True), (2, False)):
        assert run_ranks(_resumed, P, P, folder, shard, timeout_s=300)[0] == f"P={P} shard={shard}"
    dcp_to_torch_save(latest(folder), tmp_path / "plain.pt")  # torch's own converter
    plain = _model(SHAPES[0])
    plain.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=False)["model"])
    want = _one_process(_model(SHAPES[0]), _batches(SHAPES[0], 1)[:2], "sgd")
    for k, v in want.items():
        torch.testing.assert_close(plain.state_dict()[k], v, rtol=1e-7, atol=1e-10, msg=k)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        out = mid * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or cin != out:
            self.down = nn.Sequential(
                nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResUNet(nn.Module):
    """A U-Net on a ResNet-50-sized encoder (bottlenecks 3, 4, 6, 3; 23.5 M parameters in it)."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        stages, cin = [], 64
        for i, (n, mid) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
                cin = mid * 4
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.ups = nn.ModuleList()
        for skip, out in ((1024, 256), (512, 128), (256, 64)):
            self.ups.append(nn.Sequential(nn.Conv2d(cin + skip, out, 3, padding=1), nn.ReLU()))
            cin = out
        self.head = nn.Conv2d(cin, classes, 1)

    def forward(self, x):
        y, skips = self.stem(x), []
        for stage in self.stages:
            y = stage(y)
            skips.append(y)
        skips.pop()
        for up in self.ups:
            y = F.interpolate(y, scale_factor=2, mode="nearest")
            y = up(torch.cat([y, skips.pop()], 1))
        return self.head(F.interpolate(y, scale_factor=2, mode="nearest"))


def test_the_planner_shards_the_states_where_a_memory_limit_needs_it():
    """A hand-written U-Net on a ResNet-50-sized encoder (31.7 M parameters), one 1024 x 1024
    image on P = 16 (traced on the meta device): without a limit the planner keeps the states
    whole (faster: sharding sends 3/2 of the gradient sum's bytes, none hidden); under a limit
    between the sharded plan's peak and the replicated one's it shards them, and that plan is
    the one that fits."""
    import dataclasses

    from hybridpar.planning.search import plan_layers

    with torch.device("meta"):
        layers = cost_layers(analyze(ResUNet(), (3, 1024, 1024)))
    req = PlanRequest(16, 1, NET, scenarios=["domain"], elem_bytes=4)
    free = plan_layers(layers, req).best
    styles = [x.style for x in free.layers]
    shard = evaluate(layers, styles, dataclasses.replace(req, choices=Choices(shard_states=True)))
    assert not free.sharded and free.total_s < shard.total_s
    assert shard.memory_bytes < 0.7 * free.memory_bytes, (shard.memory_bytes, free.memory_bytes)
    limit = (shard.memory_bytes + free.memory_bytes) / 2
    result = plan_layers(layers, dataclasses.replace(req, memory_limit=limit))
    assert result.best.sharded and result.best.memory_bytes <= limit
    assert result.export().choices.shard_states


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("P", [2, 4])
def test_the_predicted_peak_with_sharded_states_is_what_memtracker_measures(P, monkeypatch):
    """A U-Net whose parameters outweigh its activations (width 32 at 32^2, its 3-d twin at
    16^3), trained with its states sharded: the plan's peak per rank within 10 % of MemTracker's
    (benchmarks/peak_memory.py prints the table)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from peak_memory import SHARDED, measure

    for label, _, want, got in run_ranks(measure, P, SHARDED, True, timeout_s=300)[0]:
        assert want == pytest.approx(got, rel=0.10), (label, P, want, got)


def test_what_sharded_states_cannot_run_is_refused_by_name():
    """No layer on bands, a tied weight: one line each."""
    from hybridpar.core.rules import why_not_choices

    layers = cost_layers(analyze(_model(SHAPES[0]), SHAPES[0]))
    on = Choices(shard_states=True)
    said = why_not_choices(on, [Style.batch(2)] * len(layers), layers, whole=True)
    assert "splits none" in said, said
    planned = evaluate(layers, [Style.batch(2)] * len(layers), PlanRequest(2, 2, NET, choices=on))
    assert "splits none" in planned.reason, planned.reason  # the planner never proposes it
    assert why_not_choices(on, [Style.domain(2, 1)] * len(layers), layers, whole=True) == ""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(F.relu(self.a(x)))

    layers = cost_layers(analyze(Tied(), (3, 8, 8)))
    said = why_not_choices(on, [Style.domain(2, 1)] * 2, layers, whole=True)
    assert said.startswith("a: its weight is also b.weight (tied); sharded states"), said
