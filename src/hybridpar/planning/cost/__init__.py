"""The alpha-beta cost model: pure arithmetic on dataclasses, no torch.distributed."""

from hybridpar.core.layers import CostLayer, cost_layers
from hybridpar.core.plan import Style
from hybridpar.planning.cost.collectives import (
    Comm,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    halo,
)
from hybridpar.planning.cost.compute import ComputeModel, FlopsModel, ProfileModel
from hybridpar.planning.cost.terms import layer_comms, redistribute

__all__ = [
    "Comm",
    "ComputeModel",
    "CostLayer",
    "FlopsModel",
    "ProfileModel",
    "Style",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "cost_layers",
    "halo",
    "layer_comms",
    "redistribute",
]
