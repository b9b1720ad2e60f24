"""torch.compile and activation checkpointing under hybridpar's plans (issue 41), on this machine.

  compile  for each model and plan (batch, model, domain), `hybridpar train` eager and with
           --compile, interleaved, --rounds times: the median iteration time (the report's,
           first step left out) and its spread, compiled / eager, and the compile time (the
           compiled run's first step less the eager run's)
  memory   for each model under the batch plan, eager and with --activation-checkpointing (what
           CHECKPOINT names), interleaved: a rank's peak resident memory (on a GPU also the
           CUDA allocator's peak) and the iteration time, checkpointed / eager

    python benchmarks/compute.py [--part compile,memory] [--procs 2] [--rounds 2] [--json F]
    python benchmarks/compute.py --device cuda --procs 1 --plans batch   # on a GPU (gpu_check)

Times are medians over rounds of each run's median iteration; spread is max - min over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"alexnet-owt": 64, "resnet20": 32}
MEMORY_SIZES = {"alexnet-owt": 128, "resnet20": 32}  # activations large beside the weights
PLANS = ("batch", "model", "domain")
# what checkpointing recomputes: alexnet-owt's convolutions as one segment of its Sequential,
# each of resnet20's residual blocks
CHECKPOINT = {"alexnet-owt": "0..12", "resnet20": "layer?.?"}


DEVICE = ["--device", "cpu"]  # --device: where every run trains


def train(model: str, size: int, plan: str, procs: int, batch: int, steps: int, *extra) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridpar-compute-") as tmp:
        cmd = [sys.executable, "-m", "hybridpar", "train", "--model", model]
        cmd += f"--input-size {size} --batch {batch} --nproc {procs} --preset {plan}".split()
        # every step a full batch (a smaller last one recompiles the compiled parts): the data
        # keeps a fifth for the test split
        cmd += f"--data synthetic:{batch * steps * 2} --epochs 1 --max-steps {steps}".split()
        cmd += ["--quiet", "--no-progress", "--save", f"{tmp}/w.pt", "--report", f"{tmp}/r.json"]
        cmd += DEVICE
        got = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=os.environ)
        if got.returncode != 0:
            raise SystemExit(f"{' '.join(cmd + list(extra))} failed:\n{got.stderr[-2000:]}")
        r = json.loads(Path(f"{tmp}/r.json").read_text())
    return {
        "time_s": r["iteration"]["time_s"],
        "first_s": r["steps"][0]["time_s"],
        "compiled": len(r["compute"]["compiled"]),
        **r["memory"],
    }


def _header(*columns: str) -> None:
    """A markdown table's header row and rule."""
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))


def _stat(runs: list[dict], key: str) -> tuple[float, float]:
    v = [r[key] for r in runs]
    return statistics.median(v), max(v) - min(v)


def compile_part(args) -> list[dict]:
    rows = []
    # resnet20 with local BN too: global BN's all-reduce between every convolution and the next
    # leaves nothing of more than one operation to compile
    plans = args.plans.split(",")
    cases = [(m, s, p, "global") for m, s in MODELS.items() for p in plans]
    cases += [("resnet20", MODELS["resnet20"], p, "local") for p in plans]
    got: dict = {(c, k): [] for c in cases for k in ("eager", "compiled")}
    for r in range(args.rounds):
        for m, s, p, bn in cases:
            for kind in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
                extra = ["--bn", bn] + (["--compile"] if kind == "compiled" else [])
                got[((m, s, p, bn), kind)].append(
                    train(m, s, p, args.procs, args.batch, args.steps, *extra)
                )
                print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    where = f"inductor ({args.device})"
    print(f"\ncompile: P = {args.procs}, B = {args.batch}, {args.rounds} rounds, {where}")
    _header(
        "model", "plan", "BN", "eager ms (spread)", "compiled ms (spread)", "compiled / eager",
        "compile s", "parts",
    )  # fmt: skip
    for c in cases:
        e, k = got[(c, "eager")], got[(c, "compiled")]
        (te, se), (tk, sk) = _stat(e, "time_s"), _stat(k, "time_s")
        extra = statistics.median(b["first_s"] - a["first_s"] for a, b in zip(e, k, strict=True))
        row = {
            "model": c[0],
            "plan": c[2],
            "bn": c[3],
            "eager_ms": te * 1e3,
            "eager_spread_ms": se * 1e3,
            "compiled_ms": tk * 1e3,
            "compiled_spread_ms": sk * 1e3,
            "ratio": tk / te,
            "compile_s": extra,
            "parts": k[0]["compiled"],
        }
        rows.append(row)
        print(
            f"| {c[0]} | {c[2]} | {c[3]} | {te * 1e3:.1f} ({se * 1e3:.1f}) "
            f"| {tk * 1e3:.1f} ({sk * 1e3:.1f})"
            f" | {tk / te:.2f}x | {extra:.1f} | {row['parts']} |"
        )
    return rows


