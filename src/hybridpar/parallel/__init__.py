"""Parallel layers and `parallelize`, which applies a ParallelPlan to an unmodified model."""

from hybridpar.parallel.api import HybridParallel, parallelize
from hybridpar.parallel.batchnorm import (
    AdaptiveGlobalBatchNorm,
    BNSwitch,
    GlobalBatchNorm,
    GlobalBatchNorm1d,
    GlobalBatchNorm2d,
    LossPlateau,
    convert_global_batchnorm,
)
from hybridpar.parallel.layout import Layout, resolve
from hybridpar.parallel.model import ModelParallelConv2d, ModelParallelLinear
from hybridpar.parallel.redistribute import Redistribute
from hybridpar.parallel.sync import GradSync
from hybridpar.parallel.trainer import HybridTrainer

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
