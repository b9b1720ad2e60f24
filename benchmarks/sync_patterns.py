"""Which work should the sync table be timed with? (issue 42, item 3)

The calibration's sync table (`calibration._time_sync`) times P ranks that share the cores doing
W 256 x 256 matrix products and then meeting (the shared-memory all-reduce the runtime's global
batch norm and halos wait in), W = 1 .. 64, against the same work with the cores to themselves.
A model's step meets after other work: its own leaves. This benchmark measures, in one launch of
P ranks, both tables side by side, rounds interleaved:

  matmul      the calibration's table, as `hybridpar calibrate` measures it
  <model>     the model's own training iteration on --samples examples, with a meeting after
              every k-th leaf event (a leaf's forward, or its output's gradient), k = 1 .. 32 and
              once an iteration; "alone" is the iteration with as many ranks at once as there
              are cores (as the compute profile measures it), each segment its share

and prints, per row, the work alone per segment, the wall per segment beyond a meeting back to
back, their ratio (x2 is what the contention factor of 4 ranks on 2 cores prices) and the mean
wait. With --reprice DIR (runs kept by `validate_orders.py --keep`), it also prices each kept
validate run again with its own cached table and with the model's table at the same P, against
the same measured times: median and worst |error| and the pick, both ways.

    python benchmarks/sync_patterns.py [--models resnet20:32,alexnet-owt:64] [--procs 4]
        [--samples 8] [--rounds 2] [--reprice DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.core.cluster import rank_threads
from hybridpar.core.models import build_any
from hybridpar.planning.profile import _iteration, busy_ranks, no_inplace
from hybridpar.runtime.comm.grid import new_group
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.train.calibration import _time_sync
from hybridpar.runtime.train.report import split_waits

EVERY = (1, 2, 4, 8, 16, 32, 0)  # a meeting after every k-th leaf event; 0: once an iteration
ITERATIONS = 8


def _model_rows(model: str, shape: tuple[int, ...], n: int, group) -> list[list[float]]:
    """[alone s, wall s, wait s] per segment for each k in EVERY, as _time_sync's rows: the
    segment's work alone, the wall and the mean wait for the slowest beyond a meeting back to
    back. Collective over `group`."""
    p, me = dist.get_world_size(group.pg), dist.get_rank(group.pg)
    cores = os.cpu_count() or 1
    busy = busy_ranks(cores, p, rank_threads(cores, p))
    flag, calls = torch.zeros(1, dtype=torch.float64), []

    def meet() -> None:
        t = time.perf_counter()
        group.shm.small_all_reduce(flag)
        calls.append(time.perf_counter() - t)

    torch.manual_seed(0)
    net = build_any(model, shape, None)
    no_inplace(net)
    x = torch.randn(n, *shape)
    with torch.no_grad():
        y = torch.randint(0, net(x[:1]).shape[-1], (n,))
    state = {"k": 0, "i": 0}

    def event() -> None:
        if state["k"]:
            state["i"] += 1
            if state["i"] % state["k"] == 0:
                meet()

    def hook(module, args, out) -> None:
        event()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: event())

    for m in net.modules():
        if next(iter(m.children()), None) is None:
            m.register_forward_hook(hook)
    alone = 0.0
    for first in range(0, p, busy):  # `busy` ranks at once, as the profile measures
        dist.barrier(group=group.pg)
        if first <= me < first + busy:
            _iteration(net, x, y)
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                _iteration(net, x, y)
                ts.append(time.perf_counter() - t0)
            alone = statistics.median(ts)
    mine = {}
    for k in (None, *EVERY):  # None: meetings back to back, the reference
        state.update(k=k or 0, i=0)
        for _ in range(2 if k is not None else 20):  # warm up
            if k is not None:
                _iteration(net, x, y)
            meet()
        dist.barrier(group=group.pg)
        calls.clear()
        t0 = time.perf_counter()
        for _ in range(ITERATIONS if k is not None else 200):
            if k is not None:
                _iteration(net, x, y)
            meet()
        mine[k] = (time.perf_counter() - t0, list(calls))
    every: list = [None] * p
    dist.all_gather_object(every, (alone, mine), group=group.pg)
    a = statistics.fmean(e[0] for e in every)

    def per_meeting(k):
        m = len(every[0][1][k][1])
        wall = statistics.fmean(e[1][k][0] for e in every) / m
        _, waits = split_waits([dict(enumerate(e[1][k][1])) for e in every])
        return m, wall, waits / (p * m)

    _, wall0, wait0 = per_meeting(None)
    rows = []
    for k in EVERY:
        m, wall, wait = per_meeting(k)
        rows.append([a * ITERATIONS / m, wall - wall0, max(0.0, wait - wait0)])
    return sorted(rows)


def _body(models: list[tuple[str, int]], n: int, rounds: int) -> dict:
    torch.set_num_threads(rank_threads(os.cpu_count() or 1, dist.get_world_size()))
    everyone = list(range(dist.get_world_size()))
    group = new_group(everyone, None, "hybridpar_world", "world", shm=True)
    out: dict = {"matmul": []}
    for _ in range(rounds):  # interleaved: the machine's drift spread over both
        out["matmul"].append(_time_sync(group))
        for model, size in models:
            rows = _model_rows(model, (3, size, size), n, group)
            out.setdefault(model, []).append(rows)
    return out


def _mean_rows(tables: list[list[list[float]]]) -> list[list[float]]:
    return [
        [statistics.fmean(col) for col in zip(*rows, strict=True)]
        for rows in zip(*tables, strict=True)
    ]


def _show(name: str, rows: list[list[float]], spread: list[float]) -> None:
    print(f"{name}:")
    print("      alone/segment   wall/segment     wall/alone   wait   (spread of wall/alone)")
    for (a, w, x), s in zip(rows, spread, strict=True):
        print(f"  {a * 1e3:12.3f} ms {w * 1e3:12.3f} ms {w / a:12.2f}x {x * 1e3:7.3f} ms  {s:5.2f}")


def _reprice(folder: Path, procs: int, tables: dict[str, list]) -> None:
    """Each kept run priced with its own cached table, with the matmul table measured now (the
    machine's drift since the run) and with the model's table measured now (the pattern)."""
    for run in sorted(p for p in folder.iterdir() if (p / "cache" / "localhost.json").exists()):
        model = next((m for m in tables if m != "matmul" and run.name.startswith(m + "-")), None)
        if model is None:
            continue
        line = [run.name]
        for label, rows in (
            ("its table", None),
            ("matmul now", tables["matmul"]),
            (f"{model} now", tables[model]),
        ):
            with tempfile.TemporaryDirectory() as tmp:
                shutil.copytree(run / "cache", f"{tmp}/cache")
                if rows is not None:
                    path = Path(tmp, "cache", "localhost.json")
                    data = json.loads(path.read_text())
                    data["by_procs"][str(procs)]["sync"] = rows
                    path.write_text(json.dumps(data))
                env = {**os.environ, "HYBRIDPAR_CACHE": f"{tmp}/cache"}
                cmd = [sys.executable, __file__, "--price-run", str(run / "v")]
                got = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line.append(f"{label}: {got.stdout.strip() or got.stderr.strip()[-200:]}")
        print("  " + " | ".join(line))


def _price_run(folder: Path) -> str:
    """Validate's plan files in `folder` priced again on localhost (HYBRIDPAR_CACHE) against the
    times that run measured: "median / worst |error| / pick vs the fastest"."""
    from hybridpar.core.config import build
    from hybridpar.runtime.train.config import TrainConfig
    from hybridpar.runtime.train.run import prepare

    rows = json.loads((folder / "validate.json").read_text())["plans"]
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for row, plan in zip(rows, sorted((folder / "plans").glob("*.json")), strict=True):
            cfg = build(
                TrainConfig,
                plan=str(plan),
                cluster="localhost",
                data="synthetic:64",
                save=f"{tmp}/w.pt",
            )
            pairs.append((prepare(cfg).plan.totals["total_s"], row["measured"]["total_s"]))
    errors = [abs(p / m - 1) * 100 for p, m in pairs]
    pick = min(pairs)[1] / min(m for _, m in pairs)
    return f"{statistics.median(errors):.1f} % / {max(errors):.1f} % / {pick:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet20:32,alexnet-owt:64")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8, help="examples a rank's iteration runs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reprice", help="price the runs kept by validate_orders.py --keep again")
    ap.add_argument("--price-run", help=argparse.SUPPRESS)  # one kept run, in a fresh process
    args = ap.parse_args()
    if args.price_run:
        print(_price_run(Path(args.price_run)))
        return 0
    models = [(m, int(s)) for m, s in (x.split(":") for x in args.models.split(","))]
    t0 = time.perf_counter()
    out = launch(_body, args.procs, models, args.samples, args.rounds, backend="gloo")[0]
    print(
        f"P = {args.procs} on {os.cpu_count()} cores, {args.rounds} rounds interleaved, "
        f"{time.perf_counter() - t0:.0f} s"
    )
    means = {}
    for name, tables in out.items():
        means[name] = rows = _mean_rows(tables)
        ratios = [[w / a for a, w, _ in t] for t in tables]
        spread = [max(r) - min(r) for r in zip(*ratios, strict=True)]
        _show(name, rows, spread)
    if args.reprice:
        print(f"validate's kept runs ({args.reprice}) priced both ways (median / worst / pick):")
        _reprice(Path(args.reprice), args.procs, means)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
