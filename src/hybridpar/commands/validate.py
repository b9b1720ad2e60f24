"""`hybridpar validate`: run the planner's best candidates (and the presets) for a few iterations
each and put what the cost model predicted next to what the ranks measured.

For a model, a batch, P and a cluster, the planner prices every grid of every scenario; the `--top`
cheapest distinct chains of styles are exported as plan files, the `--presets` are added (torch DDP
by default), and each plan trains `--steps` iterations on synthetic data (the first is left out of
the timing). `--repeat` rounds run the plans in turn, so a drift of the machine hits all of them;
each plan keeps the median of its rounds. Where plans measured faster than the pick or within
10 % of it, `--confirm` rounds more run the pick and them in turn (`contested`): the fastest of
several noisy medians is low for having been chosen the lowest, and a plan just behind the pick
may be ahead of it.

A planner is judged by what it decides: which plan to run, and how much faster it will be. So
each plan's speed-up over the reference (the `ddp` preset, where it runs) is predicted and
measured, the measured one from the rounds in which both ran (the ratio of two times taken
minutes apart measures the machine's drift; of two taken side by side, the plans). The table
gives, per plan, predicted and measured time per iteration and speed-up, the time split into
compute and communication (the time in collectives) and of that the time spent waiting for the
slowest rank to arrive; then the summary: median and worst |error| of the times and of the
speed-ups, Spearman's rho between the predicted and the measured order, and whether the
planner's pick is the measured fastest (and by how much it is slower when it is not). The table
is written as JSON with a PNG scatter beside it.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybridpar.core.cluster import CALIBRATED
from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan

__all__ = ["Candidate", "candidates", "contested", "spearman", "summarize", "validate"]


@dataclass
class Candidate:
    """One plan validate runs, and what it measured."""

    label: str
    plan: ParallelPlan
    picked: bool = False  # the planner's best
    runs: list[dict] = field(default_factory=list)  # one report["iteration"] per round
    failure: str = ""  # why a run of it failed (the planner proposed what the runtime refused)

    @property
    def predicted(self) -> dict:
        t = self.plan.totals
        return {k: t.get(k) for k in ("total_s", "compute_s", "comm_s", "waiting_s")}

    @property
    def measured(self) -> dict:
        """The round with the median total time (of an even count, the mean of the two middle
        rounds: plans run again by `contested` are judged by the same statistic as the others),
        and the range over the rounds."""
        if not self.runs:
            return {}
        ordered = sorted(self.runs, key=lambda r: r["time_s"])
        n = len(ordered)
        mid = ordered[(n - 1) // 2 : n // 2 + 1]

        def median(key: str) -> float:
            return statistics.fmean(r.get(key, 0.0) for r in mid)

        return {
            "total_s": median("time_s"),
            "compute_s": median("compute_s"),
            "comm_s": median("comm_wait_s"),
            # of comm_s: waiting in blocking collectives for the slowest rank to arrive
            "waiting_s": median("waiting_slowest_s"),
            "lo_s": ordered[0]["time_s"],
            "hi_s": ordered[-1]["time_s"],
        }

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured of the total time per iteration."""
        p, m = self.predicted["total_s"], self.measured.get("total_s")
        return None if p is None or not m else (p - m) / m

    def speedup(self, ref: Candidate) -> tuple[float | None, float | None]:
        """(predicted, measured) speed-up over `ref`: the ratio of the predictions, and the
        median over the rounds in which both ran of ref's time over this plan's."""
        p, q = self.predicted["total_s"], ref.predicted["total_s"]
        times = {r["round"]: r["time_s"] for r in ref.runs}
        ratios = [times[r["round"]] / r["time_s"] for r in self.runs if r["round"] in times]
        return (q / p if p and q else None), (statistics.median(ratios) if ratios else None)

    def speedup_error(self, ref: Candidate) -> float | None:
        """(predicted - measured) / measured of the speed-up over `ref`."""
        p, m = self.speedup(ref)
        return None if p is None or not m else (p - m) / m

    def to_dict(self, ref: Candidate | None = None) -> dict:
        up = self.speedup(ref) if ref is not None else (None, None)
        return {
            "label": self.label,
            "scenario": self.plan.scenario,
            "engine": self.plan.engine,
            "styles": sorted({s.label for s in self.plan.styles.values()}),
            "picked": self.picked,
            "predicted": self.predicted,
            "measured": self.measured,
            "error": self.error,
            "speedup": {
                "reference": ref.label if ref else None,
                "predicted": up[0],
                "measured": up[1],
            },
            "rounds": len(self.runs),
            "failure": self.failure or None,
        }


