"""Timings that repeat: a clock that waits for a GPU, and measurement until the spread is small.

A quantity the planner prices from (a leaf's seconds, the optimizer's step, a codec's, an
all-reduce's) is measured in batches of repeats: a batch counts once its relative interquartile
range is at most `TOL` and its median passes the caller's sanity bound; after `TRIES` batches
without one, the median of them all, marked unsettled. The spread goes into the cache beside
the value, so that `hybridpar calibrate --check` can tell drift from noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CHECK_TOL",
    "TOL",
    "TRIES",
    "Recheck",
    "Settled",
    "clock",
    "settle",
    "spread",
]

TOL = 0.10  # a batch whose interquartile range is at most this share of its median counts
TRIES = 4


def clock(device) -> float:
    """time.perf_counter once `device`'s queued work is done (a GPU runs asynchronously)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def spread(samples: list[float]) -> float:
    """The interquartile range of `samples` over their median (0 for fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / med if med > 0 else 0.0


@dataclass(frozen=True)
class Settled:
    value: float  # the median of the batch that counted (of every batch, if none did)
    spread: float  # its `spread`
    tries: int  # batches measured
    settled: bool  # a batch counted

    def fields(self, name: str) -> dict:
        """How the cache stores it: {name: value, name_spread: spread} (and name_unsettled)."""
        out = {name: self.value, f"{name}_spread": self.spread}
        return out if self.settled else {**out, f"{name}_unsettled": self.tries}


def settle(
    batch: Callable[[], list[float]],
    tol: float = TOL,
    tries: int = TRIES,
    bound: float | None = None,
) -> Settled:
    """Call `batch` (a list of timings of one thing) until one has a spread of at most `tol` and
    a median of at most `bound`, `tries` times at most."""
    every: list[float] = []
    for k in range(1, tries + 1):
        got = batch()
        every += got
        med = statistics.median(got)
        if spread(got) <= tol and (bound is None or med <= bound):
            return Settled(med, spread(got), k, True)
    return Settled(statistics.median(every), spread(every), tries, False)


# how far a re-measured quantity may move from its cached value (beyond three times its spread)
# and still hold: a 25 % drift moves a prediction by as much, twice validate's median goal
CHECK_TOL = 0.25


@dataclass(frozen=True)
class Recheck:
    """A cached quantity measured again (`hybridpar calibrate --check`, `hybridpar validate`)."""

    quantity: str  # e.g. "update_s", "beta", "iteration at 8 samples"
    source: str  # the cache file that holds it
    cached: float
    now: float
    spread: float  # the larger of its cached and its new spread

    @property
    def ratio(self) -> float:
        return self.now / self.cached if self.cached else float("inf")

    @property
    def holds(self) -> bool:
        return abs(self.ratio - 1) <= max(CHECK_TOL, 3 * self.spread)
