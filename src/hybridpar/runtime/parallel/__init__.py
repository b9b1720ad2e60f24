"""The runtime's parallel layer: styles that apply themselves (batch.py, model.py), the engines
that run a plan (HybridParallel, DDPEngine) behind `parallelize`, global batch norm, gradient
synchronisation, checkpoints, and HybridTrainer, the one training step."""

from hybridpar.runtime.parallel.api import parallelize
from hybridpar.runtime.parallel.batchnorm import (
    AdaptiveGlobalBatchNorm,
    BNSwitch,
    GlobalBatchNorm,
    GlobalBatchNorm1d,
    GlobalBatchNorm2d,
    GlobalStatistics,
    LossPlateau,
    Plateau,
    convert_global_batchnorm,
)
from hybridpar.runtime.parallel.ddp import DDPEngine
from hybridpar.runtime.parallel.engine import Engine
from hybridpar.runtime.parallel.hybrid import HybridParallel
from hybridpar.runtime.parallel.layout import Layout, resolve
from hybridpar.runtime.parallel.model import ModelSplit, split_units
from hybridpar.runtime.parallel.redistribute import Redistribute
from hybridpar.runtime.parallel.styles import ParallelStyle
from hybridpar.runtime.parallel.sync import GradSync
from hybridpar.runtime.parallel.trainer import HybridTrainer, StepResult

__all__ = [
    "AdaptiveGlobalBatchNorm",
    "BNSwitch",
    "DDPEngine",
    "Engine",
    "GlobalBatchNorm",
    "GlobalBatchNorm1d",
    "GlobalBatchNorm2d",
    "GlobalStatistics",
    "GradSync",
    "HybridParallel",
    "HybridTrainer",
    "Layout",
    "LossPlateau",
    "ModelSplit",
    "ParallelStyle",
    "Plateau",
    "Redistribute",
    "StepResult",
    "convert_global_batchnorm",
    "parallelize",
    "resolve",
    "split_units",
]
