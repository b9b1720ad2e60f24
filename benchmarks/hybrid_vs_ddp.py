"""Claim: on alexnet-owt (FC head 4096 wide) the planner's plans move several times fewer bytes per
iteration than torch DDP on the same model, data, global batch and processes, and run faster.

Runs, in one invocation, for each P:
- **plain DDP**, the baseline: torch DDP in a plain loop with torch.optim.SGD, as a user writes it
  (benchmarks/plain_ddp.py), sharing only the model and the data; every ratio is against it;
- torch DDP inside hybridpar's trainer (its buckets all-reduced through a logged comm hook);
- hybridpar with the planner's choice on this machine (`auto`, cluster localhost), the same plan
  with every collective on gloo (`auto, gloo only`: --no-shared-memory turns off the
  shared-memory path of the activations' all-gathers and all-reduces, comm.small), its per-layer
  and same-grid plans, and Krizhevsky's layout (`owt`: FC pure model, P x 1).
Prints the grids each plan uses, bytes per iteration per rank (from the ledger; for plain DDP the
ring all-reduce's 2(P-1)/P of the gradient) next to the prediction, median time per iteration next
to the predicted time, and the ratios to plain DDP.

The no-communication limit: one process using every core trains the same model on the same global
batch (forward, backward, Krizhevsky's SGD step); each contender's efficiency is that limit's time
over its own. The contenders and the limit run in turn in each of `--repeat` rounds (interleaved,
so drifts of the machine hit all of them); the table gives the median over the rounds and the
range. Then our optimizer step (Krizhevsky's rule, multi-tensor) against torch.optim.SGD's on the
same parameters, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from plain_ddp import run_local

from hybridpar.core.config import build
from hybridpar.core.models import build_model
from hybridpar.core.optim import KrizhevskySGD
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.run import run

COMM_TERMS = ("dw_allreduce", "allgather", "dx_allreduce", "dx_allgather", "redistribute")
CONTENDERS = (  # (name, preset, runtime options)
    ("DDP in trainer", "ddp", {}),
    ("hybridpar auto", "auto", {}),
    ("auto, gloo only", "auto", {"shared_memory": False}),
    ("per-layer", "per-layer", {}),
    ("same-grid", "same-grid", {}),
    ("owt", "owt", {}),
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


def one_process(batch: int, input_size: int, steps: int) -> float:
    """Median seconds per iteration of alexnet-owt trained by one process with every core (the
    no-communication limit), on the same global batch."""
    torch.manual_seed(0)
    model = build_model("alexnet-owt", input_size=input_size)
    opt = KrizhevskySGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, 3, input_size, input_size)
    y = torch.randint(0, 1000, (batch,))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _median(runs: list[dict]) -> dict:
    """The run whose time is the median of the rounds, with the range of the times."""
    ordered = sorted(runs, key=lambda r: r["time"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["lo"], mid["hi"] = ordered[0]["time"], ordered[-1]["time"]
    return mid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (noise)")
    args = ap.parse_args()
    base = build(
        TrainConfig,
        model="alexnet-owt",
        data="synthetic:512",
        input_size=args.input_size,
        epochs=1,
        batch=args.batch,
        max_steps=args.steps,
        progress=False,
        lr=0.01,
    )
    procs = [int(p) for p in args.procs.split(",")]
    runs: dict[tuple[int, str], list[dict]] = {}
    limit: list[float] = []
    for _ in range(args.repeat):
        limit.append(one_process(args.batch, args.input_size, args.steps))
        for P in procs:
            plain = run_local(P, "alexnet-owt", args.input_size, args.batch, args.steps)
            runs.setdefault((P, "plain DDP"), []).append(
                {
                    "grids": f"1x{P}",
                    "bytes": plain["ring_bytes_per_rank"],
                    "predicted": plain["ring_bytes_per_rank"],
                    "time": plain["time_s"],
                    "wait": float("nan"),
                    "predicted_s": 0.0,
                }
            )
            for name, preset, opts in CONTENDERS:
                r = one(base.with_(nproc=P, preset=preset, **opts))
                runs.setdefault((P, name), []).append(r)
    best = statistics.median(limit)
    print(
        f"alexnet-owt at {args.input_size}x{args.input_size}, global batch {args.batch}, gloo on CPU, "
        f"median of {args.steps - 1} iterations per run, {args.repeat} interleaved rounds; plans "
        "priced on the calibrated localhost"
    )
    print(
        f"no-communication limit, one process on every core: {best * 1e3:.1f} ms/iter "
        f"[{min(limit) * 1e3:.1f}-{max(limit) * 1e3:.1f}]"
    )
    print(
        f"{'P':>2} {'contender':<15} {'grids':<14} {'MB/iter':>8} {'predicted':>9} {'bytes vs DDP':>12} "
        f"{'ms/iter':>8} {'range':>13} {'pred ms':>8} {'comm ms':>8} {'vs plain DDP':>12} "
        f"{'efficiency':>10}"
    )
    for (P, name), got in runs.items():
        r, ddp = _median(got), _median(runs[(P, "plain DDP")])
        span = f"[{r['lo'] * 1e3:.1f}-{r['hi'] * 1e3:.1f}]"
        print(
            f"{P:>2} {name:<15} {r['grids']:<14} {r['bytes'] / 1e6:8.2f} {r['predicted'] / 1e6:9.2f} "
            f"{ddp['bytes'] / r['bytes']:11.2f}x {r['time'] * 1e3:8.1f} {span:>13} "
            f"{r['predicted_s'] * 1e3:8.1f} {r['wait'] * 1e3:8.1f} {ddp['time'] / r['time']:11.2f}x "
            f"{best / r['time']:10.2f}"
        )

    optimizer_step(args.input_size)


def optimizer_step(input_size: int, repeats: int = 9) -> None:
    """Our update (Krizhevsky's rule) against torch.optim.SGD (momentum 0.9, weight decay 5e-4,
    torch's default foreach path) on alexnet-owt's parameters, one thread, median of `repeats`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    params = list(build_model("alexnet-owt", input_size=input_size).parameters())
    for p in params:
        p.grad = torch.randn_like(p)

    def median_s(opt) -> float:
        opt.step()  # state allocation
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    ours = median_s(KrizhevskySGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4))
    sgd = median_s(torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4))
    torch.set_num_threads(threads)
    n = sum(p.numel() for p in params) / 1e6
    print(
        f"\noptimizer step, {n:.1f} M parameters, one thread: ours {ours * 1e3:.1f} ms, "
        f"torch.optim.SGD {sgd * 1e3:.1f} ms, ours {sgd / ours:.2f}x as fast"
    )


if __name__ == "__main__":
    main()