def _label(plan) -> str:
    grid = f" {plan.grid[0]}x{plan.grid[1]}" if plan.grid else ""
    placed = f" @{plan.placement[0]}x{plan.placement[1]}" if plan.placement else ""
    return f"{plan.scenario}{grid}{placed}"


def candidates(result, top: int, presets: dict[str, ParallelPlan]) -> list[Candidate]:
    """The planner's `top` cheapest distinct plans (a plan is its engine and chain of styles; the
    planner's best always first), then each preset not among them."""
    best = result.best
    feasible = [p for ps in result.candidates.values() for p in ps if p.feasible]
    feasible.sort(key=lambda p: (p is not best, p.total_s, p.comm_s))
    out: list[Candidate] = []
    seen: set = set()
    for p in feasible:
        if len(out) == top:
            break
        key = ("hybridpar", tuple(x.style for x in p.layers), p.placement)
        if key in seen:
            continue
        try:
            plan = result.export(p)
        except ConfigError:  # a choice or style the runtime refuses: not a candidate
            continue
        seen.add(key)
        out.append(Candidate(_label(p), plan, picked=p is best))
    for name, plan in presets.items():
        key = (plan.engine, tuple(plan.styles.values()), plan.placement)
        if key not in seen:
            seen.add(key)
            out.append(Candidate(name, plan))
    return out


def _ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of their ranks."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's r of the ranks); None for fewer than two points or
    when one side has a single rank."""
    if len(a) != len(b):
        raise ValueError("spearman: the two lists differ in length")
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = math.fsum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.fsum((x - ma) ** 2 for x in ra)
    vb = math.fsum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


REFERENCE = "ddp"
"""the plan every other's speed-up is taken over, where validate runs it"""


def reference(cands: list[Candidate]) -> Candidate | None:
    return next((c for c in cands if c.label == REFERENCE and c.runs), None)


def summarize(cands: list[Candidate]) -> dict:
    """Median and worst |error| of the total and of the speed-up over the reference, Spearman's
    rho, and the pick against the fastest."""
    done = [c for c in cands if c.error is not None]
    if not done:
        return {}
    errs = [abs(c.error) for c in done]  # type: ignore[arg-type]
    fastest = min(done, key=lambda c: c.measured["total_s"])
    picked = next((c for c in done if c.picked), None)
    pred = [c.predicted["total_s"] for c in done]
    meas = [c.measured["total_s"] for c in done]
    ref = reference(cands)
    ups = {c.label: c.speedup_error(ref) for c in done if ref is not None and c is not ref}
    ups = {k: abs(v) for k, v in ups.items() if v is not None}
    return {
        "reference": ref.label if ref is not None and ups else None,
        "speedup_median_abs_error": statistics.median(ups.values()) if ups else None,
        "speedup_worst_abs_error": max(ups.values()) if ups else None,
        "speedup_worst": max(ups, key=ups.__getitem__) if ups else None,
        "plans": len(done),
        "median_abs_error": statistics.median(errs),
        "worst_abs_error": max(errs),
        "worst": max(done, key=lambda c: abs(c.error)).label,  # type: ignore[arg-type]
        "spearman_rho": spearman(pred, meas),
        "fastest": fastest.label,
        "picked": picked.label if picked else None,
        "picked_is_fastest": picked is fastest,
        "picked_over_fastest": (
            picked.measured["total_s"] / fastest.measured["total_s"] if picked else None
        ),
    }


