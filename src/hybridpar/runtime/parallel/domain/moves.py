"""Moves into and out of the domain layout (`MOVES`): from the layout with the same batch
groups a band is kept (its gradient all-gathered backward), from pure batch one all-to-all each
way within the model group (tiles: through the replicated layout), from any other layout through
the replicated layout of the domain grid, and back the same ways; a pooled value leaves whole.
The cost model (planning.cost.terms.redistribute) prices exactly these."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridpar.core import faults
from hybridpar.core.halo import bands, tile
from hybridpar.core.plan import Style
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via
from hybridpar.runtime.parallel.mappings import Pieces, gather, one_part, split, transpose
from hybridpar.runtime.parallel.redistribute import Chain, Move, replicated


def _sizes(shape: tuple[int, ...], pr: int, pw: int) -> tuple[list, Pieces]:
    """Every rank's band (tile) of activations of spatial `shape` over Pr ranks with `pw` tile
    columns, and how they lie on the wire: the rows along dim 2, or the tiles flattened."""
    boxes = [tile(shape, pr, pw, r) for r in range(pr)]
    if pw == 1:
        return boxes, Pieces(tuple(b - a for a, b in boxes), 2)
    rest = math.prod(shape[2:])  # a volume's width, whole on every tile of depth x height
    return boxes, Pieces(tuple((b - a) * (d - c) * rest for (a, b), (c, d) in boxes), 2)


def join(x: torch.Tensor, shape: tuple[int, ...], pr: int, pw: int, via: Via) -> torch.Tensor:
    """The whole activation from every rank's band (tile): one all-gather over the model group
    (backward: this rank's part of the gradient)."""
    boxes, pieces = _sizes(shape, pr, pw)
    if pw == 1:
        return gather(x, pieces, via)
    parts = gather(x.flatten(2), pieces, via).split(list(pieces.sizes), 2)
    flat = [
        t.unflatten(2, (b - a, d - c, *shape[2:]))
        for t, ((a, b), (c, d)) in zip(parts, boxes, strict=True)
    ]
    return torch.cat([torch.cat(flat[i : i + pw], 3) for i in range(0, pr, pw)], 2)


def cut(x: torch.Tensor, pr: int, pw: int, via: Via) -> torch.Tensor:
    """This rank's band (tile) of the whole activation (backward: the parts' all-gather)."""
    boxes, pieces = _sizes(tuple(x.shape[2:]), pr, pw)
    if pw == 1:
        return split(x, pieces, via)
    flat = torch.cat([x[:, :, a:b, c:d].flatten(2) for (a, b), (c, d) in boxes], 2)
    (a, b), (c, d) = boxes[via.group.rank]
    return split(flat, pieces, via).unflatten(2, (b - a, d - c, *x.shape[4:]))


class _Rows:
    """Forward pre-hook between the domain layout and the replicated layout of the same grid:
    keep this rank's band or tile (`into`; backward: all-gather the bands' gradients) or
    all-gather them (out of it; backward: keep this rank's part)."""

    def __init__(self, style: Style, m: Move, into: bool) -> None:
        self.group = m.grids.grid(style.pc).model_group
        self.pr, self.pw, self.m, self.into = style.pr, style.pw, m, into

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        faults.at("handoff")
        x, *rest = args
        fed = self.m.fed
        if self.into and fed is not None and tuple(x.shape[2:]) != tuple(fed):
            mine = tile(fed, self.pr, self.pw, self.group.rank)
            spans = mine if self.pw > 1 else (mine,)
            if tuple(x.shape[2 : 2 + len(spans)]) != tuple(b - a for a, b in spans):
                what = " and columns ".join(f"{a}..{b - 1}" for a, b in spans)
                raise ValueError(
                    f"this rank feeds rows {what} of the images (model.input_band()) or the "
                    f"whole {' x '.join(map(str, fed))}; got {' x '.join(map(str, x.shape[2:]))}"
                )
            return args  # fed its band alone
        m = self.m
        via = Via(self.group, m.ledger, Term.REDISTRIBUTE, m.layer, m.codec)
        if self.into:
            return (cut(x, self.pr, self.pw, via), *rest)
        shape = m.size if self.pw > 1 else (m.size[0],)
        return (join(x, shape, self.pr, self.pw, via), *rest)


class _Transpose:
    """Forward pre-hook between pure batch (Pc = P) and the domain layout: one all-to-all within
    the model group (examples -> bands, or back)."""

    def __init__(self, style: Style, m: Move, into: bool) -> None:
        grid = m.grids.grid(style.pc)
        self.group, self.grid, self.pr, self.m, self.into = (
            grid.model_group,
            grid,
            style.pr,
            m,
            into,
        )

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        faults.at("handoff")
        x, *rest = args
        first = self.grid.c * self.pr  # the examples of each rank in pure batch
        examples = Pieces(tuple(self.m.rows.sizes[first : first + self.pr]), 0)
        h = x.shape[2] if self.into else self.m.size[0]
        rows = Pieces(tuple(b - a for a, b in bands(h, self.pr)), 2)
        send, recv = (rows, examples) if self.into else (examples, rows)
        via = Via(self.group, self.m.ledger, Term.REDISTRIBUTE, self.m.layer)
        return (transpose(x, send, recv, via), *rest)


def into_domain(src: Style, dst: Style, m: Move):
    """Into the domain layout: from its own grid's layout keep a band; from pure batch one
    all-to-all; otherwise through its own grid's replicated layout."""
    if src.layout[0] == "dom":
        out = out_of_domain(src, Style.model(src.pr, src.pc), m)
        return Chain(out, into_domain(Style.model(src.pr, src.pc), dst, m))
    if src.pc == dst.pc:
        return _Rows(dst, m, into=True)
    if src.pc == dst.procs and dst.pw == 1:
        return _Transpose(dst, m, into=True)
    return Chain(replicated(src, Style.model(dst.pr, dst.pc), m), _Rows(dst, m, into=True))


class _Whole:
    """Forward pre-hook out of the domain layout for a global pooling's value (whole on every
    rank of the model group): no rows to gather; its gradient becomes one rank's part."""

    def __init__(self, src: Style, m: Move) -> None:
        self.group = m.grids.grid(src.pc).model_group

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (one_part(x, self.group.rank == 0), *rest)


def out_of_domain(src: Style, dst: Style, m: Move):
    """Out of the domain layout, the same ways back; a whole value (a global pooling's) through
    its own grid's replicated layout, which it is already in."""
    if m.whole:
        return Chain(_Whole(src, m), replicated(Style.model(src.pr, src.pc), dst, m))
    if dst.pc == src.pc:
        return _Rows(src, m, into=False)
    if dst.pc == src.procs and src.pw == 1:
        return _Transpose(src, m, into=False)
    return Chain(_Rows(src, m, into=False), replicated(Style.model(src.pr, src.pc), dst, m))


MOVES = {("rep", "dom"): into_domain, ("dom", "rep"): out_of_domain, ("dom", "dom"): into_domain}
