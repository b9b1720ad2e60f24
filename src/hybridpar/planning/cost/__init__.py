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
from hybridpar.planning.cost.compute import ComputeModel, FlopsModel, TableModel, load_table
from hybridpar.planning.cost.terms import layer_comms, redistribute

__all__ = [
    "Comm",
    "ComputeModel",
    "CostLayer",
    "FlopsModel",
    "Style",
    "TableModel",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "cost_layers",
    "halo",
    "layer_comms",
    "load_table",
    "redistribute",
]
