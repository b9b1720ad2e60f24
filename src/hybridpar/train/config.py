"""The one typed configuration of a training run; the CLI fills it and validates it before spawning."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from hybridpar.errors import ConfigError

__all__ = ["TrainConfig", "parse_strategy"]


@dataclass
class TrainConfig:
    model: str = "digits-cnn"
    """zoo model name"""
    data: str = "digits"
    """digits | synthetic[:N] | file.npz | image folder"""
    nproc: int = 4
    """processes to spawn (ignored under torchrun, which decides)"""
    strategy: str = "auto"
    """auto (the planner's choice on localhost) | ddp (torch DDP baseline) | owt (FC pure model, P x 1) | grid:PRxPC"""
    epochs: int = 20
    batch: int = 64
    """global mini-batch B"""
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "constant"
    """constant | krizhevsky (x 250^-1/3 at 25/50/75 %) | cosine"""
    seed: int = 0
    input_size: int | None = None
    report: str | None = None
    """JSON report path; a PNG of the curves is written next to it"""
    timeout_s: float = 300.0
    """collective timeout: a dead or hung rank ends the job within this"""
    bucket_mb: float = 4.0
    progress: bool = True
    max_steps: int | None = None
    """stop each epoch after this many steps (benchmarks)"""
    codec: str = "none"
    """wire encoding: none | fp16 | bf16 | dynamic-tree | linear | mantissa | static-tree"""
    compress: str = "grads,activations"
    """what the codec applies to: grads (weight-gradient reductions), activations (model-parallel
    all-gathers, dX all-reduces, the hand-off), or both"""
    codec_block: int = 4096
    """elements per absmax scale of the 8-bit codecs; 0: one scale per tensor (as in the paper)"""
    error_feedback: bool = False
    """keep what gradient compression lost and add it back at the next step"""
    reducer: str = "process-group"
    """process-group (all-reduce over torch.distributed) | host (shared-memory accumulation on
    each host, one all-reduce per host across hosts; Sekiyama et al.)"""
    bn: str = "global"
    """local (each rank's own examples, DDP's behaviour) | global (the whole batch, as on one
    process) | adaptive (global until bn_max_batch or convergence, then local)"""
    bn_max_batch: int | None = None
    """adaptive: keep BN local from the start when the per-rank batch is at least this"""
    bn_window: int = 50
    """adaptive: steps per loss window of the convergence rule"""
    bn_threshold: float = 0.01
    """adaptive: converged when a window's mean loss improves on the previous by less than this"""
    grid: tuple[int, int] | None = None
    """resolved from the strategy before spawning"""

    def to_dict(self) -> dict:
        return asdict(self)


def parse_strategy(strategy: str, nproc: int) -> tuple[str, tuple[int, int] | None]:
    """(kind, grid): kind is ddp, hybrid or auto; grid (Pr, Pc) where known."""
    if strategy == "ddp":
        return "ddp", (1, nproc)
    if strategy == "owt":
        return "hybrid", (nproc, 1)
    if strategy == "auto":
        return "auto", None
    m = re.fullmatch(r"grid:(\d+)x(\d+)", strategy)
    if not m:
        raise ConfigError(
            f"unknown strategy {strategy!r}; use auto, ddp, owt or grid:PRxPC (e.g. grid:2x2)"
        )
    pr, pc = int(m.group(1)), int(m.group(2))
    if pr * pc != nproc:
        raise ConfigError(
            f"grid {pr}x{pc} has {pr * pc} ranks but --nproc is {nproc}; use Pr*Pc = {nproc}"
        )
    return "hybrid", (pr, pc)
