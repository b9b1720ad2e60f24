"""Claims of the domain style (issue 22), measured in one run on this machine (gloo on CPU):

1. overlap: for every domain layer of resnet20 (32 x 32 images, global batch 8) at P = 2 and 4,
   the halo time (rows posted -> rows arrived) and the share of it hidden behind the interior
   rows' computation (1 - the wait after the interior / the halo time), median over the steps,
   with the halos as point-to-point messages (the path across hosts: on one host they come
   through shared memory in microseconds, and the band is one call, nothing to hide);
2. past the batch limit: resnet20 at global batch B = 2 on P = 4, which pure batch cannot run, with
   a domain plan (every convolution that can take domain(4x1), the rest model(4x1)), against the
   batch plan at its smallest legal batch (B = 4 on 1 x 4), interleaved and repeated: ms per
   iteration and per example, median and spread, the plan's prediction next to it;
3. Fig. 10 on this machine: the planner's domain scenario for resnet20 at B = 2 over P on the
   calibrated `localhost`, with the measured points overlaid (docs/domain_fig10.png).

    python benchmarks/domain.py [--steps 8] [--rounds 3] [--png docs/domain_fig10.png]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import load_cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import build_model
from hybridpar.core.plan import ParallelPlan, Style, assign_styles
from hybridpar.core.rules import why_not
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export, make_plan
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel import parallelize
from hybridpar.runtime.parallel.domain import Exchange

SIZE, CLASSES = 32, 10
SHAPE = (3, SIZE, SIZE)


def _model():
    torch.manual_seed(0)
    return build_model("resnet20", input_size=SIZE, num_classes=CLASSES, in_channels=3)


def domain_plan(P: int, B: int, cluster) -> ParallelPlan:
    """Every layer that can take domain(P x 1) takes it; the others model(P x 1)."""
    with torch.device("meta"):
        layers = cost_layers(analyze(_model(), SHAPE))
    dom, model = Style.domain(P, 1), Style.model(P, 1)
    by_segment: dict[int, bool] = {}
    for x in layers:  # a segment takes one style: domain where all its layers can
        ok = not why_not(x, dom, B)
        by_segment[x.segment] = by_segment.get(x.segment, True) and ok
    styles = {x.name: dom if by_segment[x.segment] else model for x in layers}
    priced = evaluate(layers, [styles[x.name] for x in layers], PlanRequest(P, B, cluster))
    assert priced.feasible, priced.reason
    names = [n for n, _ in _model().named_modules()]
    assert assign_styles(styles, names, [x.name for x in layers], P)
    return export(priced, procs=P, batch=B, choices=Choices(), input_shape=SHAPE, model="resnet20")


def batch_plan(P: int, B: int, cluster) -> ParallelPlan:
    r = make_plan("resnet20", P, B, cluster, input_size=SIZE, scenarios=["batch"])
    return r.export(r.scenario("batch"))


def _run(plan_json: str, B: int, steps: int, shm: bool = True) -> dict:
    """Train `steps` steps; per-step seconds and, per domain layer, (halo s, exposed s). `shm`
    False: every collective on gloo, the halos as point-to-point messages."""
    import json

    from hybridpar.runtime.options import RuntimeOptions

    torch.set_num_threads(1)
    plan = ParallelPlan.from_dict(json.loads(plan_json))
    hp = parallelize(_model(), plan, RuntimeOptions(shared_memory=shm))
    opt = torch.optim.SGD(hp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        x, y = torch.randn(B, *SHAPE, generator=g), torch.randint(0, CLASSES, (B,), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        hp.set_batch(B)
        out = hp(x[hp.input_rows(B)])
        loss = F.cross_entropy(out, y[hp.output_rows(B)], reduction="sum") / B
        opt.zero_grad()
        loss.backward()
        hp.finish_backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    halos = {}
    for name, m in hp.module.named_modules():
        ex = getattr(getattr(m, "hybridpar_stand_in", None), "exchange", None)
        if isinstance(ex, Exchange) and ex.hidden:
            halos[name] = ex.hidden[1:]  # the first step sets up the connections
    return {"times": times[1:], "halos": halos}


def overlap(steps: int, cluster) -> None:
    print(
        "\n1. halo overlap, resnet20 32 px, global batch 8, every domain-capable layer domain(Px1), "
        "halos as point-to-point messages"
    )
    print(f"{'P':>2} {'layer':<18} {'halo ms':>8} {'exposed ms':>11} {'hidden':>7}")
    for P in (2, 4):
        plan = domain_plan(P, 8, cluster)
        out = launch(_run, P, plan.to_json(), 8, steps, False, backend="gloo", timeout_s=300)
        for name in out[0]["halos"]:
            # per step, the slowest rank's halo and exposure (the step waits for it)
            halo = [max(r["halos"][name][k][0] for r in out) for k in range(steps - 2)]
            exposed = [max(r["halos"][name][k][1] for r in out) for k in range(steps - 2)]
            h, e = statistics.median(halo), statistics.median(exposed)
            print(f"{P:>2} {name:<18} {h * 1e3:8.3f} {e * 1e3:11.3f} {1 - e / h:7.0%}")


def past_the_limit(steps: int, rounds: int, cluster) -> dict:
    print(
        "\n2. past the batch limit, P = 4: resnet20 32 px at B = 2 (domain(4x1) where it can, "
        "model(4x1) elsewhere) against pure batch at its smallest batch, B = 4"
    )
    contenders = {"domain, B = 2": (domain_plan(4, 2, cluster), 2)}
    contenders["batch 1x4, B = 4"] = (batch_plan(4, 4, cluster), 4)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):  # interleaved
        for name, (plan, B) in contenders.items():
            out = launch(_run, 4, plan.to_json(), B, steps, backend="gloo", timeout_s=300)
            per_step = [max(r["times"][k] for r in out) for k in range(steps - 1)]
            times[name].append(statistics.median(per_step))
    print(f"{'contender':<18} {'ms/iter':>8} {'range':>15} {'ms/example':>11} {'predicted':>10}")
    for name, ts in times.items():
        plan, B = contenders[name]
        med = statistics.median(ts)
        spread = f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}"
        pred = plan.totals["total_s"] * 1e3
        print(f"{name:<18} {med * 1e3:8.1f} {spread:>15} {med / B * 1e3:11.1f} {pred:10.1f}")
    a, b = (statistics.median(v) for v in times.values())
    print(f"domain at B = 2 / batch at B = 4, per iteration: {a / b:.2f}x")
    return {"domain": statistics.median(times["domain, B = 2"])}


def figure(measured: dict[int, float], cluster, png: str) -> None:
    """At B = 2 over P: the predicted time per iteration of the domain plan (as measured), of the
    planner's best plan and of pure batch where it can run; the measured points on top (this
    machine's 2 cores: P = 2 and 4). resnet20's classifier has 10 outputs: P <= 8 here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = [2, 4, 8]
    dom = [domain_plan(P, 2, cluster).totals["total_s"] for P in procs]
    best, batch = [], []
    for P in procs:
        r = make_plan("resnet20", P, 2, cluster, input_size=SIZE)
        best.append(r.best.total_s)
        b = r.scenario("batch")
        batch.append(b.total_s if b.feasible else None)
    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    ax.plot(procs, [t * 1e3 for t in dom], "o-", label="domain plan, predicted")
    ax.plot(procs, [t * 1e3 for t in best], "^--", label="the planner's best, predicted")
    ax.plot(procs, [t * 1e3 if t else None for t in batch], "v:", label="pure batch, predicted")
    xs = sorted(measured)
    ax.plot(xs, [measured[p] * 1e3 for p in xs], "s", ms=9, label="domain plan, measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(procs, [str(p) for p in procs])
    ax.set_xlabel("processes P at global batch B = 2 (pure batch stops at P = 2)")
    ax.set_ylabel("ms per iteration")
    ax.set_title(
        f"resnet20 {SIZE} px past the batch limit (cf. Gholami et al. Fig. 10), {cluster.name}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    rows = ", ".join(f"P={p}: {d * 1e3:.1f} ms" for p, d in zip(procs, dom, strict=True))
    print(f"\n3. wrote {png}; the domain plan predicted at {rows}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cluster", default="localhost")
    ap.add_argument("--png", default="docs/domain_fig10.png")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    overlap(args.steps, cluster)
    measured = {4: past_the_limit(args.steps, args.rounds, cluster)["domain"]}
    out = launch(_run, 2, domain_plan(2, 2, cluster).to_json(), 2, args.steps, backend="gloo")
    measured[2] = statistics.median(
        [max(r["times"][k] for r in out) for k in range(args.steps - 1)]
    )
    figure(measured, cluster, args.png)


if __name__ == "__main__":
    main()
