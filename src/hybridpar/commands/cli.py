"""Command line: `hybridpar plan | simulate | train | predict | validate | profile | codecs |
calibrate`.

Every bad input ends in one line on stderr, `hybridpar <command>: error: <what to change>`, and
exit code 2, before any work (or process) starts. The options of plan, simulate and train are
generated from their typed configs (PlanConfig, TrainConfig, and the Choices and RuntimeOptions
nested in them); the scenario names come from the planner's SCENARIOS.
"""

from __future__ import annotations

import argparse
import os
import sys

from hybridpar.commands.plans import cmd_plan, cmd_simulate
from hybridpar.commands.tools import cmd_calibrate, cmd_codecs, cmd_profile
from hybridpar.commands.training import cmd_predict, cmd_train
from hybridpar.commands.validate import cmd_validate
from hybridpar.core.cluster import CALIBRATED
from hybridpar.core.config import add_arguments, dump_toml, load_toml
from hybridpar.core.errors import ConfigError, Interrupted
from hybridpar.planning.config import PlanConfig
from hybridpar.planning.search import SCENARIOS
from hybridpar.runtime.launcher import stop_on_signals, under_torchrun
from hybridpar.runtime.train.config import PredictConfig, TrainConfig

__all__ = ["build_parser", "entry", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(low: int):
    """An argparse type: an integer of at least `low`."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be at least {low}")
        return v

    return parse


_positive_int = _at_least(1)


def _int_list(text: str) -> list[int]:
    """'8,16,32': positive integers, comma-separated, each once, nothing else."""
    parts = [t.strip() for t in text.split(",")]
    try:
        vals = [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 8,16,32"
        ) from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r} needs positive integers, e.g. 8,16,32")
    if len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"{text!r} names a count twice; give each P once")
    return vals


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict the cost of every scenario and pick the best")
    add_arguments(p, PlanConfig)
    p.add_argument(
        "--procs", "--nproc", type=_positive_int, required=True, help="number of processes P"
    )
    p.add_argument(
        "--scenario",
        default="all",
        choices=["all", *SCENARIOS],
        help="the scenario to show and export (default: all, the best of them)",
    )
    p.add_argument(
        "--mode",
        default="train",
        choices=["train", "predict"],
        help="plan a training step, or inference (`hybridpar predict`: a forward in evaluation, "
        "no gradients or optimizer state; the memory the activations alive at once)",
    )
    p.add_argument(
        "--fit",
        action="store_true",
        help="with --memory-limit: the largest image (of --input-size's or --input-shape's "
        "aspect, a volume's depth scaled too) a plan on P ranks runs under it, and that plan",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", default=None, help="write the chosen plan for `hybridpar train --plan`")
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
    _config_options(p)
    p.set_defaults(func=cmd_plan)


def _simulate_parser(sub) -> None:
    s = sub.add_parser("simulate", help="sweep P; write a CSV and Fig. 6/7/10-style PNG charts")
    add_arguments(s, PlanConfig, skip=("reducer",))
    s.add_argument(
        "--procs", "--nproc", type=_int_list, required=True, help="comma-separated, e.g. 8,16,32"
    )
    s.add_argument("--out", default="simulate-out", help="output folder")
    s.add_argument("--no-plots", action="store_true", help="write the CSV only, no PNG charts")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument(
        "--handoffs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="also price Krizhevsky's hand-off schemes (a), (b), (c) with N examples per worker "
        "for K = each --procs (handoff_ratio.csv/.png: exposed hand-off over compute)",
    )
    s.set_defaults(func=cmd_simulate)


def _profile_parser(sub) -> None:
    f = sub.add_parser(
        "profile", help="measure a model's compute here, for plans on any cluster (--compute)"
    )
    f.add_argument("--model", required=True, help="zoo model or package.module:factory")
    f.add_argument(
        "--batch",
        type=_positive_int,
        default=16,
        help="global batch B: every batch a rank of the job runs (B / Pc) is timed",
    )
    f.add_argument(
        "--procs",
        "--nproc",
        type=_positive_int,
        default=1,
        help="the job's ranks P, sharing this machine's cores as they would a host's",
    )
    f.add_argument("--input-size", type=_positive_int, default=None, help="image height and width")
    f.add_argument("--input-shape", default=None, help="C,H,W of one example, for a factory")
    f.add_argument("--repeats", type=_positive_int, default=5, help="timed iterations per layer")
    f.add_argument("--out", default=None, help="the profile's path (default: the cache folder)")
    f.set_defaults(func=cmd_profile)


def _measuring_parsers(sub) -> None:
    _profile_parser(sub)
    k = sub.add_parser("codecs", help="error (Table 2 of Dettmers) and speed of every codec")
    k.add_argument("--block", type=int, default=4096, help="elements per scale, per-block rows")
    k.add_argument("--mlp-steps", type=int, default=60, help="MNIST MLP training steps; 0: none")
    k.add_argument("--size", type=int, default=1 << 20, help="elements of each random sample")
    k.add_argument("--speed-size", type=_positive_int, default=1 << 24, help="elements timed")
    k.add_argument("--no-speed", action="store_true", help="errors only")
    k.add_argument("--json", action="store_true", help="print the tables as JSON")
    k.set_defaults(func=cmd_codecs)

    c = sub.add_parser("calibrate", help="fit alpha and beta of this machine (cluster 'localhost')")
    c.add_argument(
        "--nproc",
        "--procs",
        type=_int_list,
        default=list(CALIBRATED),
        help="ranks to time the collectives on, comma-separated: the first gives alpha and beta, "
        "each is kept for pricing jobs of that many ranks (default 2,3,4)",
    )
    c.add_argument("--repeats", type=_positive_int, default=5, help="timings per size")
    c.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="calibrate the CPU, or the GPUs (a CUDA job is priced with that calibration only)",
    )
    c.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="the collectives to time on the GPUs: nccl (a GPU per rank), gloo (ranks sharing "
        "GPUs), auto (nccl where every rank has a GPU)",
    )
    c.add_argument(
        "--check",
        action="store_true",
        help="measure a sample of the cached calibration and compute profiles again and say "
        "whether they still hold on this machine (exit 1 where one does not); saves nothing",
    )
    c.set_defaults(func=cmd_calibrate)


# `hybridpar train --help`, by concern (every option of TrainConfig and the configs in it)
TRAIN_CONCERNS = {
    "model and data": (
        "model",
        "data",
        "loss",
        "choices.joined_loss",
        "input_size",
        "input_shape",
        "max_steps",
    ),
    "optimisation": (
        "epochs",
        "batch",
        "lr",
        "momentum",
        "weight_decay",
        "schedule",
        "base_batch",
        "scale_rule",
        "choices.amp",
        "runtime.allow_nonfinite",
    ),
    "plan": (
        "nproc",
        "preset",
        "plan",
        "cluster",
        "handoff",
        "rounds",
        "runtime.variable_batch",
        "memory_limit",
        "verify",
    ),
    "communication": (
        "choices.codec",
        "choices.compress",
        "choices.reducer",
        "runtime.bucket_mb",
        "runtime.codec_block",
        "runtime.error_feedback",
        "runtime.host_stage_mb",
        "runtime.shared_memory",
    ),
    "batch norm": (
        "choices.bn",
        "runtime.bn_max_batch",
        "runtime.bn_window",
        "runtime.bn_threshold",
        "runtime.bn_signal",
    ),
    "compute": (
        "runtime.compile",
        "runtime.compile_backend",
        "choices.activation_checkpointing",
        "choices.shard_states",
    ),
    "checkpoints": ("save", "checkpoint_dir", "checkpoint_every", "checkpoint_keep", "resume"),
    "runtime": (
        "choices.device",
        "choices.backend",
        "runtime.seed",
        "runtime.timeout_s",
        "report",
        "tensorboard",
        "profile_trace",
        "quiet",
        "progress",
    ),
}


def _config_options(p) -> None:
    """--config and --print-config on a command of CONFIGURED."""
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of this command's options (keys as --print-config writes them, "
        "a nested config's in its own table: [choices], [runtime]); flags override it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the options in effect as TOML (that --config reads back) and do nothing else",
    )


def _validate_parser(sub) -> None:
    v = sub.add_parser(
        "validate",
        help="run the planner's best plans and the presets; predicted vs measured time per plan",
    )
    add_arguments(v, PlanConfig)
    v.set_defaults(cluster="localhost")  # validate runs here: its help says so
    for action in v._actions:
        if action.dest == "cluster":
            action.help = action.help.rsplit(" (default:", 1)[0] + " (default: localhost)"
    v.add_argument(
        "--procs", "--nproc", type=_positive_int, required=True, help="number of processes P"
    )
    v.add_argument("--top", type=_positive_int, default=6, help="the planner's N cheapest plans")
    v.add_argument(
        "--presets",
        default="ddp",
        help="fixed presets run beside them, comma-separated (ddp, owt, batch, model, grid:RxC); "
        "'' for none",
    )
    v.add_argument("--steps", type=_positive_int, default=6, help="iterations per run")
    v.add_argument("--repeat", type=_positive_int, default=2, help="interleaved rounds (noise)")
    v.add_argument(
        "--confirm",
        type=_at_least(0),
        default=3,
        help="rounds more of the pick and of the plans measured faster or within 10 %% of it "
        "(0: none)",
    )
    v.add_argument("--data", default=None, help="training data (default: synthetic, B x steps)")
    v.add_argument(
        "--out",
        default="validate-out",
        help="folder for validate.json, validate.png and the plans it ran, plans/ "
        "(default: validate-out)",
    )
    v.add_argument("--quiet", action="store_true", help="no line per run")
    _config_options(v)
    v.set_defaults(func=cmd_validate)


def _in_effect(args: argparse.Namespace) -> argparse.Namespace:
    """The options a command runs with: train's model, nproc and batch as it takes them without
    a plan file (with one, the file's, which a config must not repeat)."""
    if args.command == "train" and args.plan is None:
        from hybridpar.runtime.train.config import DEFAULTS

        for key, value in DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    return args


def build_parser() -> argparse.ArgumentParser:
    from hybridpar import __version__

    parser = _Parser(
        prog="hybridpar",
        description="Hybrid batch/model/domain parallel training: plan it, then run it.",
    )
    parser.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _plan_parser(sub)
    _simulate_parser(sub)
    t = sub.add_parser("train", help="train with a plan on torch.distributed and measure it")
    groups = add_arguments(t, TrainConfig, concerns=TRAIN_CONCERNS)
    groups["runtime"].add_argument(
        "--verbose", action="store_true", help="print the failing rank's traceback"
    )
    _config_options(t)
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("predict", help="a trained net's masks of whole images, written by band")
    add_arguments(r, PredictConfig)
    r.set_defaults(func=cmd_predict)
    _validate_parser(sub)
    _measuring_parsers(sub)
    return parser


# the commands a TOML file can configure (`--config`), and print their options as one
CONFIGURED = ("plan", "train", "validate")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments, over the values of `--config FILE` where a command was given one: the
    file's values become the options' defaults (a required option the file gives is no longer
    required), so every flag on the command line overrides them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if known.config and command in CONFIGURED:
        sub = parser._subparsers._group_actions[0].choices[command]
        values = load_toml(sub, known.config)
        for a in sub._actions:
            if a.dest in values:
                a.required = False
        sub.set_defaults(**values)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    restore = stop_on_signals()  # from here on SIGTERM unwinds like Ctrl-C: ranks are stopped
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a bare `hybridpar`: what it can do
        parser.print_help(sys.stderr)
        restore()
        return 2
    try:
        args = _parse(parser, argv)
    except ConfigError as exc:
        command = next((a for a in argv if not a.startswith("-")), "")
        print(f"hybridpar {command}: error: {exc}", file=sys.stderr)
        restore()
        return 2
    if getattr(args, "print_config", False):
        sub = parser._subparsers._group_actions[0].choices[args.command]
        print(dump_toml(sub, _in_effect(args)), end="")
        restore()
        return 0
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
    has already finished (runtime.launcher._leave does the same for the ranks it spawns)."""
    code = main()
    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
