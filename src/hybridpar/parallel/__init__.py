"""Parallel layers and the wrapper that applies a plan to an unmodified model."""

from hybridpar.parallel.batchnorm import (
    AdaptiveGlobalBatchNorm,
    BNSwitch,
    GlobalBatchNorm,
    GlobalBatchNorm1d,
    GlobalBatchNorm2d,
    LossPlateau,
    convert_global_batchnorm,
)
from hybridpar.parallel.handoff import HandOff
from hybridpar.parallel.linear import ModelParallelLinear
from hybridpar.parallel.sync import GradSync
from hybridpar.parallel.wrap import HybridParallel, parallelize

__all__ = [
    "AdaptiveGlobalBatchNorm",
    "BNSwitch",
    "GlobalBatchNorm",
    "GlobalBatchNorm1d",
    "GlobalBatchNorm2d",
    "GradSync",
    "HandOff",
    "HybridParallel",
    "LossPlateau",
    "ModelParallelLinear",
    "convert_global_batchnorm",
    "parallelize",
]
