"""Logged collectives and the autograd pairs the parallel layers are made of.

Every collective hybridpar runs goes through this module so that the ledger sees it. Each autograd
pair does nothing when its group has one rank, so one code path serves P = 1.

| function            | forward                               | backward                          | term          |
| ------------------- | ------------------------------------- | --------------------------------- | ------------- |
| copy_to_group       | identity                              | all-reduce dX over the group      | dx_allreduce  |
| gather_features     | all-gather the feature shards (Y)     | keep this rank's slice of dY      | allgather     |
| gather_batch        | all-gather the example blocks         | keep this rank's rows of dX       | redistribute  |
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridpar.comm.ledger import Entry, Ledger

__all__ = [
    "Pending",
    "all_gather_uneven",
    "all_reduce",
    "copy_to_group",
    "even_split",
    "gather_batch",
    "gather_features",
    "group_size",
]


def even_split(n: int, parts: int) -> list[int]:
    """Split n into `parts` sizes differing by at most one, the larger ones first: how examples
    split over ranks and how a layer's output features split over a model group."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class Pending:
    """An async collective: wait() blocks, then the ledger entry gets its wall time."""

    def __init__(self, work: dist.Work | None, entry: Entry | None, t0: float) -> None:
        self.work, self.entry, self.t0 = work, entry, t0

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.finished()

    def finished(self) -> None:
        """Stamp the wall time; call from the work's future callback (never wait() there)."""
        if self.entry is not None and self.entry.seconds == 0.0:
            self.entry.seconds = time.perf_counter() - self.t0


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, ledger: Ledger | None, term: str,
               layers: dict[str, float] | None = None, async_op: bool = False) -> Pending:  # fmt: skip
    """Sum `t` in place over `group`, logged under `term`."""
    p = group_size(group)
    t0 = time.perf_counter()
    if p == 1:
        return Pending(None, None, t0)
    work = dist.all_reduce(t, group=group, async_op=async_op)
    entry = (
        ledger.record("all_reduce", p, t.numel() * t.element_size(), 0.0, term, layers)
        if ledger
        else None
    )
    pending = Pending(work, entry, t0)
    if not async_op:
        pending.wait()
    return pending


def all_gather_uneven(t: torch.Tensor, sizes: Sequence[int], dim: int, group: dist.ProcessGroup,
                      ledger: Ledger | None, term: str, layer: str | None) -> torch.Tensor:  # fmt: skip
    """Concatenate along `dim` the pieces of every rank of `group`; piece i has sizes[i] along dim.

    Uneven pieces are padded to the largest for the wire; the ledger records the bytes of the
    real (unpadded) result, the quantity the cost model predicts."""
    p = len(sizes)
    if p == 1:
        return t
    t0 = time.perf_counter()
    top = max(sizes)
    t = t.contiguous()
    if t.shape[dim] < top:
        pad_shape = list(t.shape)
        pad_shape[dim] = top - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    pieces = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(pieces, t, group=group)
    out = torch.cat([x.narrow(dim, 0, n) for x, n in zip(pieces, sizes, strict=True)], dim=dim)
    if ledger is not None:
        ledger.record("all_gather", p, out.numel() * out.element_size(), time.perf_counter() - t0,
                      term, {layer: out.numel()} if layer else None)  # fmt: skip
    return out


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the group (dX of a model-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group, ledger, layer):
        ctx.group, ctx.ledger, ctx.layer = group, ledger, layer
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group, ctx.ledger, "dx_allreduce", {ctx.layer: grad.numel()})
        return grad, None, None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather the pieces along `dim`. Backward: keep this rank's slice of the gradient
    (the gradient of a gathered, replicated tensor is the same on every rank of the group)."""

    @staticmethod
    def forward(ctx, x, sizes, dim, group, ledger, term, layer):
        ctx.dim, ctx.sizes = dim, sizes
        ctx.rank = dist.get_rank(group) if len(sizes) > 1 else 0
        return all_gather_uneven(x, sizes, dim, group, ledger, term, layer)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]).contiguous(), *([None] * 6)


def copy_to_group(
    x: torch.Tensor, group: dist.ProcessGroup, ledger: Ledger | None, layer: str
) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group, ledger, layer)


def gather_features(x: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup,
                    ledger: Ledger | None, layer: str) -> torch.Tensor:  # fmt: skip
    """All-gather a model-parallel layer's output shards (Y) along the last dim."""
    if len(sizes) == 1:
        return x
    return _Gather.apply(x, tuple(sizes), x.dim() - 1, group, ledger, "allgather", layer)


def gather_batch(x: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup,
                 ledger: Ledger | None, layer: str) -> torch.Tensor:  # fmt: skip
    """All-gather example blocks along dim 0 (Krizhevsky's hand-off scheme (a) within a model group)."""
    if len(sizes) == 1:
        return x
    return _Gather.apply(x, tuple(sizes), 0, group, ledger, "redistribute", layer)
