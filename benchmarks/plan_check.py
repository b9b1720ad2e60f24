"""Claim (issue 71): the plan's check before the first step (runtime/parallel/verify.py) costs at
most 10 % of the first epoch of the README's examples.

Runs `hybridpar train` for one epoch of the README's U-Net on bands and of its default digits
example (the planner's plan on 4 ranks), with the check and with `--no-verify`, `--repeat` times
in turn, and reads from each run's log the check's seconds and the first epoch's; prints their
medians, spread and ratio, and the whole command's wall time both ways (the check makes the
groups the run then reuses, so its net cost is that difference, not its own seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = {
    "U-Net on bands": "--model unet --data digits-seg:128 --batch 2 --nproc 4 --preset domain",
    "digits (default)": "",
}


def one(flags: str, folder: Path, verify: bool) -> tuple[float, float, str, float]:
    report = folder / "r.json"
    cmd = [sys.executable, "-m", "hybridpar", "train", "--quiet", "--no-progress", "--epochs", "1"]
    cmd += [*flags.split(), "--report", str(report), "--save", str(folder / "w.pt")]
    t0 = time.perf_counter()
    subprocess.run(cmd + ([] if verify else ["--no-verify"]), check=True, capture_output=True)
    wall = time.perf_counter() - t0
    log = [json.loads(x) for x in report.with_suffix(".jsonl").read_text().splitlines()]
    check = next((e for e in log if e["event"] == "check"), None)
    epoch = next(e for e in log if e["event"] == "epoch")
    if check is None:
        return 0.0, epoch["time_s"], "", wall
    return check["seconds"], epoch["time_s"], f"{check['batch']} x {check['shape']}", wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    got: dict[tuple[str, bool], list[tuple[float, float, str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for name, flags in EXAMPLES.items():
                for verify in (True, False):
                    got.setdefault((name, verify), []).append(one(flags, Path(tmp), verify))
    print(
        f"{'example':<18} {'check s':>8} {'range':>13} {'epoch 1 s':>10} {'check/epoch':>12} "
        f"{'wall on':>8} {'wall off':>9} {'on/off':>7}  copy"
    )
    for name in EXAMPLES:
        runs, off = got[name, True], got[name, False]
        checks, epochs = [r[0] for r in runs], [r[1] for r in runs]
        c, e = statistics.median(checks), statistics.median(epochs)
        w_on, w_off = (statistics.median(r[3] for r in x) for x in (runs, off))
        spread = f"[{min(checks):.2f}-{max(checks):.2f}]"
        print(
            f"{name:<18} {c:8.2f} {spread:>13} {e:10.2f} {c / e:11.1%} {w_on:8.2f} {w_off:9.2f} "
            f"{w_on / w_off:6.3f}x  {runs[0][2]}"
        )


if __name__ == "__main__":
    main()
