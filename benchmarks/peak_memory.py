"""The planner's peak bytes per rank against the peak torch's own MemTracker measures
(runtime.parallel.memory.peak_bytes), for a training step (SGD with momentum, its second: the
momentum exists) and an inference (`own_outputs`, the library's and `hybridpar predict`'s), of
the zoo's U-Net at 128^2 and 256^2 and its 3-d U-Net at 32^3, one image, P = 1, 2, 4, every layer
on bands (domain(P x 1)); the images read by band, as the CLI reads them. Then training with the
states sharded (`--shard-states`, FSDP2) of a U-Net whose parameters outweigh its activations
(width 32 at 32^2; its 3-d twin at 16^3), P = 2, 4. Bytes, not seconds: one run says it (no
repeats).

    python benchmarks/peak_memory.py [--procs 1,2,4]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet, build_any
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel.api import parallelize
from hybridpar.runtime.parallel.memory import peak_bytes
from hybridpar.runtime.parallel.trainer import HybridTrainer, own_outputs
from hybridpar.runtime.train.data import Mapped

NET = Cluster("bench", alpha=1e-6, beta=1e-9, flops=1e12)
CELLS = [("unet", (128, 128)), ("unet", (256, 256)), ("unet3d", (32, 32, 32))]
SHARDED = [("unet:32", (32, 32)), ("unet:32", (16, 16, 16))]
"""cells trained with sharded states: a U-Net of width 32 (its 3-d twin for a volume)"""


def _build(net: str, shape: tuple[int, ...]):
    if ":" not in net:
        return build_any(net, shape, 11)
    width = int(net.partition(":")[2])
    return UNet(shape[1:], 11, in_channels=shape[0], width=width, dims=len(shape) - 1)


def _plan(net: str, size: tuple[int, ...], P: int, mode: str, choices: Choices):
    shape = (1, *size)
    with torch.device("meta"):
        layers = cost_layers(analyze(_build(net, shape), shape))
    style = Style.batch(1) if P == 1 else Style.domain(P, 1)
    request = PlanRequest(P, 1, NET, elem_bytes=4, mode=mode, choices=choices)
    plan = evaluate(layers, [style] * len(layers), request)
    assert plan.feasible, plan.reason
    return export(plan, procs=P, batch=1, choices=choices, input_shape=shape)


def measure(cells, shard: bool = False) -> list[tuple[str, str, float, float]]:
    """(cell, mode, predicted, the busiest rank's measured peak) per cell and mode (`shard`:
    training alone, the states sharded), on every rank of the job it runs in."""
    P, out = dist.get_world_size(), []
    choices = Choices(shard_states=shard)
    for net, size in cells:
        shape = (1, *size)
        g = np.random.default_rng(0)
        x = Mapped(
            g.standard_normal((1, *shape)).astype(np.float32), np.arange(1), torch.float32, [0] * 3
        )
        y = Mapped(g.integers(0, 11, (1, *size)), np.arange(1), torch.long, [0] * 3)  # fmt: skip
        label = f"{net} {'x'.join(map(str, size))}"
        for mode in ("train",) if shard else ("train", "predict"):
            plan = _plan(net, size, P, mode, choices)
            torch.manual_seed(0)
            if mode == "train":
                opt = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
                t = HybridTrainer(_build(net, shape), plan, opt, input_shape=shape, verify=False)
                t.train_step(x, y)
                got = peak_bytes(lambda t=t, x=x, y=y: t.train_step(x, y), t.model, t.optimizer)
            else:
                engine = parallelize(_build(net, shape), plan, input_shape=shape)
                got = peak_bytes(lambda e=engine, x=x: own_outputs(e, x), engine)
            every = [None] * P
            dist.all_gather_object(every, got)
            out.append((label, mode, plan.memory_bytes, max(every)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="1,2,4")
    args = ap.parse_args()
    print(
        f"{'cell':<16} {'P':>2} {'mode':<8} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}"
    )
    worst = 0.0
    for shard in (False, True):
        for P in map(int, args.procs.split(",")):
            if shard and P == 1:
                continue
            cells = SHARDED if shard else CELLS
            for label, mode, want, got in launch(measure, P, cells, shard, backend="gloo",
                                                 timeout_s=600)[0]:  # fmt: skip
                worst = max(worst, abs(want / got - 1))
                mode += " (states sharded)" if shard else ""
                print(f"{label:<16} {P:>2} {mode:<8} {want / 2**20:14.2f} {got / 2**20:13.2f} "
                      f"{want / got:6.3f}", flush=True)  # fmt: skip
    print(f"largest difference: {worst:.1%} (goal: within 10 %)")


if __name__ == "__main__":
    main()
