"""RuntimeOptions: how the runtime executes a plan, as opposed to what the plan says.

The plan (hybridpar.core.plan) and its choices (hybridpar.core.choices) decide what runs and what it costs;
these knobs change neither the result (beyond the codec's block size and error feedback, which
shape 8-bit rounding) nor the bytes, only how the work is scheduled. One typed dataclass, torch-
free, that `parallelize`, `HybridTrainer` and `hybridpar train` (its flags are generated from it)
all take.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from hybridpar.core.config import check_fields, meta
from hybridpar.core.errors import ConfigError

__all__ = ["RuntimeOptions"]


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime runs a plan: seeds, timeouts, buckets, codec blocks, adaptive BN."""

    seed: int = meta(0, "seed of the model, the data order and dropout")
    timeout_s: float | None = meta(
        300.0,
        "collective timeout in seconds: a dead or hung rank ends the job within it "
        "(parallelize's groups: the default group's when None)",
        flag="--timeout",
        positive=True,
    )
    bucket_mb: float = meta(4.0, "gradient bucket size in MB", positive=True)
    codec_block: int = meta(
        4096, "elements per 8-bit scale (0: one per tensor, as in the paper)", nonneg=True
    )
    error_feedback: bool = meta(False, "add what gradient compression lost back at the next step")
    host_stage_mb: float = meta(
        1.0,
        "the host reducer sums a bucket in stages of this many MB as it is packed (0: one)",
        nonneg=True,
    )
    shared_memory: bool = meta(
        True,
        "activations' and small collectives through host shared memory where a group's ranks "
        "share a host",
        flag="--no-shared-memory",
    )
    allow_nonfinite: bool = meta(False, "go on when the loss is NaN or infinite")
    variable_batch: bool = meta(
        False,
        "Krizhevsky 4.2: with a hand-off sent in K rounds (--handoff b or c), step the layers "
        "after it after every round (batch B/K there) and the layers before it once (batch B)",
    )
    bn_max_batch: int | None = meta(
        None,
        "adaptive BN: local BN throughout when the global batch is at least this",
        positive=True,
    )
    bn_window: int = meta(
        50, "adaptive BN: steps per window of the convergence signal", positive=True
    )
    bn_threshold: float = meta(
        0.01,
        "adaptive BN: turn global when a window's signal improves by less than this (relative)",
        nonneg=True,
    )
    bn_signal: Literal["accuracy", "loss"] = meta(
        "accuracy",
        "adaptive BN: what must converge, training accuracy (Liu et al. 4.3) or training loss",
    )

    compile: bool = meta(
        False,
        "torch.compile each rank's compute: every part of the model with no hybridpar collective "
        "in it (the collectives stay eager)",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = meta(
        "inductor", "the torch.compile backend of --compile"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"--seed must be an integer, got {self.seed!r}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def stage_bytes(self) -> int:
        return int(self.host_stage_mb * 2**20)

    @property
    def block(self) -> int | None:
        """The codec's block size (None: one scale per tensor)."""
        return self.codec_block or None

    def with_(self, **changes: Any) -> RuntimeOptions:
        return replace(self, **changes)