def memory_part(args) -> list[dict]:
    rows = []
    got: dict = {(m, k): [] for m in MODELS for k in ("eager", "checkpointed")}
    for r in range(args.rounds):
        for m, s in MEMORY_SIZES.items():
            kinds = ("eager", "checkpointed") if r % 2 == 0 else ("checkpointed", "eager")
            for kind in kinds:
                extra = ["--activation-checkpointing", CHECKPOINT[m]] if kind != "eager" else []
                got[(m, kind)].append(
                    train(m, s, "batch", args.procs, args.mem_batch, args.steps, *extra)
                )
                print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    keys = [k for k in got[(next(iter(MODELS)), "eager")][0] if k.startswith("peak_")]
    # growth: the peak less the resident set when the training steps began (the data, the
    # model, the libraries); on a GPU the allocator's peak is the steps' own
    sizes = ", ".join(f"{m} at {s} px" for m, s in MEMORY_SIZES.items())
    print(
        f"\nactivation checkpointing: P = {args.procs}, B = {args.mem_batch}, batch plan, {sizes}"
    )
    _header(
        "model", "recomputed", "peak", "eager MB (growth)", "checkpointed MB (growth)", "saved",
        "ms eager / ckpt",
    )  # fmt: skip
    for m in MODELS:
        e, c = got[(m, "eager")], got[(m, "checkpointed")]
        te, tc = _stat(e, "time_s")[0], _stat(c, "time_s")[0]
        for key in keys:
            me, mc = _stat(e, key)[0], _stat(c, key)[0]
            base = "base_rss_mb" if key == "peak_rss_mb" else None  # what training added
            ge = me - _stat(e, base)[0] if base else me
            gc = mc - _stat(c, base)[0] if base else mc
            rows.append(
                {
                    "model": m,
                    "memory": key,
                    "eager_mb": me,
                    "checkpointed_mb": mc,
                    "eager_growth_mb": ge,
                    "checkpointed_growth_mb": gc,
                    "eager_ms": te * 1e3,
                    "checkpointed_ms": tc * 1e3,
                }
            )
            print(
                f"| {m} | {CHECKPOINT[m]} | {key[5:-3]} | {me:.0f} ({ge:.0f}) | {mc:.0f} ({gc:.0f}) "
                f"| {me - mc:.0f} MB ({(ge - gc) / ge:.0%} of the growth) "
                f"| {te * 1e3:.1f} / {tc * 1e3:.1f} ({tc / te:.2f}x) |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="compile,memory")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="the compile part's global batch")
    ap.add_argument("--mem-batch", type=int, default=256, help="the memory part's global batch")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plans", default=",".join(PLANS), help="the compile part's plans")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    DEVICE[1] = args.device
    out = {}
    if "compile" in args.part:
        out["compile"] = compile_part(args)
    if "memory" in args.part:
        out["memory"] = memory_part(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
