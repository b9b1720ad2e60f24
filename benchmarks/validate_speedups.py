"""Claim (issue 60): judged by what it decides, the planner holds on this machine. For each model
and P, `hybridpar validate` runs the planner's top plans and the DDP preset in interleaved rounds;
per plan, the speed-up over DDP predicted against measured in the same rounds (the machine's drift
cancels), the order of the plans, and the pick against the measured fastest.

Before and after: `--before DIR` is a checkout of an earlier commit (e.g. `git worktree add
/tmp/base 2264525`); each `--pairs` round runs validate with it and with this tree, in turn, the
order alternating, each tree on a cache folder of its own calibrated once at the start by its own
`hybridpar calibrate`. The earlier validate has no rounds in its table, so its speed-ups are the
ratio of its medians.

    python benchmarks/validate_speedups.py --before /tmp/base [--pairs 3]
        [--models alexnet-owt:64,resnet20:32] [--procs 2,4] [--batch 32] [--top 4]
        [--steps 6] [--repeat 3] [--json out.json]

Printed per run: median and worst |error| of the times and of the speed-ups, Spearman's rho over
every plan and over the plans whose measured ranges do not overlap (the order of plans that the
machine cannot tell apart is not a prediction to judge), and the pick over the fastest; then per
tree and (model, P) the medians over the pairs, and the goals: speed-up error median <= 10 %,
worst <= 25 %, the pick within 10 % of the fastest, rho >= 0.8 over the plans told apart, and
the time errors' median no more than 5 points worse than before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    out = [0.0] * len(xs)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = math.fsum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va, vb = math.fsum((x - ma) ** 2 for x in ra), math.fsum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


def told_apart(plans: list[dict]) -> list[dict]:
    """The plans whose measured ranges (fastest to slowest round) overlap no other kept one's,
    kept in measured order."""
    out: list[dict] = []
    for p in sorted(plans, key=lambda p: p["measured"]["total_s"]):
        if not out or p["measured"]["lo_s"] > out[-1]["measured"]["hi_s"]:
            out.append(p)
    return out


def judge(table: dict) -> dict:
    """What one validate table says of the planner's decisions."""
    plans = [p for p in table["plans"] if p["measured"] and not p["failure"]]
    ddp = next(p for p in plans if p["label"] == "ddp")
    errs, ups = [], []
    for p in plans:
        pm, mm = p["predicted"]["total_s"], p["measured"]["total_s"]
        errs.append(abs(pm - mm) / mm)
        if p is ddp:
            continue
        up = p.get("speedup") or {}
        pred = up.get("predicted") or ddp["predicted"]["total_s"] / pm
        meas = up.get("measured") or ddp["measured"]["total_s"] / mm  # the earlier tree
        ups.append(abs(pred - meas) / meas)
    apart = told_apart(plans)
    fastest = min(plans, key=lambda p: p["measured"]["total_s"])
    pick = next(p for p in plans if p["picked"])

    def rho(ps):
        return spearman(
            [p["predicted"]["total_s"] for p in ps], [p["measured"]["total_s"] for p in ps]
        )

    return {
        "plans": len(plans),
        "error_median": statistics.median(errs),
        "error_worst": max(errs),
        "speedup_median": statistics.median(ups),
        "speedup_worst": max(ups),
        "rho": rho(plans),
        "rho_apart": rho(apart),
        "apart": len(apart),
        "pick_over_fastest": pick["measured"]["total_s"] / fastest["measured"]["total_s"],
    }


def _run(cmd: list[str], env: dict) -> None:
    got = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({got.returncode}):\n{got.stderr[-3000:]}")


def _env(tree: Path, cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "HYBRIDPAR_CACHE": str(cache)}


