"""Each blocking meeting's wait, priced against measured, per term (issue 42: where the waits go).

Runs plan files as `hybridpar train --plan` does (the same Job, trainer and optimizer, random
batches of the model's shape) and reads every blocking call of the timed steps from each rank's
ledger: a call's wait is its time on a rank less the shortest any rank saw (as the report
splits it). Beside it, the cost model's meetings (planning.cost.sync.meetings) with the
compute priced before each and the wait `Cluster.sync_cost` gives it. Prints per term: the
meetings per iteration, the compute before them, the mean wait per meeting and the totals.

    python benchmarks/meeting_waits.py PLAN.json [PLAN.json ...] [--steps 12] [--cluster localhost]
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
import torch.distributed as dist
from layer_times import plan_args, plan_job, priced

from hybridpar.planning.cost import sync
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel.trainer import BLOCKING_TERMS
from hybridpar.runtime.train.loop import make_trainer

WARMUP = 4


def _body(job, steps: int) -> list:
    trainer = make_trainer(job, job.plan)
    for _ in range(WARMUP + steps):
        x = torch.randn(job.plan.batch, *job.input_shape)
        trainer.step(x, torch.randint(0, job.num_classes, (job.plan.batch,)))
    timed = sorted({e.step for e in trainer.ledger.entries})[-steps:]
    mine, count = {}, defaultdict(int)
    for e in trainer.ledger.entries:
        if e.step in timed and e.term in BLOCKING_TERMS:
            mine[(e.step, count[e.step])] = (str(e.term), e.seconds)
            count[e.step] += 1
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def main() -> int:
    args = plan_args(__doc__, steps=12)
    for path in args.plans:
        job = plan_job(path, args.cluster)
        plan, (cost, cluster, _) = job.plan, priced(job)
        at = cluster.at(plan.procs).placed(plan.placement)
        predicted = defaultdict(list)
        for term, before in sync.meetings(cost.layers)[0]:
            predicted[term].append((before, at.sync_cost(before)[1]))
        every = launch(_body, job.procs, job, args.steps, backend="gloo")[0]
        measured = defaultdict(list)
        for key, (term, _) in every[0].items():
            secs = [table[key][1] for table in every if key in table]
            measured[term].append(statistics.fmean(s - min(secs) for s in secs))
        print(f"{path}: {plan.procs} ranks, {args.steps} steps; per iteration, ms")
        print(f"  {'term':14s} | priced: meetings  before  wait each  total "
              f"| measured: meetings  wait each  total")  # fmt: skip
        for term in sorted(set(predicted) | set(measured)):
            p, m = predicted.get(term, []), measured.get(term, [])
            before = 1e3 * statistics.fmean(b for b, _ in p) if p else 0.0
            pw = 1e3 * statistics.fmean(w for _, w in p) if p else 0.0
            mw = 1e3 * statistics.fmean(m) if m else 0.0
            n = len(m) / args.steps
            print(f"  {term:14s} | {len(p):16d} {before:7.2f} {pw:10.3f} {len(p) * pw:6.2f} "
                  f"| {n:18.1f} {mw:10.3f} {n * mw:6.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
