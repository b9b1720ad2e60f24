"""What the ranks lose where they meet: the wait for the slowest rank (beyond the papers).

The alpha-beta model prices a collective as if every rank arrived at once. Ranks that share a
host's cores do not: the scheduler lets some run ahead, and at every blocking collective the early
ones wait for the last. Two quantities per synchronisation, both functions of the compute since
the ranks last met, measured by `hybridpar calibrate` (runtime.train.calibration._time_sync) and
kept in the cluster's `sync` table (hybridpar.core.cluster.Cluster.sync_cost):
- the excess: how much longer the ranks take from one meeting to the next than their compute
  priced with the contention factor (each rank's time alone times P threads / cores) and
  the collective's own cost. It adds to the iteration. The table's points are noisy (a
  difference of two walls), so the excess is one least-squares line through them: a fixed cost
  per meeting (where ranks outnumber the cores, the scheduler has to give the last rank a core
  back) and a share of the compute. A plan that meets often pays the fixed cost often: resnet20
  meets about 40 times an iteration (its batch norms' statistics), so a line through 0 (a share
  of the compute alone) prices its batch plan low;
- the wait: the mean over ranks of the time each spends in the collective beyond the shortest
  any rank saw (the report's "waiting for the slowest rank"). It does not add to the iteration:
  a rank that waits at the collective has run its compute sooner, so the wait moves time from
  the compute to the communication. The predicted split shows it; the total does not count it.

`segments` walks an iteration's layers as the runtime runs them and cuts the compute at every
blocking call the plan makes (the hand-offs, the activations' all-gathers and dX sums, the
global batch norms' sums, the halos) and at the wait for the gradient sums after the backward
pass; the iteration is a loop, so the compute after the last meeting joins the first segment.
A term makes as many calls as the runtime's ledger books (`calls`: a hand-off that gathers meets
forward only, one that splits backward only; a layer's halo one per window; a head in rounds
once per round), and the tests hold every rank's ledger to that count per (layer, term).
A meeting right after another (a halo after a batch norm's sums, a hand-off after a dX sum)
waits as one after the table's least work, and that wait is lost (`Cluster.sync_cost`). A plan
on one rank, or on a cluster without the table, has none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridpar.core.terms import Term

__all__ = ["Sync", "calls", "meetings", "segments", "sync_of"]

# the blocking collectives at a layer's start (a hand-off into it, the halo of its input), at its
# forward's end (its output's all-gather, its batch norms' statistics) and at its backward's end
FORWARD_START = (Term.REDISTRIBUTE, Term.HALO_FWD)
FORWARD_END = (Term.ALLGATHER, Term.BN_STATS)
BACKWARD_END = (
    Term.BN_GRAD,
    Term.DX_ALLREDUCE,
    Term.DX_ALLGATHER,
    Term.HALO_BWD,
    Term.REDISTRIBUTE,
)


class _Comm(Protocol):
    bytes: float
    calls: tuple[int, int] | None


class _Layer(Protocol):
    terms: dict[str, _Comm]
    forward_s: float
    backward_s: float
    update_s: float


def calls(term: str, c: _Comm) -> tuple[int, int]:
    """(forward, backward) blocking calls a layer's `term` makes per iteration, as the runtime's
    ledger books them: the Comm's own count where it has one (a hand-off gathers forward and
    returns a partial dX backward only where fused; a layer's halo exchanges one per window;
    a head's collectives once per round), else one in each pass the term meets in."""
    if c.bytes <= 0:
        return 0, 0
    if c.calls is not None:
        return c.calls
    return int(term in FORWARD_START or term in FORWARD_END), int(term in BACKWARD_END)


def meetings(layers: Sequence[_Layer]) -> tuple[list[tuple[str, float]], float]:
    """(term, compute seconds since the ranks last met) of every blocking call of one iteration,
    in the order the runtime runs them, and the compute after the last of them (the backward's,
    updates left out). A layer's first call of each starting term meets before its forward,
    the others (a halo's later windows, a head's later rounds) after it."""
    out: list[tuple[str, float]] = []
    acc = 0.0

    def meet(x: _Layer, kinds: tuple[str, ...], backward: bool, part=slice(None)) -> None:
        nonlocal acc
        for k in kinds:
            c = x.terms.get(k)
            for _ in range(0 if c is None else calls(k, c)[backward])[part]:
                out.append((k, acc))
                acc = 0.0

    for x in layers:
        meet(x, FORWARD_START, False, slice(1))
        acc += x.forward_s
        meet(x, FORWARD_START, False, slice(1, None))
        meet(x, FORWARD_END, False)
    for x in reversed(layers):
        acc += x.backward_s
        meet(x, BACKWARD_END, True)
    return out, acc


def segments(layers: Sequence[_Layer]) -> list[tuple[float, bool]]:
    """(compute seconds since the ranks last met, blocking) for every meeting of one iteration, in
    order: blocking for a collective inside the forward or backward pass, not for the wait for
    the gradient sums after it."""
    met, acc = meetings(layers)
    out = [(before, True) for _, before in met]
    acc += math.fsum(x.update_s for x in layers)
    grads = any((c := x.terms.get(Term.DW_ALLREDUCE)) is not None and c.bytes > 0 for x in layers)
    if grads:
        out.append((acc, False))
    elif out:  # the next iteration's first meeting ends this compute too
        first, blocking = out[0]
        out[0] = (first + acc, blocking)
    return out


@dataclass(frozen=True)
class Sync:
    """The predicted cost of a plan's meetings, per iteration: `excess_s` (adds to the iteration),
    `wait_s` (at the blocking collectives: the report's measured "waiting for the slowest rank")
    and `grad_wait_s` (at the wait for the gradient sums, which the report counts in the
    communication but not as waiting)."""

    excess_s: float = 0.0
    wait_s: float = 0.0
    grad_wait_s: float = 0.0
    meetings: int = 0


def sync_of(layers: Sequence[_Layer], cost: Callable[[float], tuple[float, float]] | None) -> Sync:
    """The meetings of `layers` priced by `cost` (compute seconds -> (excess, wait): the cluster's
    `sync_cost`); nothing where the cluster has no table."""
    if cost is None:
        return Sync()
    excess = wait = grad_wait = 0.0
    cuts = segments(layers)
    for seconds, blocking in cuts:
        e, w = cost(seconds)
        excess += e
        if blocking:
            wait += w
        else:
            grad_wait += w
    return Sync(excess, wait, grad_wait, len(cuts))
