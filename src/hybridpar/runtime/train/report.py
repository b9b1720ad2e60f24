"""The training report: the plan that ran, what it predicted and what the ledger measured, per term
and per (layer, term), as JSON and a PNG of the curves. This is where the two halves meet."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch.distributed as dist

from hybridpar.core.groups import batch_groups, placed
from hybridpar.core.plan import ParallelPlan
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.ledger import Ledger

__all__ = ["measured", "predicted", "report", "strict", "waiting", "write_report"]

UNPREDICTED = (
    Term.METRICS,
    Term.CODEC_OVERHEAD,
    Term.BN_SWITCH,
    Term.PARAM_BROADCAST,
    Term.STATE,
    Term.RECOMPUTE,
)


def measured(ledger: Ledger, steps: set[int]) -> dict:
    """Bytes per rank per iteration over the full-batch `steps`, averaged over the ranks (uneven
    shards make them differ a little), by term and by (layer, term). Collective: every rank."""
    n = max(1, len(steps))
    timed = steps - {min(steps, default=0)}  # as the iteration times: the first step left out
    mine = (
        ledger.bytes_by_term(steps),
        ledger.bytes_by_layer_term(steps),
        ledger.seconds_by_term(timed),
    )
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # one small object, outside the measured steps
    by_term: dict[str, float] = {}
    by_layer: dict[tuple[str, str], float] = {}
    seconds: dict[str, float] = {}
    for terms, layers, secs in every:
        for k, v in terms.items():
            by_term[str(k)] = by_term.get(str(k), 0.0) + v / n / len(every)
        for (layer, term), v in layers.items():
            key = (layer, str(term))
            by_layer[key] = by_layer.get(key, 0.0) + v / n / len(every)
        for k, v in secs.items():
            seconds[str(k)] = seconds.get(str(k), 0.0) + v / max(1, len(timed)) / len(every)
    return {"by_term": by_term, "by_layer": by_layer, "seconds": seconds}


def waiting(ledger: Ledger, steps: set[int], terms: tuple[str, ...]) -> dict[str, float]:
    """How the blocking collectives' time splits, per iteration averaged over `steps` and the
    ranks: `transfer_s`, what the collective itself took (for each call, the shortest duration
    any rank saw: the last rank to arrive waits for nobody), and `slowest_s`, the rest, spent
    waiting for the slowest rank to arrive. The n-th blocking call of a step is the same layer's
    on every rank (in its own group). Collective: every rank."""
    mine: dict[tuple[int, int], float] = {}
    count: dict[int, int] = {}
    for e in ledger.entries:
        if e.step in steps and e.term in terms:
            k = count.get(e.step, 0)
            count[e.step] = k + 1
            mine[(e.step, k)] = e.seconds
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    transfer, slowest = split_waits(every)
    n = max(1, len(steps)) * len(every)
    return {"transfer_s": transfer / n, "slowest_s": slowest / n}


def split_waits(every: list[dict]) -> tuple[float, float]:
    """(transfer, waiting) seconds summed over the ranks and calls of a collective timed on every
    rank (`every`: each rank's {call: seconds}): for each call, the shortest duration any rank
    saw is the transfer (the last rank to arrive waits for nobody), the rest of each rank's is
    waiting for the slowest. The report's split and the calibration's sync table both take it."""
    fastest: dict = {}
    for table in every:
        for key, sec in table.items():
            fastest[key] = min(sec, fastest.get(key, sec))
    transfer = sum(fastest[key] for table in every for key in table)
    slowest = sum(sec - fastest[key] for table in every for key, sec in table.items())
    return transfer, slowest


def host_layout(names: list[str]) -> dict:
    """How the ranks sat on hosts (`names`: each rank's host, in rank order): how many hosts,
    the ranks on each, whether they were numbered host by host (as torchrun numbers them and as
    core.groups and a two-level cluster assume) and whether every host ran as many."""
    blocks: list[list[str]] = []
    for n in names:
        if blocks and blocks[-1][0] == n:
            blocks[-1].append(n)
        else:
            blocks.append([n])
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return {
        "count": len(counts),
        "ranks": counts,
        "node_by_node": len(blocks) == len(counts),
        "even": len(set(counts.values())) == 1,
    }


def predicted(
    plan: ParallelPlan, hosts: list[str] | None = None, order: list[int] | None = None
) -> tuple[dict, dict]:
    """The plan's bytes by term and by (layer, term). With the host reducer (`hosts`: each rank's
    host, in rank order) a layer's gradient sum goes through shared memory within a host, and the
    first rank of its group on each of the H hosts the group spans all-reduces: per rank of a
    group of G, on average 2(H-1)/H n * H/G instead of 2(G-1)/G n, averaged over the layer's
    groups (the batch groups of its grid: ranks c Pr + r for one r, on the ranks listed host by
    host in `order` where the runtime followed the hosts: core.groups.host_order)."""
    by_term, by_layer = plan.predicted_bytes(), plan.predicted_bytes(by_layer=True)
    if plan.choices.reducer != "host":
        return by_term, by_layer
    names = hosts or ["localhost"] * plan.procs
    styles = {k: s for k, s in plan.styles.items()}

    def factor(layer: str) -> float:
        s = styles.get(layer)
        pr, pc = (s.pr, s.pc) if s is not None and s.kind == "model" else (1, plan.procs)
        if s is not None and s.kind == "domain":
            pr, pc = 1, plan.procs  # whole weights on every rank: one group of all P
        if pc <= 1:
            return 0.0
        groups = placed(batch_groups(pr, pc), plan.placement, order)
        spans = [len({names[k] for k in g}) for g in groups]
        return sum(h - 1 for h in spans) / len(spans) / (pc - 1)

    by_layer = {
        k: v * factor(k[0]) if k[1] == Term.DW_ALLREDUCE else v for k, v in by_layer.items()
    }
    dw = math.fsum(v for k, v in by_layer.items() if k[1] == Term.DW_ALLREDUCE)
    by_term = {k: dw if k == Term.DW_ALLREDUCE else v for k, v in by_term.items()}
    return by_term, by_layer


def report(
    job,
    plan: ParallelPlan,
    data_name: str,
    epochs: list[dict],
    times: dict,
    bytes_measured: dict,
    hosts: list[str] | None,
    bn_switch,
    split: dict | None = None,
    order: list[int] | None = None,
) -> dict:
    cfg = job.cfg
    pred_term, pred_layer = predicted(plan, hosts, order)
    layers: dict[str, dict[str, dict[str, float]]] = {}
    tables = (("measured", bytes_measured["by_layer"]), ("predicted", pred_layer))
    for source, table in tables if plan.engine != "ddp" else ():  # DDP's buckets name no layers
        for (layer, term), v in table.items():
            if term not in UNPREDICTED:
                row = layers.setdefault(layer, {}).setdefault(
                    term, {"measured": 0.0, "predicted": 0.0}
                )
                row[source] = v
    return {
        "procs": job.procs,
        "preset": cfg.preset if cfg.plan is None else None,
        "plan_file": cfg.plan,
        "plan": plan.to_dict(),
        "model": job.model,
        "data": data_name,
        "config": job.config(),
        "epochs": epochs,
        "final": {"test_acc": epochs[-1]["test_acc"], "loss": epochs[-1]["loss"]},
        "iteration": _iteration(times, split, plan),
        "bytes": {"measured": bytes_measured["by_term"], "predicted": pred_term},
        # seconds per iteration each term kept a rank in its collectives, averaged over the ranks
        # (an asynchronous call's: launch to completion; a split-phase one's, as a hand-off's
        # rounds: the time not hidden behind the work between its start and its wait)
        "seconds": bytes_measured.get("seconds", {}),
        "bytes_by_layer": layers,
        "reducer": plan.choices.reducer,
        "bn": {"requested": plan.choices.bn, **(bn_switch.record() if bn_switch else {})},
    }


def _iteration(times: dict, split: dict | None, plan: ParallelPlan) -> dict:
    """The median iteration measured, split as the plan predicts it, next to the prediction."""
    med = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
    comm = med["wait_s"] + med["blocking_s"]
    return {
        "steps": len(times.get("time_s", ())),  # measured here (0: nothing left to train)
        "time_s": med["time_s"],
        "compute_s": max(0.0, med["time_s"] - comm),
        "comm_wait_s": comm,
        # the blocking collectives' part of comm_wait_s (means, not medians): moving the data,
        # and waiting for the slowest rank to arrive (runtime.train.report.waiting)
        **(
            {
                "blocking_transfer_s": split["transfer_s"],
                "waiting_slowest_s": split["slowest_s"],
                # the hand-offs alone (redistribute): what was not hidden, and the wait for
                # the slowest rank they absorb (the first point the ranks meet after the trunk)
                "handoff_exposed_s": split["handoff"]["transfer_s"],
                "handoff_waiting_slowest_s": split["handoff"]["slowest_s"],
            }
            if split
            else {}
        ),
        "predicted_s": plan.totals.get("total_s"),
        "predicted_compute_s": plan.totals.get("compute_s"),
        "predicted_comm_s": plan.totals.get("comm_s"),
        "predicted_waiting_s": plan.totals.get("waiting_s"),
    }


def strict(x):
    """NaN and infinities as null: the report and the log are strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict(v) for v in x]
    return x