def _file_name(i: int, c: Candidate) -> str:
    return f"{i:02d}-{c.label.replace(' ', '-').replace(':', '-')}.json"


def _run_one(cand: Candidate, path: Path, base, weights: Path) -> dict | None:
    """One run of the candidate: rank 0's iteration times (None on the other ranks of a
    torchrun job)."""
    from hybridpar.runtime.train.run import run

    cand.plan.save(path)
    cfg = base.with_(plan=str(path), save=str(weights / f"{path.stem}.pt"))
    report = run(cfg)
    return None if report is None else report["iteration"]


CLOSE = 1.10
"""plans measured faster than the pick, or slower by less than this factor, run again beside it"""


def contested(cands: list[Candidate]) -> list[int]:
    """The indices of the pick and of every plan measured faster than it or less than 10 %
    slower (`CLOSE`): what `validate` runs again (the module's docstring says why); [] where
    there is none, or the pick did not run."""
    pick = next((i for i, c in enumerate(cands) if c.picked and c.runs), None)
    if pick is None:
        return []
    t = CLOSE * cands[pick].measured["total_s"]
    close = [i for i, c in enumerate(cands) if c.runs and i != pick and c.measured["total_s"] < t]
    return [pick, *close] if close else []


def validate(
    cands: list[Candidate],
    base,
    out: Path,
    repeat: int,
    progress: bool = True,
    confirm: int = 0,
    agree=lambda which: which,
) -> dict:
    """Run every candidate `repeat` times, interleaved, then the `contested` ones `confirm` times
    more; fills each candidate's runs (or its failure: a plan whose run fails is not run again).
    `agree`: every rank's copy of rank 0's contested indices (under torchrun only rank 0 has
    the runs). Returns {"confirmed": their labels, "pick_before": the pick over the fastest
    before those rounds (None where they did not run)}."""
    from hybridpar.runtime.launcher import RankFailure

    plans_dir = out / "plans"
    plans_dir.mkdir(parents=True, exist_ok=True)
    weights = Path(tempfile.mkdtemp(prefix="hybridpar-validate-"))

    done = [0]  # rounds so far: each run is tagged with its round, for the speed-ups

    def rounds(which: list[int], n: int) -> None:
        for k in range(n * len(which)):
            i = which[k % len(which)]
            r = done[0] + k // len(which)
            c = cands[i]
            if c.failure:
                continue
            try:
                it = _run_one(c, plans_dir / _file_name(i, c), base, weights)
            except RankFailure as exc:
                c.failure = str(exc)
                print(f"{c.label}: failed: {exc}", file=sys.stderr, flush=True)
                continue
            if it is None:  # a rank other than 0 under torchrun: rank 0 has the report
                continue
            c.runs.append({**it, "round": r})
            if progress:
                print(
                    f"[{k + 1}/{n * len(which)}] {c.label:<22} {it['time_s'] * 1e3:8.1f} ms "
                    f"(predicted {c.predicted['total_s'] * 1e3:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
        done[0] += n

    try:
        rounds(list(range(len(cands))), repeat)
        which = agree(contested(cands) if confirm else [])
        before = summarize(cands).get("picked_over_fastest") if which else None
        if which and progress:
            names = ", ".join(cands[i].label for i in which)
            print(f"{confirm} rounds more of {names}", file=sys.stderr, flush=True)
        rounds(which, confirm)
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    return {"confirmed": [cands[i].label for i in which], "pick_before": before}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f} %"


