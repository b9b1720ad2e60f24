"""The largest image one rank's memory budget trains on P = 4 bands, with the states replicated
and sharded (`--shard-states`, FSDP2): a U-Net whose parameters weigh (width 32, 4 levels: 2.1 M
parameters, 24.5 MiB of weights, gradients and momentum on every rank when replicated). For each
contender the planner's peak per rank finds the largest square image (16-pixel steps) under the
budget; then one training step at that size runs on 4 ranks and torch's MemTracker measures the
busiest rank's peak beside the prediction. Bytes, not seconds: one run says it.

    python benchmarks/sharded_fit.py [--budget-mib 40]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel.memory import peak_bytes
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("bench", alpha=1e-6, beta=1e-9, flops=1e12)
P, WIDTH, LEVELS = 4, 32, 4


def _model(side: int):
    return UNet(side, 11, in_channels=1, width=WIDTH, levels=LEVELS)


def _plan(side: int, shard: bool):
    shape = (1, side, side)
    with torch.device("meta"):
        layers = cost_layers(analyze(_model(side), shape))
    choices = Choices(shard_states=shard)
    request = PlanRequest(P, 1, NET, elem_bytes=4, choices=choices)
    plan = evaluate(layers, [Style.domain(P, 1)] * len(layers), request)
    return plan, choices, shape


def largest(budget: float, shard: bool) -> int:
    """The largest side (a multiple of 16) whose plan's peak per rank fits `budget` bytes."""
    fits = lambda k: _plan(16 * k, shard)[0].memory_bytes <= budget  # noqa: E731
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return 16 * lo


def measured(side: int, shard: bool) -> float:
    """(On the ranks.) The busiest rank's MemTracker peak of a training step (its second)."""
    plan, choices, shape = _plan(side, shard)
    plan = export(plan, procs=P, batch=1, choices=choices, input_shape=shape)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
    torch.manual_seed(0)
    t = HybridTrainer(_model(side), plan, opt, input_shape=shape, verify=False)
    x, y = torch.randn(1, *shape), torch.randint(0, 11, (1, side, side))
    t.train_step(x, y)
    got = peak_bytes(lambda: t.train_step(x, y), t.model, t.optimizer)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, got)
    return max(every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=float, default=40.0)
    args = ap.parse_args()
    budget = args.budget_mib * 2**20
    params = sum(p.numel() for p in _model(64).parameters())
    print(f"U-Net width {WIDTH}, {LEVELS} levels, {params / 1e6:.1f} M parameters; P = {P} bands; "
          f"budget {args.budget_mib:.0f} MiB per rank")  # fmt: skip
    print(f"{'states':<12} {'largest image':>14} {'predicted MiB':>14} {'measured MiB':>13} "
          f"{'measured/budget':>16}")  # fmt: skip
    sides = {}
    for shard in (False, True):
        side = sides[shard] = largest(budget, shard)
        want = _plan(side, shard)[0].memory_bytes
        got = launch(measured, P, side, shard, backend="gloo", timeout_s=900)[0]
        print(f"{'sharded' if shard else 'replicated':<12} {f'{side} x {side}':>14} "
              f"{want / 2**20:14.1f} {got / 2**20:13.1f} {got / budget:16.3f}", flush=True)  # fmt: skip
    area = (sides[True] / sides[False]) ** 2
    print(f"sharded states: {area:.2f}x the pixels of the replicated plan's largest image")


if __name__ == "__main__":
    main()