def write_report(report: dict, path: str | Path) -> tuple[Path, Path | None]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict(report), indent=1, allow_nan=False))
    png = path.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path, None
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(9, 6.4))
    _plot_training(a, b, report)
    _plot_costs(c, d, report)
    plan = report["plan"]
    fig.suptitle(
        f"{report.get('model')} on {report.get('data')}: P={report['procs']}, "
        f"{plan['scenario']} plan ({plan['engine']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return path, png


def _plot_training(a, b, report: dict) -> None:
    """The loss (per step for a run of a few epochs) and the accuracies per epoch."""
    ep, steps = report["epochs"], report.get("steps") or []
    if len(ep) <= 3 and steps:  # a few epochs are a few dots: the steps instead
        a.plot([s["step"] for s in steps], [s["loss"] for s in steps], lw=1)
        a.set_xlabel("step (loss on rank 0's examples)")
    else:
        a.plot([e["epoch"] for e in ep], [e["loss"] for e in ep], marker="o", ms=3)
        a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    losses = [y for line in a.get_lines() for y in line.get_ydata() if y > 0]
    if losses and max(losses) > 10 * min(losses):
        a.set_yscale("log")
    xs = [e["epoch"] for e in ep]
    b.plot(xs, [e["train_acc"] for e in ep], marker="o", ms=3, label="train")
    b.plot(xs, [e["test_acc"] for e in ep], marker="s", ms=3, label="test")
    b.set_xlabel("epoch")
    b.set_ylabel("accuracy")
    b.legend()


def _plot_costs(c, d, report: dict) -> None:
    """The median iteration and the bytes per term, each predicted next to measured."""
    it = report["iteration"]  # the median iteration, split, next to the prediction
    split = [
        (it.get("predicted_compute_s"), it.get("predicted_comm_s")),
        (it["compute_s"], it["comm_wait_s"]),
    ]
    for i, (comp, comm) in enumerate(split):
        if comp is None:  # a plan priced in bytes only has no predicted time
            c.text(i, 0, "not predicted\n(bytes only)", ha="center", va="bottom", fontsize=8)
            continue
        c.bar(i, comp * 1e3, color="C0", label="compute" if i else None)
        c.bar(i, (comm or 0) * 1e3, bottom=comp * 1e3, color="C1", label="comm" if i else None)
    c.set_xticks([0, 1], ["predicted", "measured"])
    c.set_ylabel("ms per iteration")
    c.legend(fontsize=8)
    got, pred = report["bytes"]["measured"], report["bytes"]["predicted"]
    terms = sorted(set(got) | set(pred), key=lambda t: -max(got.get(t, 0), pred.get(t, 0)))[:6]
    xs = range(len(terms))
    d.bar([x - 0.2 for x in xs], [pred.get(t, 0) / 1e3 for t in terms], 0.4, label="predicted")
    d.bar([x + 0.2 for x in xs], [got.get(t, 0) / 1e3 for t in terms], 0.4, label="measured")
    d.set_xticks(list(xs), terms, rotation=20, fontsize=7)
    d.set_ylabel("KB per rank per iteration")
    d.legend(fontsize=8)