def print_table(cands: list[Candidate], summary: dict, head: str) -> None:
    print(head)
    ref = reference(cands)
    cols = (
        f"{'plan':<24} {'pred ms':>8} {'meas ms':>8} {'error':>7}  {'speed-up p/m':>12} "
        f"{'error':>7}   {'compute p/m':>13} {'comm p/m':>13} {'wait p/m':>11} {'range ms':>13}"
    )
    print(cols)
    for c in cands:
        p, m = c.predicted, c.measured
        if c.failure:
            print(f"{' ':1}{c.label:<23} failed: {c.failure.splitlines()[0]}")
            continue
        if not m:
            continue
        ms = {k: (v or 0.0) * 1e3 for k, v in {**p}.items()}
        mm = {k: v * 1e3 for k, v in m.items()}
        up, um = c.speedup(ref) if ref is not None else (None, None)
        ups = f"{up:5.2f}/{um:<5.2f}" if up is not None and um is not None else "-"
        err = _pct(c.speedup_error(ref)) if ref is not None and c is not ref else "-"
        mark = "*" if c.picked else " "
        print(
            f"{mark}{c.label:<23} {ms['total_s']:8.1f} {mm['total_s']:8.1f} {_pct(c.error):>7}  "
            f"{ups:>12} {err:>7}   "
            f"{ms['compute_s']:6.1f}/{mm['compute_s']:<6.1f} {ms['comm_s']:6.1f}/{mm['comm_s']:<6.1f} "
            f"{ms['waiting_s']:5.1f}/{mm['waiting_s']:<5.1f} {mm['lo_s']:6.1f}-{mm['hi_s']:<6.1f}"
        )
    if not summary:
        return
    print(
        "(p/m: predicted/measured; speed-up: over the ddp plan, measured in the rounds both ran; "
        "comm: exposed communication, measured as the time in collectives; wait: the part of it "
        "spent waiting for the slowest rank)"
    )
    rho = summary["spearman_rho"]
    print(
        f"\n{summary['plans']} plans: |error| median {summary['median_abs_error'] * 100:.1f} %, "
        f"worst {summary['worst_abs_error'] * 100:.1f} % ({summary['worst']}); Spearman's rho "
        f"{'-' if rho is None else f'{rho:.2f}'}"
    )
    if summary.get("reference"):
        print(
            f"speed-up over {summary['reference']}: |error| median "
            f"{summary['speedup_median_abs_error'] * 100:.1f} %, worst "
            f"{summary['speedup_worst_abs_error'] * 100:.1f} % ({summary['speedup_worst']})"
        )
    if summary["picked"] is None:
        return
    before = summary.get("pick_before")
    tail = "" if before is None else f" ({before:.2f}x on the first rounds alone)"
    if summary["picked_is_fastest"]:
        print(f"the planner's pick ({summary['picked']}, *) is the measured fastest{tail}")
    else:
        print(
            f"the planner's pick ({summary['picked']}, *) is {summary['picked_over_fastest']:.2f}x "
            f"the measured fastest ({summary['fastest']}){tail}"
        )


