"""How a count splits over ranks (torch-free, read by the planner's rules and by the runtime): the
examples of a batch, the output units of a split layer, the groups of a grouped convolution."""

from __future__ import annotations

__all__ = [
    "buckets",
    "chunk_sizes",
    "even_split",
    "group_rows",
    "group_split",
    "slowest_batch",
    "whole_group_prs",
]


def even_split(n: int, parts: int) -> list[int]:
    """Split n into `parts` sizes differing by at most one, the larger ones first: how examples
    split over ranks and how a layer's output features split over a model group."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def group_rows(batch: int, pr: int, pc: int) -> list[int]:
    """The examples of each batch group of a Pr x Pc grid: the global batch is dealt over the
    Pr * Pc ranks (`even_split`) and group c holds the blocks of ranks c*Pr .. c*Pr + Pr - 1, so
    that the groups of any two grids whose Pc divide one another are unions of each other's.
    Unequal where Pc does not divide the batch (docs/runtime.md, "Any batch"). In closed form:
    the first B mod P ranks hold one example more, so group c has the extra of
    clamp(B mod P - c Pr, 0, Pr) of its ranks."""
    q, r = divmod(batch, pr * pc)
    return [pr * q + min(pr, max(0, r - c * pr)) for c in range(pc)]


def slowest_batch(batch: int, pr: int, pc: int) -> int:
    """The global batch whose even share per batch group (B / Pc) is the largest group's: the
    batch the planner times a Pr x Pc layout by (the slowest group sets the step), where the
    bytes a rank sends on average follow the true batch. Group 0 is the largest (`group_rows`)."""
    q, r = divmod(batch, pr * pc)
    return (pr * q + min(pr, r)) * pc


def buckets(sizes: list[float], cap: float) -> list[list[int]]:
    """The gradient buckets of a group: the indices of `sizes` (bytes, in the order the gradients
    arrive) cut into runs, each closed by the size that brings it to `cap` or more, as torch
    DDP fills its buckets (a large gradient shares its bucket with the small ones before it,
    instead of leaving them a bucket and a latency of their own). The runtime fills its buckets
    so (runtime.parallel.sync.GradSync) and the planner prices one latency per bucket; a layer's
    weight arrives after its bias and batch-norm riders, so whole layers give the same runs
    while those hold less than a bucket."""
    out: list[list[int]] = [[]]
    fill = 0.0
    for i, n in enumerate(sizes):
        out[-1].append(i)
        fill += n
        if fill >= cap:
            out.append([])
            fill = 0.0
    return [run for run in out if run]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """torch.chunk's split of n into `parts` (ceil(n / parts) each, the rest to the last, possibly
    none): how a split layer's output units lie on its model group. It is DTensor's Shard layout,
    so checkpoints (torch.distributed.checkpoint) can re-split them onto another grid."""
    c = -(-n // parts)
    return [max(0, min(c, n - i * c)) for i in range(parts)]


def group_split(units: int, groups: int, parts: int) -> list[int] | None:
    """The output units of a layer with `groups` groups over `parts` ranks, torch.chunk's split
    when it gives every rank whole groups (always for a depthwise convolution); None when it would
    cut a group (a rank would need input channels of a group it computes only part of)."""
    sizes = chunk_sizes(units, parts)
    if groups == 1:
        return sizes
    per = units // groups
    return sizes if all(s % per == 0 for s in sizes) else None


def whole_group_prs(units: int, groups: int, upto: int) -> list[int]:
    """The Pr in 2..upto whose split keeps every group whole."""
    return [p for p in range(2, upto + 1) if p <= units and group_split(units, groups, p)]
