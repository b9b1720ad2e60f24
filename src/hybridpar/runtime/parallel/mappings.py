"""The communication autograd pairs of the parallel runtime, one file (the shape of Megatron's
mappings.py): each is a named pair, what happens forward and what backward, over `via.group`,
booked under `via.term`, and a no-op on a group of one rank. The collectives they call are
runtime/comm/collectives.py's; how a tensor is cut among a group's ranks is one value, `Pieces`.

| function      | forward                                   | backward                              |
| ------------- | ----------------------------------------- | ------------------------------------- |
| gather        | all-gather the pieces along their dim     | keep this rank's piece of the grad,   |
|               |                                           | or reduce-scatter a partial one       |
| split         | keep this rank's piece                    | all-gather the pieces of the grad     |
| copy_to_group | identity                                  | all-reduce the grad (a split layer's  |
|               |                                           | dX)                                   |
| summed        | all-reduce: the sum of every rank's value | the grad as it is (every rank         |
|               |                                           | differentiates the same function)     |
| transpose     | all-to-all from one cut to another         | the same with the two cuts swapped    |
| one_part      | identity (a value every rank holds whole) | the grad on the group's first rank,   |
|               |                                           | zero on the others                    |
| joined        | every rank's part all-gathered and placed | the grad of this rank's own part (the |
|               | in the whole tensor                       | whole one is every rank's)            |
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridpar.runtime.comm.collectives import (
    Via,
    all_gather_uneven,
    all_reduce,
    all_to_all_uneven,
    compressed_all_reduce,
    reduce_scatter_uneven,
)
from hybridpar.runtime.comm.group import group_rank, group_size

__all__ = [
    "Pieces",
    "copy_to_group",
    "gather",
    "joined",
    "one_part",
    "split",
    "summed",
    "transpose",
]


class Pieces(NamedTuple):
    """How a tensor is cut among the ranks of a group: rank i holds sizes[i] along `dim`."""

    sizes: tuple[int, ...]
    dim: int

    def mine(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of the whole `x`."""
        return x.narrow(self.dim, sum(self.sizes[:rank]), self.sizes[rank]).contiguous()


class _Gather(torch.autograd.Function):
    """Forward: all-gather the pieces. Backward: keep this rank's piece, or, where the gradient
    is every rank's partial sum (`fused`: core/handoff.py), reduce-scatter it."""

    @staticmethod
    def forward(ctx, x, pieces, via, fused):
        ctx.pieces, ctx.via, ctx.fused = pieces, via, fused
        return all_gather_uneven(x, pieces.sizes, pieces.dim, via)

    @staticmethod
    def backward(ctx, grad):
        pieces, via = ctx.pieces, ctx.via
        if ctx.fused:
            return reduce_scatter_uneven(grad, pieces.sizes, pieces.dim, via), None, None, None
        return pieces.mine(grad, group_rank(via.group)), None, None, None


class _Split(torch.autograd.Function):
    """Forward: keep this rank's piece. Backward: all-gather the pieces of the grad."""

    @staticmethod
    def forward(ctx, x, pieces, via):
        ctx.pieces, ctx.via = pieces, via
        return pieces.mine(x, group_rank(via.group))

    @staticmethod
    def backward(ctx, grad):
        p = ctx.pieces
        return all_gather_uneven(grad.contiguous(), p.sizes, p.dim, ctx.via), None, None


def gather(x: torch.Tensor, pieces: Pieces, via: Via, fused: bool = False) -> torch.Tensor:
    """The pieces of every rank of `via.group`, joined."""
    return x if len(pieces.sizes) == 1 else _Gather.apply(x, pieces, via, fused)


def split(x: torch.Tensor, pieces: Pieces, via: Via) -> torch.Tensor:
    """This rank's piece of the whole `x`."""
    return x if len(pieces.sizes) == 1 else _Split.apply(x, pieces, via)


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the group (dX of a split layer)."""

    @staticmethod
    def forward(ctx, x, via):
        ctx.via = via
        return x

    @staticmethod
    def backward(ctx, grad):
        v, grad = ctx.via, grad.contiguous().clone()
        if v.encoded:
            compressed_all_reduce(grad, v)
        else:
            all_reduce(grad, v)
        return grad, None


def copy_to_group(x: torch.Tensor, via: Via) -> torch.Tensor:
    """Identity forward; backward sums the gradient over `via.group` (booked under its term)."""
    return x if group_size(via.group) == 1 else _CopyToGroup.apply(x, via)


class _Summed(torch.autograd.Function):
    """Forward: the sum of every rank's tensor (all-reduce). Backward: the gradient as it is
    (every rank differentiates the same function of the sum)."""

    @staticmethod
    def forward(ctx, t, via):
        t = t.clone()
        all_reduce(t, via)
        return t

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Transposed(torch.autograd.Function):
    """An all-to-all within the model group, from one cut of the activation to another: this
    rank's tensor cut into `send`'s pieces, piece q to rank q; what arrives joined along `recv`'s
    dim. Into the domain layout `send` is the bands and `recv` the examples of each rank in pure
    batch; out of it the other way round. Backward: the same with the two cuts swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, via):
        ctx.args = (recv, send, via)
        return all_to_all_uneven(x, send, recv, via)

    @staticmethod
    def backward(ctx, g):
        return all_to_all_uneven(g.contiguous(), *ctx.args), None, None, None


class _OnePart(torch.autograd.Function):
    """Forward: a whole value as it is. Backward: the gradient, which the layout after it holds
    whole on every rank of the model group, kept on its first rank and zero on the others: the
    parts a global pooling's backward sums (it counted Pr times otherwise)."""

    @staticmethod
    def forward(ctx, x, first: bool):
        ctx.first = first
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.first else torch.zeros_like(g)), None


def summed(t: torch.Tensor, via: Via) -> torch.Tensor:
    """The sum of every rank's `t` (a loss's sums: each rank's gradient is its own)."""
    return _Summed.apply(t, via)


def transpose(x: torch.Tensor, send: Pieces, recv: Pieces, via: Via) -> torch.Tensor:
    """This rank's `x` cut into `send`'s pieces, piece q to rank q; what arrives joined along
    `recv`'s dim."""
    return _Transposed.apply(x, send, recv, via)


def one_part(x: torch.Tensor, first: bool) -> torch.Tensor:
    """`x` as it is; its gradient kept where `first`, zero elsewhere."""
    return _OnePart.apply(x, first)


class _Joined(torch.autograd.Function):
    """Forward: every rank's part, flattened, all-gathered and put in its place of the whole
    tensor (parts held twice, by replicas, land on the same place). Backward: this rank's place
    of the gradient, which every rank computed alike from the same whole tensor."""

    @staticmethod
    def forward(ctx, x, places, shape, via):
        ctx.mine = places[group_rank(via.group)]
        whole = x.new_empty(shape)
        sizes = [whole[place].numel() for place in places]
        flat = all_gather_uneven(x.reshape(-1), sizes, 0, via)
        for place, part in zip(places, flat.split(sizes), strict=True):
            region = whole[place]
            region.copy_(part.view(region.shape))
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine].contiguous(), None, None, None


def joined(x: torch.Tensor, places: list[tuple], shape: tuple[int, ...], via: Via) -> torch.Tensor:
    """The whole tensor of `shape` on every rank of `via.group`, rank q's part `x` being
    `whole[places[q]]` (an index: its examples, its band or tile)."""
    if group_size(via.group) == 1:
        return x
    return _Joined.apply(x, places, shape, via)
