"""Job: what `hybridpar train` hands every rank, decided once in the parent (or in the launching
process under torchrun): the checked config, the data's shape, the model's trace and layers (so
no rank traces the model again), and the plan resolved against the model when it is known before
the ranks start (a fixed preset or a plan file; a searched preset is decided by rank 0 in the
job, from these layers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridpar.core.analysis import Trace
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import ParallelPlan
from hybridpar.runtime.parallel.layout import Layout
from hybridpar.runtime.train.config import TrainConfig

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    cfg: TrainConfig
    procs: int
    input_shape: tuple[int, ...]
    num_classes: int
    trace: Trace
    layers: list[CostLayer]
    layout: Layout | None
    """the plan resolved against the model; None when rank 0 plans in the job"""
    resume: Path | None = None

    @property
    def plan(self) -> ParallelPlan | None:
        return self.layout.plan if self.layout is not None else None
