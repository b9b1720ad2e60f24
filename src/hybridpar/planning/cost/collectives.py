"""Alpha-beta costs of the collectives hybridpar uses (Thakur, Rabenseifner & Gropp 2005;
Chan et al. 2007). Every function takes n, the bytes of the *whole* buffer one rank ends up
holding (all-gather: the gathered tensor; all-reduce: the reduced tensor), and p, the group size,
and returns a `Comm`: the predicted seconds and the bytes one rank sends ("bus bytes", the volume
the beta term multiplies). The runtime's ledger records the same bytes from the real tensors, so
prediction and measurement can be compared term by term (DESIGN.md invariant 2).

With p = 1 every collective costs nothing: one code path serves P = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.core.cluster import Cluster, Priced

__all__ = [
    "Comm",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "clog2",
    "compressed_all_reduce",
    "halo",
    "reduce_scatter",
    "ring_all_reduce",
]


def clog2(p: int) -> int:
    """ceil(log2 p), 0 for p <= 1: the number of rounds of a recursive-doubling collective."""
    return 0 if p <= 1 else (p - 1).bit_length()


@dataclass(frozen=True)
class Comm:
    kind: str
    group: int
    bytes: float  # per rank, the volume the beta term multiplies
    seconds: float
    calls: tuple[int, int] | None = None
    """(forward, backward) calls an iteration makes where its term does not say (a hand-off,
    a layer's halo windows, a head's rounds); None: one, in the term's pass (cost.sync)"""

    @staticmethod
    def zero(kind: str, group: int = 1) -> Comm:
        return Comm(kind, group, 0.0, 0.0)


def all_gather(n: float, p: int, net: Cluster | Priced) -> Comm:
    """Bruck / recursive doubling: alpha*ceil(log p) + beta*(p-1)/p*n."""
    if p <= 1:
        return Comm.zero("all_gather", p)
    v = (p - 1) / p * n
    return Comm("all_gather", p, v, net.alpha * clog2(p) + net.beta * v)


def reduce_scatter(n: float, p: int, net: Cluster | Priced) -> Comm:
    """Recursive halving: alpha*ceil(log p) + beta*(p-1)/p*n (reduction arithmetic not counted)."""
    if p <= 1:
        return Comm.zero("reduce_scatter", p)
    v = (p - 1) / p * n
    return Comm("reduce_scatter", p, v, net.alpha * clog2(p) + net.beta * v)


def all_reduce(n: float, p: int, net: Cluster | Priced) -> Comm:
    """Reduce-scatter + all-gather: 2*(alpha*ceil(log p) + beta*(p-1)/p*n).

    This is the form of Gholami et al. Eq. 4 ("the factor of 2 is merely due to the all-reduce
    algorithm"): Rabenseifner's latency with the ring's bandwidth term.
    """
    if p <= 1:
        return Comm.zero("all_reduce", p)
    v = 2 * (p - 1) / p * n
    return Comm("all_reduce", p, v, 2 * net.alpha * clog2(p) + net.beta * v)


def compressed_all_reduce(n: float, p: int, net: Cluster | Priced, pipelined: bool = False) -> Comm:
    """Krizhevsky's section 4.1 reduction, used with a codec: chunks to their owners by all-to-all,
    encoded sums back by all-gather: (p-1)*alpha + alpha*ceil(log p) + 2*beta*(p-1)/p*n, where n
    is the encoded size. Same bytes as `all_reduce` of n bytes; more latency.

    `pipelined`: the gradient reducer's stream (comm.collectives.CompressedPipeline), where the
    all-to-all that sends one piece's chunks and the one that returns the previous piece's sums
    are in flight together: one all-to-all's latency per piece, (p-1)*alpha + 2*beta*(p-1)/p*n
    (the flush at the end of a step is left out)."""
    if p <= 1:
        return Comm.zero("all_reduce", p)
    a, g = all_to_all(n, p, net), all_gather(n, p, net)
    latency = a.seconds - net.beta * a.bytes
    if pipelined:
        return Comm("all_reduce", p, a.bytes + g.bytes, latency + net.beta * (a.bytes + g.bytes))
    return Comm("all_reduce", p, a.bytes + g.bytes, a.seconds + g.seconds)


def ring_all_reduce(n: float, p: int, net: Cluster | Priced) -> Comm:
    """Ring: 2*(p-1)*alpha + 2*beta*(p-1)/p*n. Same bytes as `all_reduce`, more latency."""
    if p <= 1:
        return Comm.zero("all_reduce", p)
    v = 2 * (p - 1) / p * n
    return Comm("all_reduce", p, v, 2 * (p - 1) * net.alpha + net.beta * v)


def broadcast(n: float, p: int, net: Cluster | Priced) -> Comm:
    """The cheaper of a binomial tree (alpha + beta*n per round) and scatter + all-gather
    (van de Geijn): alpha*(ceil(log p) + p - 1) + 2*beta*(p-1)/p*n."""
    if p <= 1:
        return Comm.zero("broadcast", p)
    tree = Comm("broadcast", p, clog2(p) * n, clog2(p) * (net.alpha + net.beta * n))
    v = 2 * (p - 1) / p * n
    vdg = Comm("broadcast", p, v, net.alpha * (clog2(p) + p - 1) + net.beta * v)
    return min(tree, vdg, key=lambda c: c.seconds)


def all_to_all(n: float, p: int, net: Cluster | Priced) -> Comm:
    """Pairwise exchange of a buffer of n bytes per rank: (p-1)*alpha + beta*(p-1)/p*n."""
    if p <= 1:
        return Comm.zero("all_to_all", p)
    v = (p - 1) / p * n
    return Comm("all_to_all", p, v, (p - 1) * net.alpha + net.beta * v)


def halo(n: float, net: Cluster | Priced) -> Comm:
    """One halo message of n bytes: alpha + beta*n, the form of Gholami et al. Eqs. 7 and 9.
    An empty halo (a 1x1 kernel) sends nothing and costs nothing."""
    if n <= 0:
        return Comm.zero("halo", 2)
    return Comm("halo", 2, n, net.alpha + net.beta * n)
