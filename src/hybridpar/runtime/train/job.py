"""Job: what `hybridpar train` hands every rank, decided once in the parent (or in the launching
process under torchrun): the user's config as given, what the run takes from the plan file, the
defaults and this machine (model, processes, batch, choices with the device, where the weights
go), the data's shape, the model's trace and layers (so no rank traces the model again), and the
plan resolved against the model when it is known before the ranks start (a fixed preset or a
plan file; a searched preset is decided by rank 0 in the job, from these layers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from hybridpar.core.analysis import Trace
from hybridpar.core.choices import Choices
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import ParallelPlan
from hybridpar.runtime.parallel.layout import Layout
from hybridpar.runtime.train.config import TrainConfig

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    cfg: TrainConfig
    """as the user gave it; the fields below say what the run decided where it left them open"""
    model: str
    procs: int
    batch: int
    choices: Choices
    """the plan file's or the config's, with the device and backend of this machine"""
    save: str
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

    def config(self) -> dict:
        """The config as the run used it (for reports and checkpoints): the user's, with what
        the job decided."""
        decided = {"model": self.model, "nproc": self.procs, "batch": self.batch, "save": self.save}
        return {**self.cfg.to_dict(), **decided, "choices": asdict(self.choices)}
