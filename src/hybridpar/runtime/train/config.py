"""The one typed configuration of a training run. `hybridpar train`'s options are generated from
it; `validate` checks it once, before any process is spawned."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from hybridpar.choices import parse_compress
from hybridpar.config import BN, Codec, Reducer, check_fields, meta, positive
from hybridpar.errors import ConfigError
from hybridpar.planning.presets import SEARCHED, parse_preset

__all__ = ["DEFAULT_MODEL", "TrainConfig"]

DEFAULT_MODEL = "digits-wide"


@dataclass(frozen=True)
class TrainConfig:
    model: str | None = meta(None, f"zoo model (default: the plan's, else {DEFAULT_MODEL})")
    data: str = meta("digits", "digits | synthetic[:N] | file.npz | image folder")
    nproc: int | None = meta(
        None, "local processes (default: the plan's, else 4; torchrun decides when it starts us)"
    )
    preset: str = meta(
        "auto",
        "a named plan: auto (the planner's best on --cluster), ddp (torch DDP), "
        "owt (FC layers pure model), grid:RxC (conv batch, FC on an R x C grid), or a "
        "planner scenario: batch, model, same-grid, fc-grid, per-layer",
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
    epochs: int = meta(20, "passes over the training data")
    batch: int | None = meta(None, "global mini-batch B (default: the plan's, else 64)")
    lr: float = meta(0.05, "learning rate")
    momentum: float = meta(0.9, "momentum")
    weight_decay: float = meta(5e-4, "weight decay")
    schedule: Literal["constant", "krizhevsky", "cosine"] = meta(
        "constant", "learning-rate schedule (krizhevsky: x 250^(-1/3) at 25, 50 and 75 %)"
    )
    base_batch: int | None = meta(
        None,
        "the batch --lr and --weight-decay were tuned for; --scale-rule scales them to --batch",
    )
    scale_rule: Literal["none", "linear", "sqrt"] = meta(
        "none",
        "Krizhevsky section 5 for a k times larger batch: linear (lr x k, his practice) or sqrt "
        "(lr x sqrt(k), weight decay keeping k steps' decay)",
    )
    seed: int = meta(0, "seed of the model, the data order and dropout")
    input_size: int | None = meta(None, "image side, e.g. 64 (default: the data's or the model's)")
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
    checkpoint_every: int = meta(0, "steps between checkpoints (0: only at the end)")
    checkpoint_keep: int = meta(2, "checkpoints kept in --checkpoint-dir")
    resume: str | None = meta(
        None,
        "a checkpoint (or a --checkpoint-dir) to go on from, on this or another plan and P; "
        "auto: --checkpoint-dir's latest if there is one (what a torchrun restart wants)",
    )
    device: Literal["auto", "cpu", "cuda"] = meta(
        "auto",
        "where each rank computes: cuda (one GPU per rank, NCCL), cpu (gloo), or auto "
        "(cuda where there is a GPU for every local rank)",
    )
    amp: Literal["none", "bf16"] = meta(
        "none", "mixed precision: bf16 autocast of the forward pass"
    )
    allow_nonfinite: bool = meta(False, "go on when the loss is NaN or infinite")
    quiet: bool = meta(False, "no live lines on stdout (the log next to --report still has them)")
    timeout_s: float = meta(
        300.0,
        "collective timeout in seconds: a dead or hung rank ends the job within it",
        flag="--timeout",
    )
    bucket_mb: float = meta(4.0, "gradient bucket size in MB")
    progress: bool = meta(True, "progress bar", flag="--no-progress")
    max_steps: int | None = meta(None, "cap the steps per epoch (benchmarks)")
    codec: Codec = meta("none", "wire encoding of gradients and/or activations (see --compress)")
    compress: str = meta(
        "grads,activations", "what the codec applies to: grads, activations or both"
    )
    codec_block: int = meta(4096, "elements per 8-bit scale (0: one per tensor, as in the paper)")
    error_feedback: bool = meta(False, "add what gradient compression lost back at the next step")
    reducer: Reducer = meta(
        "process-group",
        "gradient sums: torch.distributed all-reduce, or host shared memory (Sekiyama et al.)",
    )
    bn: BN = meta(
        "global",
        "batch-norm statistics: per rank (local), over the whole batch (global), "
        "or local until the training loss converges, then global (adaptive, Liu et al. 4.3)",
    )
    bn_max_batch: int | None = meta(
        None, "adaptive: local BN throughout when the global batch is at least this"
    )
    bn_window: int = meta(50, "adaptive: steps per loss window")
    bn_threshold: float = meta(
        0.01,
        "adaptive: turn global when a window's loss improves by less than this (relative)",
    )

    def validate(self) -> TrainConfig:
        """Check every field once; raise a one-line ConfigError saying what to change."""
        check_fields(self)
        positive(
            self,
            "nproc",
            "epochs",
            "batch",
            "lr",
            "timeout_s",
            "bucket_mb",
            "max_steps",
            "input_size",
            "bn_window",
            "bn_max_batch",
            "base_batch",
        )
        positive(
            self, "weight_decay", "codec_block", "bn_threshold", "checkpoint_every", allow_zero=True
        )
        positive(self, "checkpoint_keep")
        if self.scale_rule != "none" and self.base_batch is None:
            raise ConfigError(f"--scale-rule {self.scale_rule} scales from --base-batch: give one")
        if self.resume == "auto" and not self.checkpoint_dir:
            raise ConfigError("--resume auto resumes from --checkpoint-dir: give one")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        parse_compress(self.compress)
        if (
            self.reducer == "host"
            and self.codec != "none"
            and "grads" in parse_compress(self.compress)
        ):
            raise ConfigError(
                "--reducer host sums float32 gradients; use --compress activations or --codec none"
            )
        parse_preset(self.preset, self.nproc or 1, check_procs=False)
        if self.plan is not None and self.preset != "auto":
            raise ConfigError("give --plan or --preset, not both")
        return self

    @property
    def searched(self) -> bool:
        """Whether the plan is chosen by the planner on a cluster (rank 0 decides, in the job)."""
        return self.plan is None and self.preset in SEARCHED

    def with_(self, **changes) -> TrainConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