def plot(cands: list[Candidate], path: Path, title: str) -> Path | None:
    """Predicted against measured time per iteration, one point per plan, with y = x and 15 %."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = [(c, c.predicted["total_s"] * 1e3, c.measured["total_s"] * 1e3) for c in cands if c.runs]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    lo = 0.8 * min(min(p, m) for _, p, m in pts)
    hi = 1.25 * max(max(p, m) for _, p, m in pts)
    ax.plot([lo, hi], [lo, hi], color="k", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo / 1.15, hi / 1.15], [lo / 0.85, hi / 0.85], color="0.9")
    for c, p, m in pts:
        ax.scatter([p], [m], marker="*" if c.picked else "o", s=120 if c.picked else 30)
        ax.annotate(c.label, (p, m), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted ms per iteration")
    ax.set_ylabel("measured ms per iteration")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cmd_validate(args) -> int:
    """`hybridpar validate`: every input checked before a process starts."""
    from hybridpar.commands.plans import job_cluster, plan_kwargs
    from hybridpar.core.config import from_namespace
    from hybridpar.planning.config import PlanConfig
    from hybridpar.planning.search import make_plan
    from hybridpar.runtime.launcher import under_torchrun

    cfg = from_namespace(PlanConfig, args)
    names = _checked(args, cfg)
    cluster = job_cluster(cfg)

    def plan_candidates() -> list[Candidate]:
        kwargs = plan_kwargs(cfg, cluster, args.procs)
        result = make_plan(cfg.model, args.procs, cfg.batch, cluster, **kwargs)
        result.best  # noqa: B018  one line when nothing fits
        presets = {n: _preset(result, n) for n in names}
        return candidates(result, args.top, presets)

    if under_torchrun():
        return _in_job(args, cfg, cluster, plan_candidates)
    cands = plan_candidates()
    head = (
        f"{cfg.model}, P={args.procs}, B={cfg.batch} on {cluster.name}: {len(cands)} plans, "
        f"{args.steps - 1} timed iterations each, median of {args.repeat} interleaved rounds"
    )
    print(head, file=sys.stderr, flush=True)
    out = Path(args.out)
    again = validate(cands, _base(args, cfg), out, args.repeat, not args.quiet, args.confirm)
    return _finish(args, cfg, cluster, cands, head, out, again)


def _checked(args, cfg) -> list[str]:
    """The arguments checked (one line each) and the presets named; `localhost` calibrated
    first where it is not yet, as a searched `hybridpar train` does."""
    from hybridpar.core.cluster import localhost_path
    from hybridpar.core.config import writable
    from hybridpar.core.rules import why_not_grid
    from hybridpar.planning.analysis_cache import model_layers
    from hybridpar.planning.presets import parse_preset
    from hybridpar.runtime.launcher import under_torchrun
    from hybridpar.runtime.train.calibration import calibrate

    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != args.procs:
        raise ConfigError(
            f"--procs {args.procs} but torchrun started {os.environ['WORLD_SIZE']} ranks; "
            "give --procs the job's size"
        )
    if args.procs < 2:
        raise ConfigError("validate compares parallel plans: use --procs 2 or more")
    if args.steps < 2:
        raise ConfigError("--steps must be at least 2 (the first step is left out of the timing)")
    writable("--out", Path(args.out) / "validate.json")
    names = [n.strip() for n in args.presets.split(",") if n.strip()] if args.presets else []
    for n in names:
        grid = parse_preset(n, args.procs)[1]
        if grid is None:  # auto and the searched scenarios
            raise ConfigError(
                f"--presets {n}: give fixed presets (ddp, owt, batch, model, grid:RxC); the "
                "searched ones are the planner's candidates already"
            )
        if why := why_not_grid(*grid, args.procs, cfg.batch):
            raise ConfigError(f"--presets {n}: {why}")
    kw = cfg.plan_kwargs()
    model_layers(cfg.model, kw["input_size"], kw["input_shape"])  # named before a calibration
    if cfg.cluster == "localhost" and not localhost_path().exists() and not under_torchrun():
        print("localhost is not calibrated yet: calibrating it first", file=sys.stderr)
        calibrate(nproc=list(CALIBRATED))  # `hybridpar calibrate`'s default
    return names


def _base(args, cfg):
    """The training config every candidate runs with (its plan file added per run)."""
    from hybridpar.core.config import build
    from hybridpar.runtime.train.config import TrainConfig

    return build(
        TrainConfig,
        model=cfg.model,
        data=args.data or f"synthetic:{cfg.batch * args.steps}",
        input_size=cfg.input_size,
        input_shape=cfg.input_shape,
        cluster=cfg.cluster,
        epochs=1,
        max_steps=args.steps,
        quiet=True,
        progress=False,
        shared_memory=cfg.shared_memory,
    )


def _in_job(args, cfg, cluster, plan_candidates) -> int:
    """validate under torchrun, across the hosts of the job: rank 0 plans (and measures the
    compute profile) and sends the candidates to every rank; all ranks run each candidate in
    this job, in turn (the job's process group serves every run); rank 0 prints and writes."""
    import json

    import torch.distributed as dist

    from hybridpar.runtime.comm import shutdown
    from hybridpar.runtime.comm.group import DEFAULT_TIMEOUT_S
    from hybridpar.runtime.launcher import init_distributed

    out = Path(args.out)
    init_distributed(DEFAULT_TIMEOUT_S)
    try:
        rank = dist.get_rank()
        sent = None
        if rank == 0:
            try:
                cands = plan_candidates()
                sent = ("ok", [(c.label, c.plan.to_json(), c.picked) for c in cands])
            except ConfigError as exc:
                sent = ("error", str(exc))
        kind, body = _from_rank_0(sent)
        if kind == "error":
            raise ConfigError(body)
        cands = [
            Candidate(label, ParallelPlan.from_dict(json.loads(text)), picked=picked)
            for label, text, picked in body
        ]
        head = (
            f"{cfg.model}, P={args.procs}, B={cfg.batch} on {cluster.name} (torchrun, "
            f"{_hosts_of_job()} host(s)): {len(cands)} plans, {args.steps - 1} timed iterations "
            f"each, median of {args.repeat} interleaved rounds"
        )
        if rank == 0:
            print(head, file=sys.stderr, flush=True)
        local = Path(tempfile.mkdtemp(prefix="hybridpar-validate-"))  # each rank's plan files
        try:
            progress = rank == 0 and not args.quiet
            again = validate(
                cands, _base(args, cfg), local, args.repeat, progress, args.confirm, _from_rank_0
            )
        finally:
            shutil.rmtree(local, ignore_errors=True)
        if rank != 0:  # only rank 0's runs return reports
            return 0
        plans = out / "plans"
        plans.mkdir(parents=True, exist_ok=True)
        for i, c in enumerate(cands):
            c.plan.save(plans / _file_name(i, c))
        return _finish(args, cfg, cluster, cands, head, out, again)
    finally:
        shutdown()


def _from_rank_0(value):
    """Rank 0's `value`, on every rank of the job."""
    import torch.distributed as dist

    sent = [value]
    dist.broadcast_object_list(sent, src=0)
    return sent[0]


def _hosts_of_job() -> int:
    from hybridpar.runtime.comm.host import host_names

    return len(set(host_names()))


def _finish(args, cfg, cluster, cands, head, out: Path, again: dict) -> int:
    """Print the table, write validate.json and the scatter plot; 1 where a plan failed.
    `again`: what `validate` ran again (the contested plans)."""
    import json

    from hybridpar.runtime.train.report import strict

    summary = summarize(cands)
    if not summary:
        for c in cands:
            print(f"{c.label}: failed: {c.failure}", file=sys.stderr)
        return 1
    summary.update(again)
    print_table(cands, summary, head)
    ref = reference(cands)
    data = {
        "model": cfg.model,
        "procs": args.procs,
        "batch": cfg.batch,
        "cluster": cluster.to_dict(),
        "steps": args.steps,
        "repeat": args.repeat,
        "plans": [c.to_dict(ref) for c in cands],
        "summary": summary,
    }
    path = out / "validate.json"
    path.write_text(json.dumps(strict(data), indent=1, allow_nan=False))
    png = plot(cands, out / "validate.png", head.split(":")[0])
    print(
        f"wrote {path}" + (f" and {png}" if png else "") + f"; the plans it ran in {out / 'plans'}"
    )
    return 1 if any(c.failure for c in cands) else 0


def _preset(result, name: str) -> ParallelPlan:
    """A fixed preset's plan, taken from the candidates the planner priced (as plan_preset does)."""
    from hybridpar.planning.presets import parse_preset

    scenario, grid = parse_preset(name, result.procs)
    chosen = next((p for p in result.candidates.get(scenario, []) if p.grid == grid), None)
    if chosen is None or not chosen.feasible:
        why = chosen.reason if chosen is not None else f"it needs Pc <= B={result.batch}"
        raise ConfigError(f"--presets {name} cannot run: {why}")
    return result.export(chosen, engine="ddp" if name == "ddp" else "hybridpar")
