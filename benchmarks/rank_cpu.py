"""Where a rank's CPU goes, beside what its plan prices (issue 42: what the domain plans miss).

Runs plan files as `hybridpar train --plan` does (the same Job, trainer and optimizer, random
batches of the model's shape). On every rank, over --steps timed steps: the step's wall and the
rank's thread CPU, and the aten operators a step dispatches (counted over 2 more steps under a
TorchDispatchMode). On rank 0, where `perf` can sample this process, its main thread's CPU
samples (`perf record -e cpu-clock`) over the same steps, by library: oneDNN's JIT kernels,
libtorch, the interpreter, the kernel, libc. Plans run in turn, --rounds times, so a drift of the
machine hits all of them; each prints its rounds' median and spread.

Beside the measurements, the plan as `hybridpar train` prices it: its time a step, and of it the
compute alone (the profile's, before the contention factor) and the exposed communication. On
a host with more ranks than cores the cores never idle, so a step's wall is about the ranks'
CPU over the cores: a rank's CPU beyond the priced compute alone and communication is work
the cost model does not know about.

    python benchmarks/rank_cpu.py PLAN.json [PLAN.json ...] [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.core.config import build
from hybridpar.core.handoff import Handoff
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.loop import make_trainer
from hybridpar.runtime.train.plans import pricing_cluster, settled_compute
from hybridpar.runtime.train.run import prepare

FREQ = 1999  # perf samples a second
LIBS = [  # (label, pattern in perf's dso column), the first match wins
    ("oneDNN JIT kernels", r"\[JIT\]"),
    ("libtorch_cpu", r"libtorch_cpu"),
    ("python interpreter", r"libpython"),
    ("kernel", r"\[kernel"),
    ("libc (malloc, memcpy)", r"libc\.so"),
    ("torch python bindings", r"libtorch_python"),
    ("hybridpar C kernels", r"hybridpar"),
]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _perf(pid: int, out: str) -> subprocess.Popen | None:
    """`perf record` of this process's CPU, or None where perf cannot sample it."""
    if shutil.which("perf") is None:
        return None
    cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(FREQ), "-p", str(pid), "-o", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # perf attaches
    return proc if proc.poll() is None else None


def _by_library(data: str, tid: int, steps: int) -> dict[str, float] | None:
    """ms a step of thread `tid` by library, from a perf.data file."""
    cmd = ["perf", "report", "-i", data, "--tid", str(tid), "--stdio", "-n", "--sort", "dso"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(.*)", line)
        if m:
            label = next((k for k, p in LIBS if re.search(p, m.group(2))), "other")
            out[label] += 1e3 * int(m.group(1)) / FREQ / steps
    return dict(out) or None


def _body(job, steps: int) -> dict:
    trainer = make_trainer(job, job.plan)
    shape, B = job.input_shape, job.plan.batch

    def step() -> None:
        trainer.step(torch.randn(B, *shape), torch.randint(0, job.num_classes, (B,)))

    for _ in range(4):
        step()
    ops = _Ops()
    with ops:
        for _ in range(2):
            step()
    with tempfile.TemporaryDirectory() as tmp:
        perf = _perf(os.getpid(), f"{tmp}/perf.data") if dist.get_rank() == 0 else None
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            step()
        dist.barrier()
        wall, cpu = (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps
        libs = None
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait()
            libs = _by_library(f"{tmp}/perf.data", os.getpid(), steps)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (cpu, ops.n / 2))
    return {"wall": wall, "cpu": [c for c, _ in every], "ops": [n for _, n in every], "libs": libs}


def _priced(job) -> tuple[float, float, float]:
    """(step, compute alone, exposed communication) seconds, as `hybridpar train` prices it."""
    plan = job.plan
    cluster = pricing_cluster(job, True)
    compute = settled_compute(job, cluster)
    priced = evaluate(job.layers, [job.layout.styles[x.name] for x in job.layers], PlanRequest(plan.procs, plan.batch, cluster, choices=plan.choices, compute=compute), placement=plan.placement, handoffs={r.layer: Handoff(r.scheme, r.rounds) for r in plan.redistributions})  # fmt: skip
    c = compute.contention if compute is not None else 1.0
    return priced.total_s, priced.compute_s / c, priced.exposed_comm_s


def _spread(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):6.1f} ({1e3 * min(xs):.1f}-{1e3 * max(xs):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    jobs = {}
    for path in args.plans:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = build(TrainConfig, plan=path, data="synthetic:64", save=f"{tmp}/w.pt")
            jobs[path] = prepare(cfg)
    runs = defaultdict(list)
    for _ in range(args.rounds):
        for path, job in jobs.items():
            runs[path].append(launch(_body, job.procs, job, args.steps, backend="gloo")[0])
    if all(r["libs"] is None for rs in runs.values() for r in rs):
        print("perf cannot sample here (not installed, or not allowed): no split by library")
    print(f"{args.rounds} rounds of {args.steps} steps; ms a step, median (min-max over rounds)")
    for path, job in jobs.items():
        rs, (total, alone, comm) = runs[path], _priced(job)
        cpu = [statistics.fmean(r["cpu"]) for r in rs]
        lo, hi = min(min(r["cpu"]) for r in rs), max(max(r["cpu"]) for r in rs)
        ops = sorted({round(n) for r in rs for n in r["ops"]})
        print(f"{path}: {job.procs} ranks on {os.cpu_count()} cores")
        print(f"  wall           {_spread([r['wall'] for r in rs])}   priced {1e3 * total:.1f}")
        print(f"  a rank's CPU   {_spread(cpu)}   (ranks {1e3 * lo:.1f}-{1e3 * hi:.1f})")
        print(f"  priced alone   compute {1e3 * alone:.1f}, exposed communication {1e3 * comm:.1f}")
        print(f"  aten ops       {ops[0]}-{ops[-1]} a step (by rank)")
        libs = Counter()
        got = [r["libs"] for r in rs if r["libs"]]
        for lib in {k for g in got for k in g}:
            libs[lib] = statistics.median(g.get(lib, 0.0) for g in got)
        if libs:
            print(f"  rank 0's main thread, sampled: {sum(libs.values()):.1f}")
            for lib, ms in libs.most_common():
                print(f"    {lib:24s} {ms:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
