"""Claim: the planner is interactive, and `hybridpar plan` is arithmetic.

- `hybridpar plan` for alexnet on cori-knl at P = 512 answers in under 0.2 s from a cold process
  (CLI wall time, warm analysis cache; the median and spread of 7 runs), without importing torch
  (checked in the same run), and the planning call alone, a process's first, in under 0.1 s;
- `hybridpar simulate` over P = 8..4096 (10 values, every scenario, CSV + 3 PNGs) in under 10 s;
- the per-layer search on a 100-layer model at P = 4096 in under 5 s.

Prints what it measured, with the target next to it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from hybridpar.core.analysis import analyze
from hybridpar.core.cluster import PRESETS
from hybridpar.core.layers import cost_layers
from hybridpar.planning.analysis_cache import zoo_cost_layers
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import make_plan, plan_layers


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def deep_model() -> tuple[nn.Sequential, tuple[int, ...]]:
    """90 3x3 convs (64 -> 256 channels, 56x56 shrinking to 7x7) and a 10-layer FC tail: 100 layers."""
    layers: list[nn.Module] = []
    c = 3
    for i in range(90):
        width = (64, 128, 256, 256)[i // 23]
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
        if i in (22, 45, 68):
            layers.append(nn.MaxPool2d(2))
        c = width
    layers += [nn.AdaptiveAvgPool2d(4), nn.Flatten()]
    d = c * 16
    for _ in range(9):
        layers += [nn.Linear(d, 2048), nn.ReLU()]
        d = 2048
    layers.append(nn.Linear(d, 1000))
    with torch.device("meta"):
        return nn.Sequential(*layers), (3, 56, 56)


def main() -> None:
    py = [sys.executable, "-m", "hybridpar"]
    knl = PRESETS["cori-knl"]
    rows = []

    args = [
        "plan",
        "--model",
        "alexnet",
        "--procs",
        "512",
        "--batch",
        "2048",
        "--cluster",
        "cori-knl",
    ]
    wall(py + args)  # fills the analysis cache
    runs = sorted(wall(py + args) for _ in range(7))
    cli = statistics.median(runs)
    rows.append(("hybridpar plan alexnet P=512 (CLI wall, cold process)", cli, 0.2))
    spread = f"{runs[0]:.3f}-{runs[-1]:.3f} s"
    probe = "import sys, runpy; sys.argv = ['hybridpar', *sys.argv[1:]]\n"
    probe += "try:\n    runpy.run_module('hybridpar', run_name='__main__')\n"
    probe += "except SystemExit:\n    pass\nprint('torch imported:', 'torch' in sys.modules)"
    seen = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
    torch_line = seen.stdout.strip().splitlines()[-1]
    zoo_cost_layers("alexnet")  # read from the cache, as the CLI reads it
    t = time.perf_counter()
    make_plan("alexnet", 512, 2048, knl)  # this process's first plan: nothing memoised yet
    rows.append(("  of which planning, in-process (all 6 scenarios)", time.perf_counter() - t, 0.1))

    procs = ",".join(str(2**k) for k in range(3, 13))
    with tempfile.TemporaryDirectory() as out:
        sim = wall(
            py
            + [
                "simulate",
                "--model",
                "alexnet",
                "--batch",
                "512",
                "--procs",
                procs,
                "--out",
                out,
                "--quiet",
            ]
        )
    rows.append((f"hybridpar simulate alexnet P={procs} (CSV + 3 PNGs)", sim, 10.0))

    model, shape = deep_model()
    layers = cost_layers(analyze(model, shape))
    assert len(layers) == 100, len(layers)
    t = time.perf_counter()
    r = plan_layers(layers, PlanRequest(4096, 8192, knl, scenarios=["per-layer"]))
    dp = time.perf_counter() - t
    rows.append((f"per-layer search, {len(layers)} layers, P=4096 (DP)", dp, 5.0))

    print(f"{'what':<62} {'measured s':>11} {'target s':>9} {'ratio':>7}")
    for name, got, target in rows:
        print(f"{name:<62} {got:11.3f} {target:9.1f} {got / target:6.2f}x")
    print(f"(the CLI over 7 cold runs: {spread}; {torch_line})")
    print(
        f"(per-layer plan found: comm {r.scenario('per-layer').comm_s * 1e3:.2f} ms/iteration; "
        f"{os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
