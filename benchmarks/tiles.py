"""Tiles against bands (issue 62): the U-Net on one 1024 x 1024 image on 4 ranks, every layer
domain, as 4 x 1 bands of rows and as 2 x 2 tiles, in one invocation on this machine (gloo):

- halo bytes per rank per step, measured (the ledger, averaged over the ranks) beside the
  planner's prediction, and the tiles' share of the bands' (goal: well under 1: a tile's halo is
  about half a band's on 4 ranks, a quarter on 16);
- seconds per step, median and spread over interleaved rounds, beside the planner's prediction
  on the localhost calibration (`hybridpar calibrate`), and the ratio tiles / bands.

On one host a band's halo goes through shared memory, a tile's point to point (its exchanges run
along lines of the group; comm.p2p over gloo's loopback): the bands are timed both ways, so the
transport and the bytes are told apart.

    python benchmarks/tiles.py [--size 1024] [--rounds 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.trainer import HybridTrainer

CLASSES, P = 11, 4
CONTENDERS = {  # label -> (style, halo through shared memory)
    "4x1 bands, shared memory": (Style.domain(4, 1), True),
    "4x1 bands, point to point": (Style.domain(4, 1), False),
    "2x2 tiles, point to point": (Style.domain(4, 1, 2), False),
}


def _plan(size: int, style: Style, shm: bool):
    shape = (1, size, size)
    try:
        net = load_cluster("localhost")
    except ConfigError as exc:
        raise SystemExit(f"{exc}: the predicted seconds need it") from None
    with torch.device("meta"):
        layers = cost_layers(analyze(UNet(size, CLASSES, 1), shape))
    request = PlanRequest(P, 1, net, elem_bytes=4, shared_memory=shm)
    plan = evaluate(layers, [style] * len(layers), request)
    return export(plan, procs=P, batch=1, choices=Choices(), input_shape=shape)


def _run(size: int, label: str, steps: int) -> tuple[float, float, float, float]:
    """(median seconds a step, halo bytes this rank sent a step, predicted halo bytes per rank,
    predicted seconds a step)."""
    style, shm = CONTENDERS[label]
    plan = _plan(size, style, shm)
    torch.manual_seed(0)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
    options = RuntimeOptions(shared_memory=shm)
    t = HybridTrainer(
        UNet(size, CLASSES, 1), plan, opt, options=options, input_shape=(1, size, size)
    )
    x, y = torch.randn(1, 1, size, size), torch.randint(0, CLASSES, (1, size, size))
    t.train_step(x, y)  # warm-up
    halo = lambda: sum(v for k, v in t.ledger.bytes_by_layer_term().items()  # noqa: E731
                       if k[1].startswith("halo"))  # fmt: skip
    before, times = halo(), []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        t.train_step(x, y)
        times.append(time.perf_counter() - t0)
    sent = (halo() - before) / steps
    predicted = sum(v for k, v in plan.predicted_bytes(by_layer=True).items() if "halo" in k[1])
    return statistics.median(times), sent, predicted, plan.totals["total_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    print(f"U-Net, one {args.size} x {args.size} image on {P} ranks, {args.rounds} rounds of "
          f"{args.steps} steps (contenders interleaved)", flush=True)  # fmt: skip
    seconds: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    halo: dict[str, tuple[float, float]] = {}
    predicted_s: dict[str, float] = {}
    for r in range(args.rounds):
        for label in CONTENDERS:
            every = launch(_run, P, args.size, label, args.steps, timeout_s=1800, backend="gloo")
            seconds[label].append(max(s for s, _, _, _ in every))  # the slowest rank's step
            halo[label] = (sum(b for _, b, _, _ in every) / P, every[0][2])
            predicted_s[label] = every[0][3]
            print(f"  round {r + 1}: {label:27} {seconds[label][-1]:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"{'contender':27} {'halo MB/rank/step':>17} {'predicted':>9} {'s/step':>7} "
          f"{'spread':>13} {'predicted s':>11}")  # fmt: skip
    for k, v in seconds.items():
        got, want = halo[k]
        print(f"{k:27} {got / 1e6:17.3f} {want / 1e6:9.3f} {med[k]:7.3f} "
              f"{min(v):6.3f}-{max(v):6.3f} {predicted_s[k]:11.3f}")  # fmt: skip
    tiles, bands = "2x2 tiles, point to point", "4x1 bands, point to point"
    print(f"tiles / bands: halo bytes {halo[tiles][0] / halo[bands][0]:.3f} (predicted "
          f"{halo[tiles][1] / halo[bands][1]:.3f}), seconds a step {med[tiles] / med[bands]:.3f} "
          f"(point to point both), {med[tiles] / med['4x1 bands, shared memory']:.3f} against "
          "bands through shared memory")  # fmt: skip


if __name__ == "__main__":
    main()
