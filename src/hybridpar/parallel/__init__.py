"""Parallel layers and the wrapper that applies a plan to an unmodified model."""

from hybridpar.parallel.handoff import HandOff
from hybridpar.parallel.linear import ModelParallelLinear
from hybridpar.parallel.sync import GradSync
from hybridpar.parallel.wrap import HybridParallel, parallelize

__all__ = ["GradSync", "HandOff", "HybridParallel", "ModelParallelLinear", "parallelize"]
