"""Where the ranks meet: the blocking calls of an iteration, counted as the runtime makes them, and
what each meeting costs beyond the papers' alpha-beta model.

The alpha-beta model prices a collective as if every rank arrived at once. They do not (the ranks
of a host share its cores, the scheduler lets some run ahead), and at every blocking collective
the early ones wait for the last. That is priced at the small-message latency `hybridpar
calibrate` fitted for the job's count of ranks (`Priced.meeting_s`) per meeting: it adds to the
iteration, and at the blocking collectives it is the report's measured "waiting for the slowest
rank".

`segments` walks an iteration's layers as the runtime runs them and cuts the compute at every
blocking call the plan makes (the hand-offs, the activations' all-gathers and dX sums, the
global batch norms' sums, the halos) and at the wait for the gradient sums after the backward
pass. A term makes as many calls as the runtime's ledger books (`calls`: a hand-off that gathers
meets forward only, one that splits backward only; a layer's halo one per window; a head in
rounds once per round), and the tests hold every rank's ledger to that count per (layer, term).
A plan on one rank, or on a cluster that timed no small all-reduce, loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def sync_of(layers: Sequence[_Layer], meeting_s: float) -> Sync:
    """The meetings of `layers`, each priced at `meeting_s` (Priced.meeting_s)."""
    if meeting_s <= 0:
        return Sync()
    cuts = segments(layers)
    blocking = sum(1 for _, b in cuts if b)
    grads = len(cuts) - blocking
    return Sync(meeting_s * len(cuts), meeting_s * blocking, meeting_s * grads, len(cuts))
