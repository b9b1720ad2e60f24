"""Claim: Krizhevsky's Table 1 in miniature. Bigger batches cost some accuracy, and the variable
batch size (section 4.2: the FC layers step after each of the K rounds of scheme (b), batch B/K
there, B in the convolutions) gives much of it back; time per epoch falls with K.

Runs, in one invocation, digits-wide on scikit-learn's digits with the convolutions batch-parallel
and the FC layers model-parallel over K workers (grid:Kx1), hand-off scheme (b), a per-worker batch
of --batch examples (global batch K x --batch), the learning rate scaled by K from the one-worker
batch (section 5, lr x k, omega unchanged: what the paper used): for each K of --workers, once
with synchronous SGD (batch (m, m)) and once with the variable batch ((m, n), n = --batch). Each
configuration trains --seeds times (seeds 0, 1, ...); the seeds run interleaved.

Prints per row: the batch sizes as the paper writes them, the final test cross-entropy and top-1
error (mean and range over the seeds), the time per epoch, and the speed-up over one worker, with
the paper's Table 1 beside it; then, for each K, the variable batch's error minus synchronous's.
On this 2-core machine time per epoch does not fall as on eight GPUs (the ranks share 2 cores):
the speed-up column says what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.nn import functional as F

from hybridpar.core.config import build
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.run import run

PAPER = {  # Table 1: (workers, conv batch, FC batch) -> (cross-entropy, top-1 error %, speed-up)
    (1, 128, 128): (2.611, 42.33, 1.0),
    (2, 256, 256): (2.624, 42.63, 1.95),
    (2, 256, 128): (2.614, 42.27, 1.93),
    (4, 512, 512): (2.637, 42.59, 3.74),
    (4, 512, 128): (2.625, 42.44, 3.66),
    (8, 1024, 1024): (2.678, 43.28, 6.25),
    (8, 1024, 128): (2.651, 42.86, 6.16),
}


def one(args, K: int, variable: bool, seed: int) -> dict:
    extra = {"handoff": "b", "variable_batch": variable} if K > 1 else {}
    cfg = build(
        TrainConfig,
        model="digits-wide",
        data="digits",
        nproc=K,
        preset=f"grid:{K}x1" if K > 1 else "batch",
        batch=args.batch * K,
        base_batch=args.batch,
        scale_rule="linear",
        lr=args.lr,
        epochs=args.epochs,
        seed=seed,
        progress=False,
        quiet=True,
        cluster="localhost",
        save=f"{args.out}/k{K}-{int(variable)}-s{seed}.pt",
        **extra,
    )
    r = run(cfg)
    return {
        "error": 1.0 - r["final"]["test_acc"],
        "xent": test_cross_entropy(cfg.save),
        "epoch_s": statistics.median(e["time_s"] for e in r["epochs"]),
    }


def test_cross_entropy(weights: str) -> float:
    """The trained weights' mean cross-entropy on the digits test split."""
    from hybridpar.core.models import build_model
    from hybridpar.runtime.train.data import load_data

    data = load_data("digits")
    model = build_model("digits-wide", input_size=8, num_classes=10, in_channels=1)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    with torch.no_grad():
        return float(F.cross_entropy(model(data.x_test), data.y_test))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--batch", type=int, default=16, help="examples per worker (paper: 128)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.02, help="the one-worker learning rate")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="runs/owt_table1")
    args = ap.parse_args()
    rows = []
    for K in (int(k) for k in args.workers.split(",")):
        rows.append((K, False))
        if K > 1:
            rows.append((K, True))
    got: dict[tuple[int, bool], list[dict]] = {r: [] for r in rows}
    for seed in range(args.seeds):
        for K, variable in rows:
            got[(K, variable)].append(one(args, K, variable, seed))
    base = statistics.median(g["epoch_s"] for g in got[(rows[0][0], False)])
    print(
        f"digits-wide on digits, {args.batch} examples per worker, lr {args.lr} x K (Krizhevsky "
        f"section 5), {args.epochs} epochs, scheme (b); mean [range] over {args.seeds} seeds"
    )
    print(
        f"{'K':>2} {'batch (m, n)':>14} {'test xent':>10} {'top-1 error %':>22} {'s/epoch':>8} "
        f"{'speed-up':>8}   paper at (128 K, n): xent, error, speed-up"
    )
    for K, variable in rows:
        g = got[(K, variable)]
        m, n = args.batch * K, args.batch if variable else args.batch * K
        err = [100 * x["error"] for x in g]
        xent = statistics.mean(x["xent"] for x in g)
        t = statistics.median(x["epoch_s"] for x in g)
        paper = PAPER.get((K, 128 * K, 128 if variable else 128 * K))
        ref = f"{paper[0]:.3f}, {paper[1]:.2f} %, {paper[2]:.2f}x" if paper else "-"
        e = f"{statistics.mean(err):5.2f} [{min(err):.2f}-{max(err):.2f}]"
        print(f"{K:>2} {f'({m}, {n})':>14} {xent:10.3f} {e:>22} {t:8.2f} {base / t:7.2f}x   {ref}")
    for K in sorted({k for k, v in rows if v}):
        sync = statistics.mean(100 * x["error"] for x in got[(K, False)])
        var = statistics.mean(100 * x["error"] for x in got[(K, True)])
        print(
            f"K = {K}: variable batch error minus synchronous: {var - sync:+.2f} points "
            f"(goal: within 1 point: {'met' if abs(var - sync) <= 1 else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
