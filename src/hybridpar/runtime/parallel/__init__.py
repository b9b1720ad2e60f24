"""Parallel layers and `parallelize`, which applies a ParallelPlan to an unmodified model."""

from hybridpar.runtime.parallel.api import HybridParallel, parallelize
from hybridpar.runtime.parallel.batchnorm import (
    AdaptiveGlobalBatchNorm,
    BNSwitch,
    GlobalBatchNorm,
    GlobalBatchNorm1d,
    GlobalBatchNorm2d,
    LossPlateau,
    convert_global_batchnorm,
)
from hybridpar.runtime.parallel.layout import Layout, resolve
from hybridpar.runtime.parallel.model import ModelParallelConv2d, ModelParallelLinear
from hybridpar.runtime.parallel.redistribute import Redistribute
from hybridpar.runtime.parallel.sync import GradSync
from hybridpar.runtime.parallel.trainer import HybridTrainer

__all__ = [
    "AdaptiveGlobalBatchNorm",
    "BNSwitch",
    "GlobalBatchNorm",
    "GlobalBatchNorm1d",
    "GlobalBatchNorm2d",
    "GradSync",
    "HybridParallel",
    "HybridTrainer",
    "Layout",
    "LossPlateau",
    "ModelParallelConv2d",
    "ModelParallelLinear",
    "Redistribute",
    "convert_global_batchnorm",
    "parallelize",
    "resolve",
]
