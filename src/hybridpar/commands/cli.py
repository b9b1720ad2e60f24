"""Command line: `hybridpar plan | simulate | profile | train | codecs | calibrate`.

Every bad input ends in one line on stderr, `hybridpar <command>: error: <what to change>`, and
exit code 2, before any work (or process) starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hybridpar.config import PlanConfig, add_arguments, from_namespace
from hybridpar.errors import ConfigError, Interrupted
from hybridpar.plan import Term

TERMS = (
    Term.ALLGATHER,
    Term.DX_ALLREDUCE,
    Term.DW_ALLREDUCE,
    Term.HALO_FWD,
    Term.HALO_BWD,
    Term.REDISTRIBUTE,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r} needs positive integers, e.g. 8,16,32")
    return vals


def _ms(x: float) -> str:
    return f"{x * 1e3:10.3f}"


def _print_plan(result, shown: list) -> None:
    c = result.cluster
    print(
        f"{result.model} on {c.name} (alpha {c.alpha * 1e6:g} us, {c.bandwidth / 1e9:g} GB/s, "
        f"{c.rank_flops(result.procs) / 1e12:g} TFLOP/s per rank), P={result.procs}, B={result.batch}, "
        f"{result.elem_bytes:g} bytes/element"
        + (
            f", codec {result.codec} on {'+'.join(result.compress)}"
            if result.codec not in (None, "none")
            else ""
        )
    )
    print()
    batch = result.scenario("batch")
    print(
        f"{'scenario':<10} {'grid':>9} {'comm ms':>10} {'compute ms':>10} {'total ms':>10} {'vs batch':>9}"
    )
    for p in shown:
        if not p.feasible:
            print(f"{p.scenario:<10} {'-':>9}  infeasible: {p.reason}")
            continue
        grid = f"{p.grid[0]}x{p.grid[1]}" if p.grid else "per layer"
        vs = f"{batch.total_s / p.total_s:8.2f}x" if batch is not None and batch.feasible else "-"
        print(
            f"{p.scenario:<10} {grid:>9} {_ms(p.exposed_comm_s)} {_ms(p.compute_s)} {_ms(p.total_s)} {vs:>9}"
        )
    best = min((p for p in shown if p.feasible), key=lambda p: (p.total_s, p.comm_s), default=None)
    if best is None:
        return
    print()
    print(f"best: {best.scenario}" + (f" on {best.grid[0]}x{best.grid[1]}" if best.grid else ""))
    head = "".join(f"{t:>13}" for t in TERMS)
    print(
        f"{'layer':<8} {'kind':<6} {'params':>10} {'d_in':>8} {'d_out':>8} {'style':<15} {'comm ms':>9}{head}"
    )
    for x in best.layers:
        terms = "".join(
            f"{x.terms[t].seconds * 1e3:13.3f}" if t in x.terms else f"{'':13}" for t in TERMS
        )
        print(
            f"{x.layer.name:<8} {x.layer.kind:<6} {x.layer.params:>10} {x.layer.d_in:>8} "
            f"{x.layer.d_out:>8} {x.style.label:<15} {x.comm_s * 1e3:9.3f}{terms}"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    from hybridpar.planning.cluster import load_cluster
    from hybridpar.planning.search import NOT_EXECUTABLE, SCENARIOS, make_plan

    cfg = from_namespace(PlanConfig, args)
    if args.model_of == "dettmers":
        return _plan_dettmers(cfg, args)
    if args.dettmers_profile:
        raise ConfigError("--dettmers-profile needs --model-of dettmers")
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if args.scenario != "all" and "batch" not in scenarios:
        scenarios.insert(0, "batch")  # the baseline every speedup refers to
    if args.out and args.scenario == "domain":
        raise ConfigError(
            f"{NOT_EXECUTABLE}: --out writes plans `hybridpar train` runs; pick another --scenario"
        )
    result = make_plan(
        cfg.model,
        args.procs,
        cfg.batch,
        load_cluster(cfg.cluster),
        scenarios=scenarios,
        domain=not args.out,
        **cfg.plan_kwargs(),
    )
    result.best  # noqa: B018  raises the one-line error when nothing fits
    shown = [p for p in result.scenarios if args.scenario in ("all", p.scenario)]
    feasible = [p for p in shown if p.feasible]
    if not feasible:
        raise ConfigError(f"scenario {args.scenario} is infeasible: {shown[0].reason}")
    best = min(feasible, key=lambda p: (p.total_s, p.comm_s))
    if args.json:
        data = result.to_dict()
        data["scenarios"] = [p.to_dict() for p in shown]
        data["best"] = best.to_dict()
        data["speedup_vs_batch"] = result.speedup_vs_batch(best)
        print(json.dumps(data, indent=1))
    else:
        _print_plan(result, shown)
    if args.out:
        path = result.export(best, reducer=cfg.reducer).save(args.out)
        print(
            f"wrote the {best.scenario} plan to {path} (domain styles left out: not executed yet)",
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0


def _plan_dettmers(cfg: PlanConfig, args: argparse.Namespace) -> int:
    """`plan --model-of dettmers`: Dettmers' Appendix A predictions at 32 and 8 bits."""
    from hybridpar.planning.cluster import load_cluster
    from hybridpar.planning.cost import dettmers as dm

    if args.out or args.scenario != "all":
        raise ConfigError("--model-of dettmers predicts one layout; drop --out and --scenario")
    if args.dettmers_profile:
        prof = dm.load_profile(args.dettmers_profile)
        if prof.gpus != args.procs:
            raise ConfigError(
                f"{args.dettmers_profile} describes {prof.gpus} GPUs; pass --procs {prof.gpus}"
            )
    else:
        from hybridpar.planning.analysis_cache import zoo_cost_layers

        if cfg.batch % args.procs:
            raise ConfigError(f"--batch {cfg.batch} must be a multiple of --procs {args.procs}")
        layers = zoo_cost_layers(cfg.model, cfg.input_size)
        prof = dm.profile_from_layers(
            layers, load_cluster(cfg.cluster), args.procs, cfg.batch // args.procs
        )
    preds = {b: dm.node_speedup(prof, b) for b in (32, 8)}
    paper = prof is dm.APPENDIX_A_4GPU
    out: dict = {
        "model_of": "dettmers",
        "source": prof.source,
        "gpus": prof.gpus,
        "node": {
            str(b): {
                "conv_ms": p.conv,
                "fc_ms": p.fc,
                "penalty_ms": p.penalty,
                "speedup": p.speedup,
            }
            for b, p in preds.items()
        },
    }
    if paper:
        out["paper_node"] = {str(k): v for k, v in dm.PAPER_4GPU.items()}
        out["convnet2_check"] = dm.node_speedup(prof, 32, total=dm.CONVNET2_TOTAL).speedup
        c = dm.APPENDIX_A_96GPU
        out["cluster_96"] = {
            str(s): {
                "ours": [
                    dm.cluster_speedup(c, t, s, b)["speedup"]
                    for t in (prof.total, dm.CONVNET2_TOTAL)
                    for b in (32, 8)
                ],
                "paper": list(dm.PAPER_96GPU[s]),
            }
            for s in c.sync_single
        }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"Dettmers' Appendix A model, {prof.gpus} GPUs; inputs: {prof.source}")
    print(f"{'bits':>4} {'conv ms':>8} {'fc ms':>7} {'penalty ms':>11} {'speed-up':>9}  paper")
    for b, p in preds.items():
        ref = f"{dm.PAPER_4GPU[b]:.2f}x" if paper else "-"
        print(f"{b:>4} {p.conv:8.2f} {p.fc:7.2f} {p.penalty:11.2f} {p.speedup:8.2f}x  {ref}")
    if paper:
        print(
            f"with convnet2 kernels (17 s / 96 per pass): {out['convnet2_check']:.2f}x; "
            f"Krizhevsky measured {dm.PAPER_4GPU['krizhevsky_measured']:.2f}x"
        )
        print("\n32 nodes x 3 GPUs (Table 7): ours | paper, NervanaGPU 32/8-bit, convnet2 32/8-bit")
        for s, row in out["cluster_96"].items():
            ours = " ".join(f"{v:6.2f}" for v in row["ours"])
            ref = " ".join(f"{v:6.2f}" for v in row["paper"])
            print(f"  sub-batch {s:>5}: {ours} | {ref}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from hybridpar.planning.cluster import load_cluster
    from hybridpar.planning.search import make_plan
    from hybridpar.planning.simulate import FIGURES, plot_sweep, run_sweep, write_csv

    cfg = from_namespace(PlanConfig, args)
    cluster = load_cluster(cfg.cluster)
    kwargs = cfg.plan_kwargs()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
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
    print(
        f"{'P':>6} {'best':<10} {'grid':>9} {'comm ms':>10} {'total ms':>10} {'vs batch (comm)':>16}"
    )
    for r in results:
        b = r.best
        sp = r.speedup_vs_batch()
        grid = f"{b.grid[0]}x{b.grid[1]}" if b.grid else "per layer"
        vs = f"{sp['total']:.2f}x ({sp['comm']:.1f}x)" if sp else "batch infeasible"
        print(f"{r.procs:>6} {b.scenario:<10} {grid:>9} {_ms(b.comm_s)} {_ms(b.total_s)} {vs:>16}")
    print(f"wrote {', '.join(str(p) for p in written)} in {time.perf_counter() - t0:.2f} s")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from hybridpar.commands.profile import profile_model, save
    from hybridpar.planning.cluster import cache_dir
    from hybridpar.planning.models import MODELS

    if args.model not in MODELS:
        raise ConfigError(f"unknown model {args.model!r}; choose one of: {', '.join(MODELS)}")
    table = profile_model(
        args.model, batch=args.batch, input_size=args.input_size, repeats=args.repeats
    )
    path = (
        Path(args.out)
        if args.out
        else cache_dir() / "profiles" / f"{args.model}-{args.input_size or 'default'}.json"
    )
    save(table, path)
    total_f = sum(v[0] for v in table["per_sample_s"].values())
    total_b = sum(v[1] for v in table["per_sample_s"].values())
    print(
        f"{args.model}: forward {total_f * 1e3:.3f} ms + backward {total_b * 1e3:.3f} ms per sample "
        f"({table['threads']} threads); table written to {path}"
    )
    print(f"use it with: hybridpar plan --model {args.model} --compute {path} ...")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from hybridpar.runtime.launcher import RankFailure
    from hybridpar.runtime.train.config import TrainConfig
    from hybridpar.runtime.train.run import run

    cfg = from_namespace(TrainConfig, args)
    try:
        report = run(cfg)
    except RankFailure as exc:
        print(f"hybridpar train: error: {exc}", file=sys.stderr)
        if args.verbose and exc.details:
            print(exc.details, file=sys.stderr)
        return 1

    if report is None:  # a non-zero rank under torchrun
        return 0
    _print_report(report)
    return 0


def _print_report(report: dict) -> None:
    """The outcome; the plan and the epoch lines were printed live by rank 0."""
    it, b = report["iteration"], report["bytes"]
    print(
        f"{report['model']} on {report['data']}: P={report['procs']}, "
        f"{report['preset'] or report['plan_file']}: {report['plan']['scenario']} plan; "
        f"final test accuracy {report['final']['test_acc']:.4f}; iteration {it['time_s'] * 1e3:.1f} ms "
        f"(compute {it['compute_s'] * 1e3:.1f}, communication wait {it['comm_wait_s'] * 1e3:.1f})"
    )
    bn = report.get("bn", {})
    if bn.get("requested") == "adaptive":
        when = bn["switched_at_step"]
        print(
            f"batch norm: adaptive, {f'global from step {when}: ' if when is not None else 'local throughout'}{bn['reason']}"
        )
    print(f"bytes per iteration per rank: {'term':<14} {'measured':>14} {'predicted':>14}")
    for k in sorted(set(b["measured"]) | set(b["predicted"])):
        if k in ("metrics", "codec_overhead", "bn_switch", "param_broadcast", "state"):
            continue
        print(f"{'':30}{k:<14} {b['measured'].get(k, 0):14.0f} {b['predicted'].get(k, 0):14.0f}")
    for w in report.get("written", []):
        print(f"wrote {w}")


def cmd_codecs(args: argparse.Namespace) -> int:
    from hybridpar.choices import CODECS
    from hybridpar.commands.codec_report import datasets, error_table, print_table, throughput

    if args.block < 1 or args.size < 1 or args.mlp_steps < 0:
        raise ConfigError(
            "--block must be a positive number of elements, --size positive, --mlp-steps >= 0"
        )
    rows = error_table(datasets(args.size, mlp_steps=args.mlp_steps), (None, args.block))
    speeds = None
    if not args.no_speed:
        speeds = {name: throughput(name, args.block, n=args.speed_size) for name in CODECS}
    if args.json:
        print(
            json.dumps({"block": args.block, "errors": rows, "throughput_gb_s": speeds}, indent=1)
        )
    else:
        print(
            f"8-bit codecs; scales per tensor (the paper's setting) and per {args.block} elements"
        )
        print()
        print_table(rows, speeds)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hybridpar.commands.calibration import calibrate

    d = calibrate(nproc=args.nproc, repeats=args.repeats)
    print(
        f"localhost: alpha {d['alpha'] * 1e6:.2f} us, bandwidth {1 / d['beta'] / 1e9:.3f} GB/s, "
        f"{d['flops'] / 1e9:.1f} GFLOP/s per core ({d['cores']} cores); saved to {d['path']}"
    )
    if d.get("small_alpha") is not None:
        print(f"  small all-reduce through shared memory: {d['small_alpha'] * 1e6:8.1f} us")
    if d.get("shm_beta"):
        print(f"  all-gather through shared memory: {1 / d['shm_beta'] / 1e9:8.2f} GB/s")
    for n, t in d["measured_s"].items():
        print(f"  all-reduce {int(n):>10} B on {args.nproc} ranks: {t * 1e3:8.3f} ms")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybridpar",
        description="Hybrid batch/model/domain parallel training: plan it, then run it.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="predict the cost of every scenario and pick the best")
    add_arguments(p, PlanConfig)
    p.add_argument("--procs", type=_positive_int, required=True, help="number of processes P")
    p.add_argument(
        "--scenario",
        default="all",
        choices=["all", "batch", "model", "same-grid", "fc-grid", "domain", "per-layer"],
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--out",
        default=None,
        help="write the chosen plan for `hybridpar train --plan` (domain left out)",
    )
    p.add_argument(
        "--model-of",
        default="gholami",
        choices=["gholami", "dettmers"],
        help="cost model: Gholami's alpha-beta equations (default) or Dettmers' Appendix A "
        "speed-up model (conv batch, FC model-parallel over sub-batches)",
    )
    p.add_argument(
        "--dettmers-profile",
        default=None,
        help="with --model-of dettmers: 'appendix-a' (the paper's tables) or a JSON file of "
        "per-layer times (default: from the model's FLOPs and the cluster)",
    )
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="sweep P; write a CSV and Fig. 6/7/10-style PNG charts")
    add_arguments(s, PlanConfig, skip=("reducer",))
    s.add_argument(
        "--procs", type=_int_list, required=True, help="comma-separated, e.g. 8,16,32,64"
    )
    s.add_argument("--out", default="simulate-out", help="output folder")
    s.add_argument("--no-plots", action="store_true")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_simulate)

    f = sub.add_parser(
        "profile", help="measure per-layer compute time on this machine for the planner"
    )
    f.add_argument("--model", required=True)
    f.add_argument("--batch", type=_positive_int, default=16)
    f.add_argument("--input-size", type=_positive_int, default=None)
    f.add_argument("--repeats", type=_positive_int, default=5)
    f.add_argument(
        "--out", default=None, help="where to write the table (default: the cache folder)"
    )
    f.set_defaults(func=cmd_profile)

    from hybridpar.runtime.train.config import TrainConfig

    t = sub.add_parser("train", help="train with a plan on torch.distributed and measure it")
    add_arguments(t, TrainConfig)
    t.add_argument("--verbose", action="store_true", help="print the failing rank's traceback")
    t.set_defaults(func=cmd_train)

    k = sub.add_parser("codecs", help="error (Table 2 of Dettmers) and speed of every codec")
    k.add_argument("--block", type=int, default=4096, help="elements per scale, per-block rows")
    k.add_argument(
        "--mlp-steps", type=int, default=60, help="training steps of the MNIST MLP; 0: skip it"
    )
    k.add_argument("--size", type=int, default=1 << 20, help="elements of each random sample")
    k.add_argument("--speed-size", type=_positive_int, default=1 << 24, help="elements timed")
    k.add_argument("--no-speed", action="store_true", help="errors only")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_codecs)

    c = sub.add_parser("calibrate", help="fit alpha and beta of this machine (cluster 'localhost')")
    c.add_argument("--nproc", type=_positive_int, default=2)
    c.add_argument("--repeats", type=_positive_int, default=5)
    c.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hybridpar.runtime.launcher import stop_on_signals

    restore = stop_on_signals()  # from here on SIGTERM unwinds like Ctrl-C: ranks are stopped
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"hybridpar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else 2
        print(f"hybridpar {args.command}: {Interrupted(signum)}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `hybridpar plan ... | head`
        sys.stderr.close()
        return 0
    finally:
        restore()


def entry() -> None:
    """The `hybridpar` command: main(), then exit with its code. A rank that torchrun started
    skips the interpreter's teardown, where gloo's C++ destructors can abort a process whose job
    has already finished (train.launch._leave does the same for the ranks it spawns)."""
    from hybridpar.runtime.launcher import under_torchrun

    code = main()
    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
