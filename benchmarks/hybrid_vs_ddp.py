"""Claim: on alexnet-owt (FC head 4096 wide) the planner's plans move several times fewer bytes per
iteration than torch DDP on the same model, data, global batch and processes, and run faster.

Runs, in one invocation, for each P: torch DDP (its buckets all-reduced through a logged comm
hook), and hybridpar with the planner's choice on this machine (`auto`, cluster localhost), its
per-layer and same-grid plans, and Krizhevsky's layout (`owt`: FC pure model, P x 1). Prints the
grids each plan uses, bytes per iteration per rank (from the ledger) next to the prediction, median
time per iteration next to the predicted time, and the ratios to DDP.
"""

from __future__ import annotations

import argparse

from hybridpar.train.config import TrainConfig
from hybridpar.train.run import run

COMM_TERMS = ("dw_allreduce", "allgather", "dx_allreduce", "redistribute")
CONTENDERS = (
    ("torch DDP", "ddp"),
    ("hybridpar auto", "auto"),
    ("per-layer", "per-layer"),
    ("same-grid", "same-grid"),
    ("owt", "owt"),
)


def one(cfg: TrainConfig) -> dict:
    r = run(cfg)
    styles = r["plan"]["styles"].values()
    return {
        "grids": "+".join(
            sorted({s if s == "batch" else s[s.index("(") + 1 : -1] for s in styles})
        ),
        "bytes": sum(r["bytes"]["measured"].get(k, 0.0) for k in COMM_TERMS),
        "predicted": sum(r["bytes"]["predicted"].get(k, 0.0) for k in COMM_TERMS),
        "time": r["iteration"]["time_s"],
        "wait": r["iteration"]["comm_wait_s"],
        "predicted_s": r["iteration"]["predicted_s"] or 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    base = TrainConfig(
        model="alexnet-owt",
        data="synthetic:512",
        input_size=args.input_size,
        epochs=1,
        batch=args.batch,
        max_steps=args.steps,
        progress=False,
        lr=0.01,
    )
    rows = []
    for P in [int(p) for p in args.procs.split(",")]:
        results = {name: one(base.with_(nproc=P, preset=preset)) for name, preset in CONTENDERS}
        rows += [(P, name, r, results["torch DDP"]) for name, r in results.items()]
    print(
        f"alexnet-owt at {args.input_size}x{args.input_size}, global batch {args.batch}, gloo on CPU, "
        f"median of {args.steps - 1} iterations; plans priced on the calibrated localhost"
    )
    print(
        f"{'P':>2} {'contender':<15} {'grids':<14} {'MB/iter':>8} {'predicted':>9} {'bytes vs DDP':>12} "
        f"{'ms/iter':>8} {'pred ms':>8} {'comm ms':>8} {'time vs DDP':>11}"
    )
    for P, name, r, ddp in rows:
        print(
            f"{P:>2} {name:<15} {r['grids']:<14} {r['bytes'] / 1e6:8.2f} {r['predicted'] / 1e6:9.2f} "
            f"{ddp['bytes'] / r['bytes']:11.2f}x {r['time'] * 1e3:8.1f} {r['predicted_s'] * 1e3:8.1f} "
            f"{r['wait'] * 1e3:8.1f} {ddp['time'] / r['time']:10.2f}x"
        )


if __name__ == "__main__":
    main()