def validate(tree: Path, cache: Path, model: str, size: int, args, procs: int) -> dict:
    hp = [sys.executable, "-m", "hybridpar", "validate"]
    with tempfile.TemporaryDirectory(prefix="hybridpar-speedups-") as tmp:
        cmd = [*hp, "--model", model, "--input-size", str(size), "--batch", str(args.batch)]
        cmd += ["--procs", str(procs), "--top", str(args.top), "--presets", "ddp"]
        cmd += ["--steps", str(args.steps), "--repeat", str(args.repeat), "--confirm", "1"]
        cmd += ["--out", f"{tmp}/v", "--quiet"]
        _run(cmd, _env(tree, cache))
        return json.loads(Path(f"{tmp}/v/validate.json").read_text())


def _line(tag: str, j: dict) -> str:
    def pct(x):
        return f"{x * 100:5.1f} %"

    rho = "-" if j["rho"] is None else f"{j['rho']:.2f}"
    apart = "-" if j["rho_apart"] is None else f"{j['rho_apart']:.2f}"
    return (
        f"{tag:<34} time |err| {pct(j['error_median'])} / {pct(j['error_worst'])}   speed-up "
        f"|err| {pct(j['speedup_median'])} / {pct(j['speedup_worst'])}   rho {rho} "
        f"(apart {apart}, {j['apart']} of {j['plans']})   pick {j['pick_over_fastest']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout of the earlier commit")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--models", default="alexnet-owt:64,resnet20:32")
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write every run's judgement here")
    args = ap.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": HERE}
    models = [(m, int(s)) for m, s in (x.split(":") for x in args.models.split(","))]
    procs = [int(p) for p in args.procs.split(",")]
    root = Path(tempfile.mkdtemp(prefix="hybridpar-speedups-"))
    caches = {name: root / name for name in trees}
    t0 = time.perf_counter()
    for name, tree in trees.items():  # each tree's own calibration, as its users would have it
        print(f"calibrating with {name} ({tree}) ...", file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "hybridpar", "calibrate"], _env(tree, caches[name]))
    runs: list[dict] = []
    for k in range(args.pairs):
        order = list(trees) if k % 2 == 0 else list(reversed(trees))
        for model, size in models:
            for p in procs:
                for name in order:
                    j = judge(validate(trees[name], caches[name], model, size, args, p))
                    runs.append({"tree": name, "pair": k, "model": model, "procs": p, **j})
                    tag = f"{model} P={p} {name} pair {k + 1}"
                    print(_line(tag, j), flush=True)
    print(f"\n{len(runs)} validate runs in {(time.perf_counter() - t0) / 60:.0f} min\n")
    _summary(runs, models, procs)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def _summary(runs: list[dict], models, procs) -> None:
    """Per (model, P) and tree, the medians over the pairs; the goals judged on them."""
    keys = ("error_median", "error_worst", "speedup_median", "speedup_worst", "pick_over_fastest")
    for model, _ in models:
        for p in procs:
            med = {}
            for tree in ("before", "after"):
                mine = [r for r in runs if (r["model"], r["procs"], r["tree"]) == (model, p, tree)]
                med[tree] = {k: statistics.median(r[k] for r in mine) for k in keys}
                rhos = [r["rho_apart"] for r in mine if r["rho_apart"] is not None]
                med[tree]["rho_apart"] = statistics.median(rhos) if rhos else None
                med[tree]["rho"] = statistics.median(r["rho"] for r in mine if r["rho"] is not None)
                med[tree]["apart"] = statistics.median(r["apart"] for r in mine)
                med[tree]["plans"] = mine[0]["plans"]
                print(_line(f"{model} P={p} {tree}, median of pairs", med[tree]))
            a, b = med["after"], med["before"]
            goals = {
                "speed-up |err| median <= 10 %": a["speedup_median"] <= 0.10,
                "speed-up |err| worst <= 25 %": a["speedup_worst"] <= 0.25,
                "pick within 10 %": a["pick_over_fastest"] <= 1.10,
                "rho >= 0.8 over the plans told apart": (a["rho_apart"] or 0) >= 0.8,
                "time |err| median <= before + 5 points": a["error_median"]
                <= b["error_median"] + 0.05,
            }
            print("  " + "; ".join(f"{g}: {'yes' if ok else 'NO'}" for g, ok in goals.items()))


if __name__ == "__main__":
    main()
