"""The one typed configuration of a training run. `hybridpar train`'s options are generated from
it, and it is checked when it is made, before any process is spawned. The plan's choices (codec, bn, ...)
and the runtime's knobs (bucket size, seed, timeout, ...) are the dataclasses the library takes
too, nested: hybridpar.core.choices.Choices and hybridpar.runtime.options.RuntimeOptions."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from hybridpar.core.choices import Choices
from hybridpar.core.config import check_fields, evolve, meta, nested
from hybridpar.core.errors import ConfigError
from hybridpar.core.rules import why_not_choices
from hybridpar.core.zoo import parse_input_shape, shape_option, size_option
from hybridpar.planning.presets import parse_preset
from hybridpar.runtime.options import RuntimeOptions

__all__ = ["DEFAULTS", "DEFAULT_MODEL", "LOSSES", "PredictConfig", "TrainConfig"]

DEFAULT_MODEL = "digits-wide"
LOSSES = ("cross-entropy", "dice", "dice+ce", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
          "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits")  # fmt: skip
"""--loss's names: ours, and torch.nn.functional's (else a user's factory)"""
DEFAULTS = {"model": DEFAULT_MODEL, "nproc": 4, "batch": 64}
"""what model, nproc and batch are when neither the command line nor a plan file gives them"""


@dataclass(frozen=True)
class TrainConfig:
    model: str | None = meta(
        None,
        f"zoo model or your own, package.module:factory (a function returning an nn.Module; "
        f"num_classes= passed when it takes it) (default: the plan's, else {DEFAULT_MODEL})",
    )
    data: str = meta("digits", "digits | synthetic[:N] | file.npz | image folder")
    loss: str = meta(
        "cross-entropy",
        "cross-entropy | dice | dice+ce (soft Dice of a class per pixel, plus the cross-entropy) "
        "| a torch.nn.functional loss by its name (cross_entropy, nll_loss, mse_loss, ...) | "
        "your own, package.module:factory (a function returning a torch loss module or "
        "function, or any loss: runtime/parallel/losses.py)",
    )
    nproc: int | None = meta(
        None,
        f"local processes (default: the plan's, else {DEFAULTS['nproc']}; torchrun decides when "
        "it starts us)",
        aliases=["--procs"],
        positive=True,
    )
    preset: str = meta(
        "auto",
        "a named plan: auto (the planner's best on --cluster), ddp (torch DDP), "
        "owt (FC layers pure model), grid:RxC (conv batch, FC on an R x C grid), or a "
        "planner scenario: batch, model, same-grid, fc-grid, domain, per-layer",
        aliases=["--strategy"],
    )
    plan: str | None = meta(
        None, "a plan file written by `hybridpar plan ... --out` (instead of --preset)"
    )
    cluster: str = meta(
        "localhost",
        "cluster the presets are planned on and predictions priced for "
        "(localhost is calibrated on first use)",
    )
    epochs: int = meta(20, "passes over the training data", positive=True)
    batch: int | None = meta(
        None,
        "global mini-batch B (default: the plan's, else 64); every batch group's share must be "
        "whole, and B may be below the number of processes where the plan splits images",
        positive=True,
    )
    lr: float = meta(0.05, "learning rate", positive=True)
    momentum: float = meta(0.9, "momentum")
    weight_decay: float = meta(5e-4, "weight decay", nonneg=True)
    schedule: Literal["constant", "krizhevsky", "cosine"] = meta(
        "constant", "learning-rate schedule (krizhevsky: x 250^(-1/3) at 25, 50 and 75 %)"
    )
    base_batch: int | None = meta(
        None,
        "the batch --lr and --weight-decay were tuned for; --scale-rule scales them to --batch",
        positive=True,
    )
    scale_rule: Literal["none", "linear", "sqrt"] = meta(
        "none",
        "Krizhevsky section 5 for a k times larger batch: linear (lr x k, his practice) or sqrt "
        "(lr x sqrt(k), weight decay keeping k steps' decay)",
    )
    handoff: Literal["a", "b", "c", "auto"] | None = meta(
        None,
        "Krizhevsky's hand-off into model-parallel layers: a (one all-gather), b (each rank's "
        "batch in turn), c (1/K of every rank's batch per round, --rounds K), auto (the "
        "planner's pick); b and c overlap each round with the layers after it (default: the "
        "plan's, else a)",
    )
    rounds: int | None = meta(
        None,
        "rounds of --handoff c (default: one per rank that gathers, the paper's K)",
        positive=True,
    )
    memory_limit: float | None = meta(
        None,
        "GiB per process: the planner's plans keep each rank's predicted bytes (parameters, "
        "gradients, momentum, what autograd keeps for backward) under it",
        positive=True,
    )
    input_size: int | None = size_option("the data's or the model's")
    input_shape: str | None = shape_option(" (default: the data's; needed with synthetic data)")
    report: str | None = meta(
        None, "JSON report path (a PNG of the curves and a JSON-lines log go next to it)"
    )
    save: str | None = meta(
        None,
        "where rank 0 writes the trained weights, a state_dict for plain torch.load "
        "(default: final.pt in --checkpoint-dir, else runs/<model>.pt)",
    )
    checkpoint_dir: str | None = meta(
        None, "write checkpoints (torch.distributed.checkpoint) here; a folder every rank can write"
    )
    checkpoint_every: int = meta(0, "steps between checkpoints (0: only at the end)", nonneg=True)
    checkpoint_keep: int = meta(2, "checkpoints kept in --checkpoint-dir", positive=True)
    resume: str | None = meta(
        None,
        "a checkpoint (or a --checkpoint-dir) to go on from, on this or another plan and P; "
        "auto: --checkpoint-dir's latest if there is one (what a torchrun restart wants)",
    )
    verify: bool = meta(
        True,
        "before the first step, check the plan on a small float64 copy of the model against one "
        "process (a plan that computes something else stops, naming the first module that "
        "differs)",
        flag="--no-verify",
    )
    quiet: bool = meta(False, "no live lines on stdout (the log next to --report still has them)")
    progress: bool = meta(True, "a progress bar on a terminal", flag="--no-progress")
    max_steps: int | None = meta(None, "cap the steps per epoch (benchmarks)", positive=True)
    tensorboard: str | None = meta(
        None,
        "write TensorBoard scalars here (rank 0): loss, learning rate and iteration time per "
        "step, loss, accuracy and time per epoch, measured next to predicted time and bytes "
        "(needs `pip install tensorboard`)",
    )
    profile_trace: str | None = meta(
        None,
        "write a torch.profiler trace of 3 steps after the first of every rank here, "
        "rank<r>.json (chrome://tracing, Perfetto), hybridpar's collectives named by term and layer",
    )
    choices: Choices = nested(Choices)
    runtime: RuntimeOptions = nested(RuntimeOptions)

    def __post_init__(self) -> None:
        """Every TrainConfig is checked when it is made (a copy by `with_` too): a one-line
        ConfigError says what to change."""
        check_fields(self)
        if self.rounds is not None and self.handoff != "c":
            raise ConfigError("--rounds is for --handoff c; drop it or add --handoff c")
        if self.runtime.variable_batch and self.plan is None and self.handoff not in ("b", "c"):
            raise ConfigError(
                "--variable-batch steps the layers after a hand-off once per round: send it in "
                "rounds with --handoff b or c"
            )
        if self.handoff in ("b", "c") and self.choices.activation_checkpointing:
            raise ConfigError(
                f"--activation-checkpointing cannot recompute a hand-off sent in rounds "
                f"(--handoff {self.handoff}); use --handoff a or drop the checkpointing"
            )
        if self.handoff == "auto" and self.plan is not None:
            raise ConfigError(
                "--handoff auto asks the planner; with --plan name a scheme (a, b or c)"
            )
        if self.scale_rule != "none" and self.base_batch is None:
            raise ConfigError(f"--scale-rule {self.scale_rule} scales from --base-batch: give one")
        if self.resume == "auto" and not self.checkpoint_dir:
            raise ConfigError("--resume auto resumes from --checkpoint-dir: give one")
        if self.input_shape is not None:
            parse_input_shape(self.input_shape)
        if self.loss not in LOSSES and ":" not in self.loss:
            raise ConfigError(
                f"--loss {self.loss!r}: give one of {', '.join(LOSSES[:3])}, a "
                f"torch.nn.functional loss ({', '.join(LOSSES[3:])}) or your own, "
                "package.module:factory"
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        why = why_not_choices(self.choices, [])  # what no plan could run with
        if why:
            raise ConfigError(why)
        parse_preset(self.preset, self.nproc or 1, check_procs=False)
        if self.plan is not None and self.preset != "auto":
            raise ConfigError("give --plan or --preset, not both")

    def with_(self, **changes) -> TrainConfig:
        """A copy with fields changed by their flag names (a choice or a runtime option too)."""
        return evolve(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PredictConfig:
    model: str = meta(
        None, "the zoo model or package.module:factory the weights are of", required=True
    )
    weights: str = meta(
        None, "the trained weights: a state_dict `hybridpar train --save` wrote", required=True
    )
    data: str = meta(
        None,
        "the images: file.npz, .h5, .zarr or a folder of x.npy (their x), digits-seg:S[:N], or "
        "a folder of images (PNG, TIFF, NIfTI; its images/ where it has one) of any sizes; "
        "labels are not read",
        required=True,
    )
    out: str = meta("predictions", "folder for NAME.mask.npy (and NAME.probabilities.npy)")
    nproc: int = meta(1, "local processes", aliases=["--procs"], positive=True)
    preset: str = meta(
        "domain",
        "the plan of each image size: a planner scenario (domain: bands or tiles; per-layer, "
        "batch, model, ...) or a fixed preset (ddp, grid:RxC), planned for one image at a time",
    )
    plan: str | None = meta(None, "a plan file for the images' one size (instead of --preset)")
    cluster: str = meta("localhost", "cluster the plans are made for (bytes only uncalibrated)")
    memory_limit: float | None = meta(
        None, "GiB per process the plans keep each rank's predicted bytes under", positive=True
    )
    probabilities: bool = meta(False, "also write every class's probability (softmax) per pixel")
    dtype: Literal["float16", "float32", "float64"] = meta(
        "float16", "the probabilities' type; float64 also runs the net in float64"
    )
    quiet: bool = meta(False, "no line per image")

    def __post_init__(self) -> None:
        check_fields(self)
        parse_preset(self.preset, self.nproc, check_procs=False)
        if self.plan is not None and self.preset != "domain":
            raise ConfigError("give --plan or --preset, not both")
