"""Global reductions over an image split into bands: a global pooling (average, sum, maximum,
the first maximum) or an adaptive average pooling to k x l cells, whole on every rank of the
model group (one all-reduce of the regions' sums or maxima forward, each rank's part backward)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.nn import functional as F

from hybridpar.core.halo import bands
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via, all_reduce
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger


class _SpaceMax(torch.autograd.Function):
    """Forward: each example's maximum per channel over every rank's band (tile): this rank's
    maxima, how often each occurs and where it first occurs in the image (`at`: the image
    index of the band's first element, and (row length, image row length, first column)),
    summed in float64 into a row per rank (an all-gather as an all-reduce). Backward: the
    gradient's sum over the ranks goes to the first maximum in the image's order (`first`: an
    adaptive max pooling's index) or in equal shares to every maximum (amax's ties)."""

    @staticmethod
    def forward(ctx, x, via, first: bool, at: tuple[int, int, int, int]):
        group = via.group
        flat = x.flatten(2)
        top = flat.amax(2)
        hits = flat == top[..., None]
        rows = torch.zeros((group.size, 3, *top.shape), dtype=torch.float64, device=x.device)
        start, width, full, col = at
        local = hits.int().argmax(2)  # the band's first maximum
        rows[group.rank, 0], rows[group.rank, 1] = top, hits.sum(2)
        rows[group.rank, 2] = start + (local // width) * full + col + local % width
        all_reduce(rows, via)
        most = rows[:, 0].amax(0)
        held = rows[:, 0] == most  # (ranks, N, C): the ranks holding a maximum
        if first:  # the first in the image's order
            mine = torch.where(held, rows[:, 2], math.inf).argmin(0) == group.rank
            hits = F.one_hot(local, flat.shape[2]).bool()
            ties = torch.ones_like(most)
        else:
            mine, ties = held[group.rank], (rows[:, 1] * held).sum(0)
        ctx.save_for_backward(hits, mine, ties)
        ctx.shape, ctx.via = x.shape, replace(via, term=Term.BN_GRAD)
        return most.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        hits, mine, ties = ctx.saved_tensors
        total = g.to(torch.float64).contiguous()
        all_reduce(total, ctx.via)
        share = (total * mine / ties).to(g.dtype)
        return (hits * share[..., None]).view(ctx.shape), None, None, None


class _RegionSum(torch.autograd.Function):
    """Forward: each example's sums per channel over k x l regions (`rows` (k, band rows) and
    `cols` (l, the rest of a row): which rows and columns each output cell reads; one region of
    all of them: a global sum), of this rank's band in float64, all-reduced. Backward: the
    gradient's sum over the ranks (each computed its part from its band: its consumers saw its
    band alone) spread back over the regions' rows."""

    @staticmethod
    def forward(ctx, x, rows, cols, via):
        sums = torch.einsum("nchw,kh,lw->nckl", x.to(torch.float64), rows, cols)
        all_reduce(sums, via)
        ctx.save_for_backward(rows, cols)
        ctx.via, ctx.dtype = replace(via, term=Term.BN_GRAD), x.dtype
        return sums.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        rows, cols = ctx.saved_tensors
        total = g.to(torch.float64).contiguous()
        all_reduce(total, ctx.via)
        return torch.einsum("nckl,kh,lw->nchw", total, rows, cols).to(ctx.dtype), None, None, None


def _regions(n_in: int, n_out: int, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
    """(n_out, hi - lo) float64: 1 where output cell i of an adaptive pooling of n_in to n_out
    (torch's regions: floor(i n_in / n_out) .. ceil((i + 1) n_in / n_out) - 1) reads row lo + j."""
    i = torch.arange(n_out, device=like.device)
    start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
    j = torch.arange(lo, hi, device=like.device)
    return ((j >= start[:, None]) & (j < end[:, None])).to(torch.float64)


class SpaceReduction:
    """What the domain style swaps in for a global pooling of a band (core.rows.global_pool:
    AdaptiveAvgPool2d(1), AdaptiveMaxPool2d(1), a mean, sum or amax over height and width, an
    AdaptiveAvgPool2d((k, l))): the value of the whole image, on every rank of the model group,
    in the shape the call returns."""

    def __init__(self, pool: tuple, adaptive: bool, group: Group, ledger: Ledger | None, layer,
                 pw: int = 1):  # fmt: skip
        self.how, self.rows, self.cells, self.rest = pool.how, pool.rows, pool.cells, pool.rest
        self.adaptive = adaptive  # keeps the dims (else the call's keepdim says)
        self.via = Via(group, ledger, Term.BN_STATS, layer)
        i, j = divmod(group.rank, pw)  # on tiles (pw columns of them): a tile's columns
        self.band = bands(self.rows, group.size // pw)[i]
        self.span = bands(self.rest, pw)[j] if pw > 1 else None

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        """Each example's sums (averages: `how` avg) per channel over the k x m cells of an
        adaptive average pooling, or over the whole image or volume (one cell): the regions'
        sums over the bands, (N, C, k, m)."""
        k, m = self.cells if math.prod(self.cells) > 1 else (1, 1)
        # a volume's depth slices as rows of H x W (sized: a batch group may hold no example)
        flat = x.reshape(*x.shape[:3], math.prod(x.shape[3:]))
        span = self.span or (0, self.rest)
        rows, cols = _regions(self.rows, k, *self.band, x), _regions(self.rest, m, *span, x)
        y = _RegionSum.apply(flat, rows, cols, self.via)
        if self.how != "avg":
            return y
        tall = _regions(self.rows, k, 0, self.rows, x).sum(1)
        wide = _regions(self.rest, m, 0, self.rest, x).sum(1)
        return y / (tall[:, None] * wide[None, :]).to(x.dtype)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if math.prod(self.cells) > 1:
            return self._sums(x)
        if self.how in ("max", "first"):
            first, width = self.span or (0, self.rest)
            at = (self.band[0] * self.rest, width - first, self.rest, first)
            y = _SpaceMax.apply(x, self.via, self.how == "first", at)
        else:
            y = self._sums(x).flatten(2).squeeze(2)
        keep = self.adaptive or kwargs.get("keepdim", args[1] if len(args) > 1 else False)
        return y.view(*y.shape, *[1] * (x.dim() - 2)) if keep else y
