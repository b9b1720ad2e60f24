"""States sharded beside bands (issue 75): the domain style keeps a segment's whole parameters
on every rank of its model group; with `Choices.shard_states` each of the segment's modules that
holds parameters is handed to torch's FSDP2 (`fully_shard`) over the model group's mesh. Its
parameters become DTensors sharded by their first dimension (torch.chunk's split, padded to equal
shards), all-gathered before its forward and again before its backward (resharded after each),
its gradient sums reduce-scattered over the group and, where batch groups hold other examples'
bands (Pc > 1), each shard all-reduced over its batch group (the ranks holding the same shard:
FSDP2's HSDP, the sum taken in its all-reduce hook by hybridpar's all-reduce), and the
optimizer, built on the shards, keeps its state sharded with them. What the style swapped stays: FSDP2 changes the module's class to a
subclass of its own (`FSDPConv2d` derives from `Conv2d`), so isinstance checks still hold, and
the stand-in in its forward receives the gathered weight as the operation's argument.

FSDP2's collectives run through hybridpar's (runtime.comm.collectives: `flat_all_gather`,
`flat_reduce_scatter`, handed to FSDP2 as its custom comms), so the ledger books each under the
layer and the terms the cost model prices (planning.cost.terms.t_sharded). Gradients are sums:
hybridpar divides the loss by the global batch, so FSDP2's division is set to 1."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via, all_reduce, flat_all_gather, flat_reduce_scatter
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.layout import Layout

__all__ = ["shard_states"]


class _Gather(AllGather):
    def __init__(self, ledger: Ledger | None, layer: str) -> None:
        self.ledger, self.layer = ledger, layer

    def allocate(self, size: Sequence[int], *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        via = Via(group, self.ledger, Term.PARAM_ALLGATHER, self.layer)
        return flat_all_gather(output_tensor, input_tensor, via, async_op)


class _Scatter(_Gather, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        via = Via(group, self.ledger, Term.DW_REDUCE_SCATTER, self.layer)
        return flat_reduce_scatter(output_tensor, input_tensor, via, op, async_op)


def shard_states(model: nn.Module, layout: Layout, styles: list, ledger: Ledger | None) -> set:
    """Hand every module with parameters of the plan's domain segments to FSDP2 over its model
    group (collective); returns the ids of the sharded parameters (their sums are FSDP2's)."""
    sharded: set[int] = set()
    mesh = None
    for name, m in model.named_modules():
        seg = layout.module_segment.get(name)
        own = list(m.parameters(recurse=False))
        if seg is None or not own or layout.segments[seg].kind != "domain":
            continue
        grid = styles[seg].grid
        mesh = grid.mesh["model"]
        fully_shard(m, mesh=mesh, reshard_after_forward=True)
        assert isinstance(m, FSDPModule)
        layer = layout.layer_of.get(name, name)
        m.set_custom_all_gather(_Gather(ledger, layer))
        m.set_custom_reduce_scatter(_Scatter(ledger, layer))
        if grid.pc > 1:  # the same shard of the other batch groups' bands: summed after the scatter
            via = Via(grid.batch_group, ledger, Term.DW_ALLREDUCE, layer)
            m.set_all_reduce_hook(functools.partial(all_reduce, via=via))
        m.set_gradient_divide_factor(1.0)  # the loss is divided by the global batch already
        m.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
        sharded |= {id(p) for p in m.parameters(recurse=False)}
    if mesh is not None:  # a root over them, holding nothing: a root keeps its parameters
        # gathered from its forward to its backward, the layers under it gather them twice
        rest = {p for p in model.parameters() if id(p) not in sharded}
        fully_shard(model, mesh=mesh, ignored_params=rest)
    return sharded
