"""Does `hybridpar validate` give the same answer whatever a user ran before it? (issue 42)

Three orders a user is as likely to run, each on a fresh cache folder:

  calibrate-train-validate  `hybridpar calibrate`, then a 10-step `hybridpar train` (ddp), which
                            measures and caches the compute profile, then `hybridpar validate`
  calibrate-validate        `hybridpar calibrate`, then `hybridpar validate` (it profiles)
  validate                  `hybridpar validate` on an empty cache (it calibrates first)

for each model (alexnet-owt at 64 px, resnet20 at 32 px; B = 32, P = 4), the orders interleaved
(every model's three orders in turn, `--rounds` times). Prints each run's median and worst
|predicted - measured| / measured, whether the planner's pick was the fastest (and by how much it
was slower when not), the optimizer step the profile cached, and per model the largest gap
between two orders' medians. The goals (issue 42): within 5 points of each other, each with median
<= 15 %, worst <= 30 %, pick within 10 %.

    python benchmarks/validate_orders.py [--models alexnet-owt:64,resnet20:32] [--rounds 1]
        [--keep DIR]   (each run's cache and validate folder, to price them again offline)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORDERS = ("calibrate-train-validate", "calibrate-validate", "validate")
# item 4's emulation: a calibration at 2 ranks alone prices the P = 4 job (as 2 and 4 price 8, 16)
BEYOND = "calibrate2-validate"


def run(cmd: list[str], env: dict) -> None:
    got = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({got.returncode}):\n{got.stderr[-2000:]}")


def one(order: str, model: str, size: int, batch: int, procs: int, steps: int, keep) -> dict:
    hp = [sys.executable, "-m", "hybridpar"]
    with tempfile.TemporaryDirectory(prefix="hybridpar-orders-") as tmp:
        env = {**os.environ, "HYBRIDPAR_CACHE": f"{tmp}/cache"}
        t0 = time.perf_counter()
        if order == BEYOND:
            run([*hp, "calibrate", "--nproc", "2"], env)
        elif order != "validate":
            run([*hp, "calibrate"], env)
        job = f"--model {model} --input-size {size} --batch {batch}".split()
        if order == "calibrate-train-validate":
            train = f"--nproc {procs} --preset ddp --data synthetic:{batch * 16} --epochs 1"
            train += f" --max-steps 10 --no-progress --save {tmp}/weights.pt"
            run([*hp, "train", *job, *train.split()], env)
        validate = f"--procs {procs} --steps {steps} --out {tmp}/v --quiet"
        run([*hp, "validate", *job, *validate.split()], env)
        summary = json.loads(Path(f"{tmp}/v/validate.json").read_text())["summary"]
        (profile,) = glob.glob(f"{tmp}/cache/profiles/*.json")
        update = json.loads(Path(profile).read_text())["update_s"]
        if keep is not None:  # the cache and the table, to price the same runs another way
            shutil.copytree(tmp, Path(keep) / f"{model}-{order}-{time.time_ns()}")
        return {**summary, "update_s": update, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="alexnet-owt:64,resnet20:32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="also write every run's summary here")
    ap.add_argument("--keep", help="copy each run's cache and validate folder into this folder")
    ap.add_argument(
        "--orders",
        default=",".join(ORDERS),
        help=f"comma-separated, of {', '.join((*ORDERS, BEYOND))} ({BEYOND}: a calibration at "
        "2 ranks alone prices the P-rank job: what a calibration at 2 and 4 does for 8 and 16)",
    )
    args = ap.parse_args()
    models = [(m.split(":")[0], int(m.split(":")[1])) for m in args.models.split(",")]
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    bad = set(orders) - {*ORDERS, BEYOND}
    if bad:
        ap.error(f"unknown order(s) {', '.join(sorted(bad))}")
    rows = []
    print(
        f"{'model':12} {'order':25} {'median':>7} {'worst':>7} {'rho':>5} {'pick':>10} "
        f"{'update_s':>9} {'wall':>6}"
    )
    for r in range(args.rounds):
        for model, size in models:
            for order in orders if r % 2 == 0 else orders[::-1]:
                s = one(order, model, size, args.batch, args.procs, args.steps, args.keep)
                rows.append((model, order, s))
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
                pick = "fastest" if s["picked_is_fastest"] else f"{s['picked_over_fastest']:.2f}x"
                if s.get("confirmed"):  # validate ran the contested plans again
                    pick += f" (first {s['pick_before']:.2f}x)"
                rho = s.get("spearman_rho")
                print(
                    f"{model:12} {order:25} {s['median_abs_error']:7.1%} {s['worst_abs_error']:7.1%} "
                    f"{rho if rho is None else round(rho, 2)!s:>5} {pick:>10} "
                    f"{s['update_s'] * 1e9:7.2f}ns {s['wall_s']:5.0f}s",
                    flush=True,
                )
                print(f"  {s['traced']['line']}", flush=True)
    print()
    for model, _ in models:
        meds = {
            o: statistics.median(
                s["median_abs_error"] for m, oo, s in rows if m == model and oo == o
            )
            for o in orders
        }
        worst = max(s["worst_abs_error"] for m, _, s in rows if m == model)
        gap = max(meds.values()) - min(meds.values())
        slow = max((s["picked_over_fastest"] or 1.0) for m, _, s in rows if m == model)
        print(
            f"{model}: medians by order "
            + ", ".join(f"{o} {v:.1%}" for o, v in meds.items())
            + f"; largest gap {gap * 100:.1f} points (goal <= 5); worst {worst:.1%} (goal <= "
            f"30 %); pick at most {slow:.2f}x the fastest (goal <= 1.10x)"
        )


if __name__ == "__main__":
    main()
