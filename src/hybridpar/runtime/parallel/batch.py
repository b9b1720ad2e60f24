"""The batch style: the whole layer on every rank, each with its share of the examples (the grid
1 x P). Its parameters are replicated on all P ranks, so their gradients are summed over all of
them, and a batch norm in its layout takes its statistics over all of them."""

from __future__ import annotations

from hybridpar.runtime.parallel.styles import ParallelStyle

__all__ = ["BatchStyle"]


class BatchStyle(ParallelStyle):
    kind = "batch"
