"""Layout changes between segments: Gholami et al. Eq. 6 generalised to any two nested layouts,
with Krizhevsky's (2014) hand-off scheme (a) as the batch -> model case.

An activation in the layout of a grid with Pc batch groups holds, on each rank, the examples of
its batch group (hybridpar.runtime.comm.grid). Into a coarser layout (fewer batch groups, Pc' | Pc) each
rank all-gathers the examples of the m = Pc / Pc' finer groups that make up its coarser one; into
a finer layout it keeps its own slice. Backward runs the other way: the gradient of a gathered,
replicated activation is the same on every rank that gathered it, so each keeps its rows; the
gradient of a slice is all-gathered. Either direction sends one all-gather, the cost model's
`redistribute` term (`gather` and `split`, runtime/parallel/mappings.py).

A gather straight into a split layer from a pure batch
layout takes the layer's partial dX and reduce-scatters it (core/handoff.py, `fused`): each
example's gradient summed once and sent to its owner, half the bytes of the layer's dX all-reduce.
This is Krizhevsky's scheme (a), one round; schemes (b) and (c) (K rounds, each overlapped with
the compute of the layers after the hand-off) are runtime/parallel/rounds.py.

The redistribution between two styles' layouts is looked up by the pair of their layout kinds
("rep": split over batch groups, replicated in model groups; "dom": also split by height): this
file's `MOVES` holds rep -> rep, and a style with a layout of its own holds its moves next to it
(runtime/parallel/domain/moves.py); runtime/parallel/kinds.py gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridpar.core import faults
from hybridpar.core.plan import Style
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.collectives import Via
from hybridpar.runtime.comm.grid import GridSet, rows_of_group
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.mappings import Pieces, gather, split

__all__ = [
    "MOVES",
    "Chain",
    "Move",
    "Redistribute",
    "StepRows",
    "regroup_place",
    "replicated",
]


class StepRows:
    """How the examples of the current step lie on the ranks: every rank's share of the finest
    layout (`even_split(n, P)`), set once per step and read by every redistribution."""

    def __init__(self) -> None:
        self.sizes: list[int] | None = None
        self.examples: torch.Tensor | None = None
        """inside a hand-off round: the global index of each example the round carries"""


def regroup_place(grids, src: int, dst: int) -> tuple[int, int, int]:
    """Between layouts of `src` and `dst` batch groups: the ranks of a fine batch group, how many
    fine groups make up a coarse one (m), and the first fine group of this rank's coarse one
    (by this rank's position: comm.grid.GridSet.position)."""
    world = grids.world_size
    fine, coarse = max(src, dst), min(src, dst)
    m = fine // coarse
    return world // fine, m, (grids.position // (world // coarse)) * m


class Redistribute:
    """Forward pre-hook moving the input of a segment's entry module from the layout with `src`
    batch groups to the one with `dst` (Pc of the grids before and after)."""

    def __init__(self, move: Move, src: int, dst: int) -> None:
        self.group = move.grids.regroup(src, dst)
        self.src, self.dst, self.rows, self.fused = src, dst, move.rows, move.fused
        self.via = Via(self.group, move.ledger, Term.REDISTRIBUTE, move.layer, move.codec)
        self.pr_fine, self.m, self.first = regroup_place(move.grids, src, dst)

    def sizes(self) -> list[int]:
        """Examples held by each rank of the regroup: the fine batch groups of my coarse one."""
        finest = self.rows.sizes
        if finest is None:
            raise RuntimeError("call set_batch(n) with the step's global batch before the forward")
        return [rows_of_group(finest, self.pr_fine, self.first + j) for j in range(self.m)]

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple:
        faults.at("handoff")
        x, *rest = args
        pieces = Pieces(tuple(self.sizes()), 0)
        if self.dst < self.src:
            return (gather(x, pieces, self.via, self.fused), *rest)
        return (split(x, pieces, self.via), *rest)


@dataclass
class Move:
    """What a redistribution between two layouts needs: the grids, the step's rows, the ledger,
    the layer it books under, the activations' codec, and the height and width of the
    activation moved where it leaves a layout split by height (its bands, or tiles, are not all
    on one rank)."""

    grids: GridSet
    rows: StepRows
    ledger: Ledger | None
    layer: str
    codec: Codec | None = None
    size: tuple[int, int] | None = None
    fused: bool = False
    """the hand-off's backward is one reduce-scatter of the split layer's partial dX"""
    fed: tuple[int, ...] | None = None
    """at the model's input: the images' (H, W) or volumes' (D, H, W) (a rank may feed its band
    or tile of them alone)"""
    whole: bool = False
    """the activation is a global pooling's value, whole on every rank of the domain layout it
    leaves (runtime.parallel.domain.moves.out_of_domain)"""


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
    return Redistribute(m, src.pc, dst.pc)


MOVES: dict[tuple[str, str], Callable[[Style, Style, Move], Callable]] = {
    ("rep", "rep"): replicated
}
"""(layout kind before, layout kind after) -> the forward pre-hook's builder; a style with a
layout of its own adds its moves (runtime/parallel/kinds.py gathers them)"""
