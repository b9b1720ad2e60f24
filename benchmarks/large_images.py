"""Images too large for one rank (issue 61), measured in one invocation on this machine (gloo):

(a) the largest square image a rank trains under a per-rank limit on the counted bytes (what a
    step holds: parameters, gradients, momentum, what autograd keeps for backward; memory.py):
    one process against 4 ranks splitting the image by height (every layer domain(4x1)), probe
    sizes printed, each rank's resident peak (VmHWM) beside; goal: 4 ranks at least 3.5x the
    pixels;
(b) for every probe, the planner's bytes per rank against the busiest rank's count and its
    resident peak; goal: predicted within 10 % of counted;
(c) the U-Net on one image, on 2 ranks by height against one process with 1 thread and with 2
    threads, interleaved rounds: seconds per step, median and spread, ratios; goals: at least
    1.6x the 1-thread process, at least 0.9x the 2-thread one; with the halo exchange's time and
    the part of it spent waiting.

    python benchmarks/large_images.py [--limit-mib 512] [--size 512] [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

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
from hybridpar.runtime.parallel.domain import Exchange
from hybridpar.runtime.parallel.trainer import HybridTrainer

CLASSES = 11
NET = Cluster("bytes", alpha=1e-6, beta=1e-9, flops=1e12)


def _plan(size: int, P: int):
    shape = (1, size, size)
    with torch.device("meta"):
        layers = cost_layers(analyze(UNet(size, CLASSES, 1), shape))
    style = Style.domain(P, 1) if P > 1 else Style.batch(1)
    plan = evaluate(layers, [style] * len(layers), PlanRequest(P, 1, NET, elem_bytes=4))
    return export(plan, procs=P, batch=1, choices=Choices(), input_shape=shape)


def _trainer(size: int, P: int) -> HybridTrainer:
    torch.manual_seed(0)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
    return HybridTrainer(UNet(size, CLASSES, 1), _plan(size, P), opt, input_shape=(1, size, size))


def _resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _probe(size: int, P: int) -> tuple[float, list[float], list[float]]:
    """(predicted, counted per rank, resident per rank) MiB of one step on one size x size image."""
    t = _trainer(size, P)
    x, y = torch.randn(1, 1, size, size), torch.randint(0, CLASSES, (1, size, size))
    t.train_step(x, y, count=True)
    mine = (sum(t.counted.values()) / 2**20, _resident_mib())
    every = [None] * P
    dist.all_gather_object(every, mine)
    return t.plan.memory_bytes / 2**20, [c for c, _ in every], [r for _, r in every]


def _steps(size: int, P: int, steps: int, threads: int) -> tuple[float, tuple | None]:
    """(median seconds per step after one warm-up, (halo seconds a step: rows posted to rows
    arrived, summed over the layers; of them spent waiting) or None)."""
    torch.set_num_threads(threads)
    t = _trainer(size, P)
    x, y = torch.randn(1, 1, size, size), torch.randint(0, CLASSES, (1, size, size))
    t.train_step(x, y)
    stand_ins = [getattr(m, "hybridpar_stand_in", None) for m in t.model.modules()]
    stand_ins += [s for m in t.model.modules() for s in getattr(m, "hybridpar_sites", {}).values()]
    exchanges = [e for s in stand_ins if isinstance(e := getattr(s, "exchange", None), Exchange)]
    for e in exchanges:
        e.hidden.clear()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        t.train_step(x, y)
        times.append(time.perf_counter() - t0)
    halo = sum(h for e in exchanges for h, _ in e.hidden) / steps
    exposed = sum(x for e in exchanges for _, x in e.hidden) / steps
    return statistics.median(times), (halo, exposed) if exchanges else None


def largest(limit: float, P: int, sizes: list[int]) -> int:
    """(a) and (b): probe increasing sizes until the busiest rank's count passes the limit."""
    best = 0
    for size in sizes:
        predicted, counted, resident = launch(_probe, P, size, P, timeout_s=600, backend="gloo")[0]
        fits = max(counted) <= limit
        print(
            f"  P={P} {size:5d} px: predicted {predicted:7.1f} MiB, counted {max(counted):7.1f} "
            f"(ranks {', '.join(f'{c:.1f}' for c in counted)}), predicted/counted "
            f"{predicted / max(counted):.3f}, resident {', '.join(f'{r:.0f}' for r in resident)}"
            f"{'' if fits else '  over the limit'}",
            flush=True,
        )
        if not fits:
            break
        best = size
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-mib", type=float, default=512.0)
    ap.add_argument("--size", type=int, default=512, help="(c)'s image side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"(a, b) the largest square image under {args.limit_mib:.0f} MiB counted per rank")
    one = largest(args.limit_mib, 1, [128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536])
    if not one:
        raise SystemExit(f"no probe fits {args.limit_mib} MiB on one process: raise --limit-mib")
    four = largest(args.limit_mib, 4, [one * k // 4 for k in (6, 7, 8, 9, 10, 12)])
    print(
        f"  one process: {one} px; 4 ranks by height: {four} px; pixels {four**2 / one**2:.2f}x "
        "(goal: at least 3.5x)"
    )
    print(f"(c) one {args.size} x {args.size} image, seconds per step, {args.rounds} rounds")
    runs: dict[str, list[float]] = {"1 process, 1 thread": [], "1 process, 2 threads": []}
    runs["2 ranks by height"] = []
    hidden = []
    for _ in range(args.rounds):
        for label, P, threads in (("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 1, 2),
                                  ("2 ranks by height", 2, 1)):  # fmt: skip
            s, h = launch(_steps, P, args.size, P, args.steps, threads, timeout_s=600,
                          backend="gloo")[0]  # fmt: skip
            runs[label].append(s)
            if h is not None:
                hidden.append(h)
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"  {k:22} {med[k]:.3f} s (spread {min(v):.3f}-{max(v):.3f})")
    split = med["2 ranks by height"]
    halo = statistics.median(h for h, _ in hidden)
    waited = statistics.median(w for _, w in hidden)
    print(
        f"  speed-up over 1 thread {med['1 process, 1 thread'] / split:.2f}x (goal 1.6x), over 2 "
        f"threads {med['1 process, 2 threads'] / split:.2f}x (goal 0.9x)\n"
        f"  halo exchange {halo * 1e3:.1f} ms a step (posted to arrived, every layer), of it "
        f"{waited * 1e3:.1f} ms waiting, {(1 - waited / halo) * 100:.0f} % hidden; through one "
        "host's shared memory a band is one call after its halo, so the share hidden is the "
        "posting's own time, not computation (over the network the interior rows overlap it)"
    )


if __name__ == "__main__":
    main()
