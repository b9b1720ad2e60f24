"""Claim under test: Dettmers' Appendix A.1 model predicts the speed-up of P workers running the
sub-batch pipeline (Krizhevsky's scheme (c): the FC layers model-parallel, fed one sub-batch of
activations per round while the next travels) at 32- and 8-bit activations.

Runs, in one invocation and interleaved over `--repeat` rounds: one process with one thread on
one sub-batch (Dettmers' single GPU), and P ranks of one thread each on P sub-batches with the
convolutions batch-parallel and the FC layers model-parallel (grid:Px1), the hand-off sent by
scheme (c) in P rounds, once with 32-bit and once with 8-bit (dynamic tree) activations.
Measured speed-up: P x (one process's time per sub-batch) / (P ranks' time per iteration), the
form of Dettmers' A.1; predicted: `hybridpar plan --model-of dettmers` on the same model, batch
and P, priced on the calibrated localhost (FLOP rate and alpha-beta). The two stand side by side
with their ratio.

    python benchmarks/dettmers_subbatch.py [--procs 2] [--sub-batch 32] [--input-size 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hybridpar.commands.papers import dettmers as dm
from hybridpar.core.cluster import load_cluster
from hybridpar.core.config import build
from hybridpar.core.models import build_model
from hybridpar.core.optim import KrizhevskySGD
from hybridpar.planning.analysis_cache import zoo_cost_layers
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.run import run


def one_process(model: str, size: int, b: int, steps: int) -> float:
    """Median seconds per iteration of one single-threaded process on one sub-batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = build_model(model, input_size=size)
    opt = KrizhevskySGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x, y = torch.randn(b, 3, size, size), torch.randint(0, 1000, (b,))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return statistics.median(times[1:])


def pipeline(args, codec: str) -> dict:
    extra = {"codec": codec, "compress": "activations"} if codec != "none" else {}
    cfg = build(
        TrainConfig,
        model=args.model,
        data="synthetic:512",
        input_size=args.input_size,
        epochs=1,
        batch=args.sub_batch * args.procs,
        max_steps=args.steps,
        progress=False,
        quiet=True,
        lr=0.01,
        nproc=args.procs,
        preset=f"grid:{args.procs}x1",
        handoff="c",
        rounds=args.procs,
        cluster="localhost",
        **extra,
    )
    r = run(cfg)
    return {"time": r["iteration"]["time_s"], "rounds": r["plan"]["redistributions"][0]["rounds"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alexnet-owt")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--sub-batch", type=int, default=32, help="examples per worker and round")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (noise)")
    args = ap.parse_args()
    P, b = args.procs, args.sub_batch
    single: list[float] = []
    runs: dict[str, list[dict]] = {"none": [], "dynamic-tree": []}
    for _ in range(args.repeat):
        single.append(one_process(args.model, args.input_size, b, args.steps))
        for codec in runs:
            runs[codec].append(pipeline(args, codec))
    layers = zoo_cost_layers(args.model, args.input_size)
    prof = dm.profile_from_layers(layers, load_cluster("localhost"), P, b)
    t1 = statistics.median(single)
    print(
        f"{args.model} {args.input_size}x{args.input_size}, sub-batch {b}, P = {P}, scheme (c) in "
        f"{P} rounds, grid:{P}x1; one thread per process; median of {args.repeat} interleaved "
        f"rounds of {args.steps - 1} iterations"
    )
    print(f"one process, one sub-batch: {t1 * 1e3:.1f} ms/iter [{min(single) * 1e3:.1f}-"
          f"{max(single) * 1e3:.1f}]")  # fmt: skip
    print(
        f"{'activations':<12} {'ms/iter':>8} {'range':>15} {'measured speed-up':>18} "
        f"{'Dettmers A.1':>13} {'measured / predicted':>21}"
    )
    for codec, bits in (("none", 32), ("dynamic-tree", 8)):
        times = sorted(r["time"] for r in runs[codec])
        t = statistics.median(times)
        measured = P * t1 / t
        predicted = dm.node_speedup(prof, bits).speedup
        label = "32-bit" if bits == 32 else "8-bit (tree)"
        span = f"[{times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f}]"
        print(
            f"{label:<12} {t * 1e3:8.1f} {span:>15} {measured:17.2f}x {predicted:12.2f}x "
            f"{measured / predicted:20.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
