"""The names of the cost model's terms. The cost model predicts bytes and seconds per (layer, term),
the ledger books every collective under one, and the plan and the report carry them: one enum,
torch-free, that the planning half, the runtime and the plan all import."""

from __future__ import annotations

from enum import Enum

__all__ = ["Term"]


class Term(str, Enum):
    """The names of the cost model's terms; the ledger books every collective under one of them."""

    ALLGATHER = "allgather"  # forward all-gather of a model-parallel layer's output
    DX_ALLREDUCE = "dx_allreduce"  # backward all-reduce of dX over the model group
    DX_ALLGATHER = "dx_allgather"  # backward all-gather of a grouped conv's dX slices
    DW_ALLREDUCE = "dw_allreduce"  # weight-gradient sum over the ranks that replicate a weight
    PARAM_ALLGATHER = "param_allgather"  # sharded states: a layer's parameters gathered (FSDP2)
    DW_REDUCE_SCATTER = "dw_reduce_scatter"  # sharded states: its gradient sums, scattered
    REDISTRIBUTE = "redistribute"  # layout change between layers (Eq. 6, hand-off schemes)
    HALO_FWD = "halo_fwd"
    HALO_BWD = "halo_bwd"
    BN_STATS = "bn_stats"  # global batch norm, forward statistics
    BN_GRAD = "bn_grad"  # global batch norm, backward sums
    CODEC_OVERHEAD = "codec_overhead"  # 8-bit scales and padding: measured, not predicted
    METRICS = "metrics"  # once-per-epoch loss and accuracy sums
    BN_SWITCH = "bn_switch"  # the adaptive batch norm's agreed decision
    PARAM_BROADCAST = "param_broadcast"  # parameters sent once at the start
    STATE = "state"  # gathering shards into a full state dict
    RECOMPUTE = "recompute"  # collectives run again by activation checkpointing: not predicted
    LOSS_JOIN = "loss_join"  # the outputs joined for a loss that does not split: not predicted

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
