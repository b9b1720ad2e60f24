"""`hybridpar plan` and `hybridpar simulate`: the planner on the command line. Torch-free: a zoo
model's layers come from the analysis cache, so planning is arithmetic and answers at once."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybridpar.core.cluster import load_cluster
from hybridpar.core.config import from_namespace, writable
from hybridpar.core.errors import ConfigError
from hybridpar.core.terms import Term
from hybridpar.planning.candidates import PlanResult, best_of
from hybridpar.planning.config import PlanConfig
from hybridpar.planning.fit import largest_fitting
from hybridpar.planning.search import SCENARIOS, make_plan

__all__ = ["cmd_plan", "cmd_simulate", "plan_kwargs"]

TERMS = (
    Term.ALLGATHER,
    Term.DX_ALLREDUCE,
    Term.DX_ALLGATHER,
    Term.DW_ALLREDUCE,
    Term.HALO_FWD,
    Term.HALO_BWD,
    Term.REDISTRIBUTE,
)


def _ms(x: float) -> str:
    return f"{x * 1e3:10.3f}"


def _print_header(result: PlanResult) -> None:
    c, ch = result.cluster.priced(result.procs), result.choices
    print(
        f"{result.model} on {c.name} (alpha {c.alpha * 1e6:g} us, {1 / c.beta / 1e9:g} GB/s, "
        f"{c.rank_flops() / 1e12:g} TFLOP/s per rank), P={result.procs}, "
        f"B={result.batch}, {result.elem_bytes:g} bytes/element"
        + (f", codec {ch.codec} on {'+'.join(ch.compress)}" if ch.codec != "none" else "")
    )
    print()


def _print_plan(result: PlanResult, shown: list) -> None:
    _print_header(result)
    batch = result.scenario("batch")
    head = f"{'scenario':<10} {'grid':>9} {'comm ms':>10} {'compute ms':>10} {'total ms':>10}"
    print(f"{head} {'vs batch':>9}")
    for p in shown:
        if not p.feasible:
            print(f"{p.scenario:<10} {'-':>9}  infeasible: {p.reason}")
            continue
        grid = f"{p.grid[0]}x{p.grid[1]}" if p.grid else "per layer"
        vs = f"{batch.total_s / p.total_s:8.2f}x" if batch is not None and batch.feasible else "-"
        times = f"{_ms(p.exposed_comm_s)} {_ms(p.compute_s)} {_ms(p.total_s)}"
        print(f"{p.scenario:<10} {grid:>9} {times} {vs:>9}")
    best = best_of(shown)
    if best is None:
        return
    print()
    print(f"best: {best.scenario}" + (f" on {best.grid[0]}x{best.grid[1]}" if best.grid else ""))
    shown = [t for t in TERMS if any(t in x.terms for x in best.layers)]  # the plan's terms
    terms = "".join(f"{t:>13}" for t in shown)
    cols = f"{'layer':<8} {'kind':<6} {'params':>10} {'d_in':>8} {'d_out':>8} {'style':<15}"
    print(f"{cols} {'comm ms':>9}{terms}")
    for x in best.layers:
        cells = "".join(
            f"{x.terms[t].seconds * 1e3:13.3f}" if t in x.terms else f"{'':13}" for t in shown
        )
        y = x.layer
        row = f"{y.name:<8} {y.kind:<6} {y.params:>10} {y.d_in:>8} {y.d_out:>8} {x.style.label:<15}"
        print(f"{row} {x.comm_s * 1e3:9.3f}{cells}")
    for x in best.layers:
        if x.handoff is not None:
            h = x.handoff
            how = "one all-gather" if h.scheme == "a" else f"{h.rounds} rounds, overlapped"
            print(f"hand-off before {x.layer.name}: scheme ({h.scheme}), {how}")
    if best.placement is not None:
        pr, pc = best.placement
        print(
            f"placement: the batch groups of grid {pr}x{pc} on consecutive ranks (within a host), "
            f"its model groups across hosts (rank r*{pc}+c holds position c*{pr}+r)"
        )


def job_cluster(cfg: PlanConfig):
    """The cluster a job of `cfg` is priced on: on its device (auto: the CPU's, unless told)."""
    return load_cluster(cfg.cluster, "cuda" if cfg.choices.device == "cuda" else "cpu")


def plan_kwargs(cfg: PlanConfig, cluster, P: int) -> dict:
    """The planner's keyword arguments for `cfg` on P ranks; on a calibrated host (localhost)
    without --compute, the compute times of a profile measured here (planning.profile)."""
    kwargs = cfg.plan_kwargs()
    if cfg.compute is None and cluster.cores is not None:
        from hybridpar.core.zoo import input_shape, is_factory, parse_input_shape

        if is_factory(cfg.model) and not cfg.input_shape:
            return kwargs  # the planner names what is missing
        from hybridpar.planning.profile import planning_compute

        shape = (
            parse_input_shape(cfg.input_shape)
            if cfg.input_shape
            else input_shape(cfg.model, cfg.input_size)
        )
        choices = cfg.choices
        kwargs["compute"] = planning_compute(
            cluster, cfg.model, tuple(shape), P, cfg.batch, choices.device, choices.amp
        )
    return kwargs


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = from_namespace(PlanConfig, args)
    if args.out:
        writable("--out", args.out)
    if args.model_of == "dettmers":
        from hybridpar.commands.papers.dettmers_plan import plan_dettmers

        return plan_dettmers(cfg, args)
    if args.dettmers_profile:
        raise ConfigError("--dettmers-profile needs --model-of dettmers")
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.scenario != "all" and "batch" not in scenarios:
        scenarios.insert(0, "batch")  # the baseline every speedup refers to
    cluster = job_cluster(cfg)
    if args.fit:
        result = _fit(cfg, args, cluster, scenarios)
    else:
        kwargs = {**plan_kwargs(cfg, cluster, args.procs), "mode": args.mode}
        result = make_plan(cfg.model, args.procs, cfg.batch, cluster, scenarios=scenarios, **kwargs)
    result.best  # noqa: B018  raises the one-line error when nothing fits
    shown = [p for p in result.scenarios if args.scenario in ("all", p.scenario)]
    best = best_of(shown)
    if best is None:
        raise ConfigError(f"scenario {args.scenario} is infeasible: {shown[0].reason}")
    if args.json:
        data = result.to_dict()
        data["scenarios"] = [p.to_dict() for p in shown]
        data["best"] = best.to_dict()
        data["speedup_vs_batch"] = result.speedup_vs_batch(best)
        print(json.dumps(data, indent=1))
    else:
        _print_plan(result, shown)
    if args.out:
        path = result.export(best).save(args.out)
        where = sys.stderr if args.json else sys.stdout
        print(f"wrote the {best.scenario} plan to {path}", file=where)
    return 0


def _fit(cfg: PlanConfig, args: argparse.Namespace, cluster, scenarios: list[str]) -> PlanResult:
    """The plan of the largest image under --memory-limit on P ranks (search.largest_fitting),
    said in a line before it."""
    from hybridpar.core.zoo import input_shape, is_factory, parse_input_shape

    if cfg.memory_limit is None:
        raise ConfigError("--fit finds the largest image under --memory-limit: give one (GiB)")
    if is_factory(cfg.model) and not cfg.input_shape:
        raise ConfigError(f"--fit with --model {cfg.model} needs --input-shape C,H,W: its aspect")
    shape = (
        parse_input_shape(cfg.input_shape)
        if cfg.input_shape
        else input_shape(cfg.model, cfg.input_size)
    )
    kwargs = {**cfg.plan_kwargs(), "mode": args.mode, "scenarios": scenarios}
    kwargs.pop("input_size"), kwargs.pop("input_shape")
    found, refused = largest_fitting(
        cfg.model, tuple(shape), args.procs, cfg.batch, cluster, **kwargs
    )
    size = " x ".join(map(str, found.input_shape[1:]))
    over = " x ".join(map(str, refused[0][1:]))
    verb = "predicts" if args.mode == "predict" else "trains"
    where = sys.stderr if args.json else sys.stdout
    print(
        f"the largest image a plan on {args.procs} ranks {verb} under {cfg.memory_limit:g} GiB "
        f"a rank: {size} (peak {best_of(found.scenarios).memory_bytes / 2**30:.3f} GiB); "
        f"{over} fits no plan ({refused[1]})",
        file=where,
    )
    return found


def cmd_simulate(args: argparse.Namespace) -> int:
    from hybridpar.commands.papers.simulate import FIGURES, plot_sweep, run_sweep, write_csv

    cfg = from_namespace(PlanConfig, args)
    cluster = job_cluster(cfg)
    kwargs = cfg.plan_kwargs()
    out = Path(args.out)
    writable("--out", out / "simulate.csv")
    for p in args.procs:  # every P checked before anything is written
        make_plan(cfg.model, p, cfg.batch, cluster, scenarios=("batch",), **kwargs)
    t0 = time.perf_counter()
    handoffs = None
    if args.handoffs:
        from hybridpar.commands.papers.handoff_sweep import sweep_handoffs

        handoffs = sweep_handoffs(cfg.model, args.procs, args.handoffs, cluster, **kwargs)
    results = run_sweep(
        args.procs,
        lambda p: make_plan(cfg.model, p, cfg.batch, cluster, **kwargs),
        progress=not args.quiet,
    )
    write_csv(results, out / "simulate.csv")
    written = [out / "simulate.csv"]
    if not args.no_plots:
        for fname, (scenario, title) in FIGURES.items():
            path = plot_sweep(results, out, scenario, title, fname)
            if path:
                written.append(path)
    cols = f"{'P':>6} {'best':<10} {'grid':>9} {'comm ms':>10} {'total ms':>10}"
    print(f"{cols} {'vs batch (comm)':>16}")
    for r in results:
        b = r.best
        sp = r.speedup_vs_batch()
        grid = f"{b.grid[0]}x{b.grid[1]}" if b.grid else "per layer"
        vs = f"{sp['total']:.2f}x ({sp['comm']:.1f}x)" if sp else "batch infeasible"
        print(f"{r.procs:>6} {b.scenario:<10} {grid:>9} {_ms(b.comm_s)} {_ms(b.total_s)} {vs:>16}")
    if handoffs is not None:
        written += _write_handoffs(handoffs, out, args, f"{cfg.model} on {cluster.name}")
    print(f"wrote {', '.join(str(p) for p in written)} in {time.perf_counter() - t0:.2f} s")
    return 0


def _write_handoffs(points, out: Path, args: argparse.Namespace, what: str) -> list[Path]:
    """Print and write the hand-off sweep (commands.papers.handoff_sweep)."""
    from hybridpar.commands.papers.handoff_sweep import plot_handoffs, write_handoffs

    print(
        f"\nexposed hand-off / compute per iteration, {args.handoffs} examples per worker "
        "(the paper's links | hybridpar's collectives):"
    )
    print(f"{'K':>4} " + " ".join(f"{'(' + s + ')':>15}" for s in "abc"))
    for k in sorted({p.workers for p in points}):
        row = {p.scheme: p for p in points if p.workers == k}
        cells = [f"{row[s].paper_ratio:6.3f} | {row[s].ratio:6.3f}" for s in "abc"]
        print(f"{k:>4} " + " ".join(f"{c:>15}" for c in cells))
    write_handoffs(points, out / "handoff_ratio.csv")
    written = [out / "handoff_ratio.csv"]
    if not args.no_plots:
        title = f"{what}: Krizhevsky's hand-off schemes, {args.handoffs} examples per worker"
        written.append(plot_handoffs(points, out / "handoff_ratio.png", title))
    return written
