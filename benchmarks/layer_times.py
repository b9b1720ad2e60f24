"""Each layer's compute, measured against its prediction (issue 42: where a plan's time goes).

Runs plan files as `hybridpar train --plan` does (the same Job, trainer and optimizer, random
batches of the model's shape) and times, on every rank, each layer's forward and backward in
thread CPU time with the collectives' own CPU taken out:
- forward: from one weighted layer's call to the next (its batch norm, activation and residual
  add ride along, as the cost model groups them, with the hand-off into the next layer); the
  last one's ends at the model's output, and the loss after it has a row of its own;
- backward: from the gradient of one weighted layer's input to the next one's.
Thread CPU time leaves out the time a rank waits for a core, so on a host with more ranks than
cores it compares with the cost model's time alone (its prediction over the contention factor).
Prints per layer measured, predicted and their ratio, and the totals; the mean over ranks.

    python benchmarks/layer_times.py PLAN.json [PLAN.json ...] [--steps 24] [--cluster localhost]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from hybridpar.core.config import build
from hybridpar.core.handoff import Handoff
from hybridpar.planning.request import PlanRequest
from hybridpar.runtime.comm import collectives, small
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel import domain
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.loop import make_trainer
from hybridpar.runtime.train.plans import pricing_cluster, settled_compute
from hybridpar.runtime.train.run import prepare

WEIGHTED = ("Conv2d", "Linear")  # a layer starts at its weighted module (the cost model's layers)
WARMUP = 4
AFTER = "<the loss, after the model>"


class _Clock:
    """Thread CPU seconds, less what the wrapped collectives took (`comm`)."""

    def __init__(self) -> None:
        self.comm, self.depth, self.events = 0.0, 0, []

    def now(self) -> float:
        return time.thread_time() - self.comm

    def wrap(self, owner, name: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kwargs):
            if self.depth:
                return f(*args, **kwargs)
            self.depth, t0 = 1, time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                self.depth = 0
                self.comm += time.thread_time() - t0

        setattr(owner, name, timed)


def _body(job, steps: int) -> dict:
    clock = _Clock()
    for n in ("begin", "finish", "small_all_reduce", "all_gather", "reduce_scatter"):
        clock.wrap(small.SmallReducer, n)
    for n in ("post", "arrived", "send_back", "take_back"):
        clock.wrap(domain.Exchange, n)
    for n in ("all_reduce", "all_gather", "all_to_all_single", "all_gather_into_tensor"):
        clock.wrap(dist, n)
    clock.wrap(collectives.Pending, "wait")
    trainer = make_trainer(job, job.plan)
    names = {id(m): n for n, m in trainer.model.named_modules()}
    events = clock.events

    def mark(what: str):
        return lambda grad: events.append((what, clock.now()))

    def pre(module, args):
        kind = type(module).__name__
        if torch.is_grad_enabled() and any(kind.endswith(w) for w in WEIGHTED):
            name = names.get(id(module), "?").removeprefix("module.")
            events.append(("F:" + name, clock.now()))
            x = args[0]
            (x if x.requires_grad else module.weight).register_hook(mark("B:" + name))

    torch.nn.modules.module.register_module_forward_pre_hook(pre)

    # the backward starts at the gradient of the model's output
    def output(module, args, out) -> None:
        events.append(("F:" + AFTER, clock.now()))  # the loss: no layer's, and not priced
        out.register_hook(mark("B:<out>"))

    trainer.model.register_forward_hook(output)
    shape, B = job.input_shape, job.plan.batch
    forward, backward = defaultdict(float), defaultdict(float)
    whole = {}  # a step's wall, thread CPU and collectives' CPU
    for step in range(WARMUP + steps):
        if step == WARMUP:
            dist.barrier()
            whole = {"wall": time.perf_counter(), "cpu": time.thread_time(), "comm": clock.comm}
        x, y = torch.randn(B, *shape), torch.randint(0, job.num_classes, (B,))
        events.clear()
        events.append(("start", clock.now()))
        trainer.step(x, y)
        if step < WARMUP:
            continue
        fwd = [e for e in events if e[0].startswith(("F:", "start"))][1:]
        bwd = [e for e in events if e[0].startswith("B:")]
        ends = fwd[1:] + bwd[:1]
        for (name, t0), (_, t1) in zip(fwd, ends, strict=True):
            forward[name[2:]] += (t1 - t0) / steps
        for (_, t0), (name, t1) in itertools.pairwise(bwd):
            backward[name[2:]] += (t1 - t0) / steps
    dist.barrier()
    now = {"wall": time.perf_counter(), "cpu": time.thread_time(), "comm": clock.comm}
    forward.update({f"<{k}>": (now[k] - whole[k]) / steps for k in now})
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dict(forward), dict(backward)))
    mean = {}
    for name in every[0][0]:
        f = statistics.fmean(e[0].get(name, 0.0) for e in every)
        b = statistics.fmean(e[1].get(name, 0.0) for e in every)
        mean[name] = (f, b)
    return mean


def plan_args(doc: str, steps: int) -> argparse.Namespace:
    """PLAN.json ... [--steps N] [--cluster NAME], the command line of a script over plan files."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--cluster", default="localhost")
    return ap.parse_args()


