"""Claim: on alexnet-owt (FC head 4096 wide) hybridpar's best plan moves at least 4x fewer bytes
per iteration than torch DDP at P = 4, on the same model, data, global batch and processes.

Runs, in one invocation, for P = 2 and 4: torch DDP (its buckets all-reduced through a logged
comm hook), hybridpar with the planner's choice for this machine (`auto`, cluster localhost),
and hybridpar with Krizhevsky's layout (FC pure model, P x 1). Prints bytes per iteration per rank
(from the ledger), median time per iteration, and the ratios to DDP.
"""

from __future__ import annotations

import argparse
import dataclasses

from hybridpar.train.config import TrainConfig
from hybridpar.train.run import prepare, run

COMM_TERMS = ("dw_allreduce", "allgather", "dx_allreduce", "redistribute")


def one(cfg: TrainConfig) -> dict:
    r = run(cfg)
    return {
        "grid": f"{r['grid'][0]}x{r['grid'][1]}",
        "bytes": sum(r["bytes"]["measured"].get(k, 0.0) for k in COMM_TERMS),
        "predicted": sum(r["bytes"]["predicted"].get(k, 0.0) for k in COMM_TERMS),
        "time": r["iteration"]["time_s"],
        "wait": r["iteration"]["comm_wait_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    base = TrainConfig(model="alexnet-owt", data="synthetic:512", input_size=args.input_size, epochs=1,
                       batch=args.batch, max_steps=args.steps, progress=False, lr=0.01)  # fmt: skip
    rows = []
    for P in [int(p) for p in args.procs.split(",")]:
        ddp = one(dataclasses.replace(base, nproc=P, strategy="ddp"))
        auto_cfg, _ = prepare(dataclasses.replace(base, nproc=P, strategy="auto"))
        contenders = [
            ("torch DDP", ddp),
            ("hybridpar auto", one(dataclasses.replace(base, nproc=P, strategy="auto"))),
        ]
        if auto_cfg.grid != (P, 1):
            contenders.append(
                ("hybridpar owt", one(dataclasses.replace(base, nproc=P, strategy="owt")))
            )
        for name, r in contenders:
            rows.append((P, name, r, ddp))
    print(f"alexnet-owt at {args.input_size}x{args.input_size}, global batch {args.batch}, gloo on CPU, "
          f"median of {args.steps - 1} iterations")  # fmt: skip
    print(f"{'P':>2} {'contender':<16} {'grid':>5} {'MB/iter':>9} {'predicted':>10} {'bytes vs DDP':>13} "
          f"{'ms/iter':>8} {'comm ms':>8} {'time vs DDP':>12}")  # fmt: skip
    for P, name, r, ddp in rows:
        print(f"{P:>2} {name:<16} {r['grid']:>5} {r['bytes'] / 1e6:9.2f} {r['predicted'] / 1e6:10.2f} "
              f"{ddp['bytes'] / r['bytes']:12.2f}x {r['time'] * 1e3:8.1f} {r['wait'] * 1e3:8.1f} "
              f"{ddp['time'] / r['time']:11.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
