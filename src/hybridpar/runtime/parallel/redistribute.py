"""Layout changes between segments: Gholami et al. Eq. 6 generalised to any two nested layouts,
with Krizhevsky's (2014) hand-off scheme (a) as the batch -> model case.

An activation in the layout of a grid with Pc batch groups holds, on each rank, the examples of
its batch group (hybridpar.runtime.comm.grid). Into a coarser layout (fewer batch groups, Pc' | Pc) each
rank all-gathers the examples of the m = Pc / Pc' finer groups that make up its coarser one; into
a finer layout it keeps its own slice. Backward runs the other way: the gradient of a gathered,
replicated activation is the same on every rank that gathered it, so each keeps its rows; the
gradient of a slice is all-gathered. Either direction sends one all-gather, the cost model's
`redistribute` term.

| function   | forward                                  | backward                            |
| ---------- | ---------------------------------------- | ----------------------------------- |
| gather     | all-gather the pieces along `dim`        | keep this rank's piece of the grad  |
| split      | keep this rank's piece along `dim`       | all-gather the pieces of the grad   |

Both are no-ops on a group of one rank. Scheme (a) is one round; schemes (b) and (c) (K rounds,
each overlapped with the FC compute of the previous one) are a later `scheme`.

The redistribution between two styles' layouts is looked up by the pair of their layout kinds
("rep": split over batch groups, replicated in model groups; "dom": also split by height): this
file's `MOVES` holds rep -> rep, and a style with a layout of its own holds its moves next to it
(runtime/parallel/domain.py); runtime/parallel/kinds.py gathers them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpar.errors import ConfigError
from hybridpar.plan import Style
from hybridpar.runtime import faults
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.collectives import all_gather_uneven
from hybridpar.runtime.comm.grid import GridSet, rows_of_group
from hybridpar.runtime.comm.group import Group, group_rank
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.terms import Term

__all__ = ["MOVES", "Chain", "Move", "Redistribute", "StepRows", "gather", "replicated", "split"]


class _Gather(torch.autograd.Function):
    """Forward: all-gather the pieces along `dim`. Backward: keep this rank's piece."""

    @staticmethod
    def forward(ctx, x, sizes, dim, group, ledger, term, layer, codec):
        ctx.dim, ctx.sizes = dim, sizes
        ctx.rank = group_rank(group)
        return all_gather_uneven(x, sizes, dim, group, ledger, term, layer, codec)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]).contiguous(), *([None] * 7)


class _Split(torch.autograd.Function):
    """Forward: keep this rank's piece along `dim`. Backward: all-gather the pieces of the grad."""

    @staticmethod
    def forward(ctx, x, sizes, dim, group, ledger, term, layer, codec):
        ctx.args = (sizes, dim, group, ledger, term, layer, codec)
        rank = group_rank(group)
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_uneven(grad.contiguous(), *ctx.args), *([None] * 7)


def gather(
    x: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    group: Group | dist.ProcessGroup,
    ledger: Ledger | None,
    term: str,
    layer: str | None,
    codec: Codec | None = None,
) -> torch.Tensor:
    if len(sizes) == 1:
        return x
    return _Gather.apply(x, tuple(sizes), dim, group, ledger, term, layer, codec)


def split(
    x: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    group: Group | dist.ProcessGroup,
    ledger: Ledger | None,
    term: str,
    layer: str | None,
    codec: Codec | None = None,
) -> torch.Tensor:
    if len(sizes) == 1:
        return x
    return _Split.apply(x, tuple(sizes), dim, group, ledger, term, layer, codec)


class StepRows:
    """How the examples of the current step lie on the ranks: every rank's share of the finest
    layout (`even_split(n, P)`), set once per step and read by every redistribution."""

    def __init__(self) -> None:
        self.sizes: list[int] | None = None


class Redistribute:
    """Forward pre-hook moving the input of a segment's entry module from the layout with `src`
    batch groups to the one with `dst` (Pc of the grids before and after)."""

    def __init__(
        self,
        grids: GridSet,
        src: int,
        dst: int,
        rows: StepRows,
        ledger: Ledger | None,
        layer: str,
        codec: Codec | None = None,
        scheme: str = "a",
    ) -> None:
        if scheme != "a":
            raise ConfigError(f"hand-off scheme {scheme!r} is not implemented yet; use 'a'")
        self.group = grids.regroup(src, dst)
        self.src, self.dst, self.rows = src, dst, rows
        self.ledger, self.layer, self.codec, self.scheme = ledger, layer, codec, scheme
        fine, coarse = max(src, dst), min(src, dst)
        world = grids.world_size
        self.pr_fine, self.m = world // fine, fine // coarse
        self.first = (
            dist.get_rank() // (world // coarse)
        ) * self.m  # my coarse group's first fine group

    def sizes(self) -> list[int]:
        """Examples held by each rank of the regroup: the fine batch groups of my coarse one."""
        finest = self.rows.sizes
        if finest is None:
            raise RuntimeError("call set_batch(n) with the step's global batch before the forward")
        return [rows_of_group(finest, self.pr_fine, self.first + j) for j in range(self.m)]

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple:
        faults.at("handoff")
        x, *rest = args
        move = gather if self.dst < self.src else split
        y = move(
            x, self.sizes(), 0, self.group, self.ledger, Term.REDISTRIBUTE, self.layer, self.codec
        )
        return (y, *rest)


@dataclass
class Move:
    """What a redistribution between two layouts needs: the grids, the step's rows, the ledger,
    the layer it books under, the activations' codec, and the height of the activation moved
    where it leaves a layout split by height (its bands are not all on one rank)."""

    grids: GridSet
    rows: StepRows
    ledger: Ledger | None
    layer: str
    codec: Codec | None = None
    height: int | None = None


class Chain:
    """Forward pre-hooks applied one after the other (a move through an intermediate layout)."""

    def __init__(self, *hooks: Callable) -> None:
        self.hooks = hooks

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple:
        for hook in self.hooks:
            args = hook(module, args)
        return args


def replicated(src: Style, dst: Style, m: Move) -> Callable:
    """Between two layouts split by examples only: one all-gather or slice (Redistribute)."""
    if src.pc == dst.pc:
        return lambda module, args: args
    return Redistribute(m.grids, src.pc, dst.pc, m.rows, m.ledger, m.layer, m.codec)


MOVES: dict[tuple[str, str], Callable[[Style, Style, Move], Callable]] = {
    ("rep", "rep"): replicated
}
"""(layout kind before, layout kind after) -> the forward pre-hook's builder; a style with a
layout of its own adds its moves (runtime/parallel/kinds.py gathers them)"""