def plan_job(path: str, cluster: str):
    """The Job `hybridpar train --plan PATH` runs (random batches of the model's shape)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build(TrainConfig, plan=path, cluster=cluster, data="synthetic:64",
                    save=f"{tmp}/w.pt")  # fmt: skip
        return prepare(cfg)


def priced(job):
    """(the job's plan priced as `hybridpar train` prices it, its cluster, its compute model)."""
    from hybridpar.planning.search import evaluate

    plan = job.plan
    cluster = pricing_cluster(job, True)
    compute = settled_compute(job, cluster)
    styles = [job.layout.styles[x.name] for x in job.layers]
    handoffs = {r.layer: Handoff(r.scheme, r.rounds) for r in plan.redistributions}
    out = evaluate(job.layers, styles, PlanRequest(plan.procs, plan.batch, cluster, choices=plan.choices, compute=compute), handoffs=handoffs, placement=plan.placement)  # fmt: skip
    return out, cluster, compute


def _predicted(job) -> tuple[dict, float]:
    """{layer: (forward, backward) s alone} of the plan as `hybridpar train` prices it, and the
    contention factor it was priced with."""
    plan, _, compute = priced(job)
    c = compute.contention if compute is not None else 1.0
    return {x.layer.name: (x.forward_s / c, x.backward_s / c) for x in plan.layers}, c


def main() -> int:
    args = plan_args(__doc__, steps=24)
    for path in args.plans:
        job = plan_job(path, args.cluster)
        predicted, c = _predicted(job)
        measured = launch(_body, job.procs, job, args.steps, backend="gloo")[0]
        print(f"{path}: {job.procs} ranks, contention factor {c:g}; ms a step, thread CPU")
        print(f"  {'layer':18s} {'style':12s} | forward  pred  ratio | backward  pred  ratio")
        totals = [0.0] * 4
        for layer in job.layers:
            name, style = layer.name, job.layout.styles[layer.name].label
            mf, mb = (1e3 * v for v in measured.get(name, (0.0, 0.0)))
            pf, pb = (1e3 * v for v in predicted[name])
            totals = [a + b for a, b in zip(totals, (mf, pf, mb, pb), strict=True)]
            rf, rb = (m / p if p else float("nan") for m, p in ((mf, pf), (mb, pb)))
            print(f"  {name:18s} {style:12s} | {mf:7.2f} {pf:5.2f} {rf:6.2f} | "
                  f"{mb:8.2f} {pb:5.2f} {rb:6.2f}")  # fmt: skip
        after = 1e3 * measured.get(AFTER, (0.0, 0.0))[0]
        print(f"  {AFTER:31s} | {after:7.2f}     -      - |")
        wall, cpu, comm = (1e3 * measured[f"<{k}>"][0] for k in ("wall", "cpu", "comm"))
        print(
            f"  a step: wall {wall:.1f}, a rank's thread CPU {cpu:.1f}, of it collectives {comm:.1f}"
        )
        mf, pf, mb, pb = totals
        print(f"  {'total':31s} | {mf:7.2f} {pf:5.2f} {mf / pf:6.2f} | "
              f"{mb:8.2f} {pb:5.2f} {mb / pb:6.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
