"""The ledger: a per-rank record of every collective hybridpar runs.

Each entry has the collective's kind, group size, the bytes this rank sends by the standard
algorithm for that collective (the volume the cost model's beta term multiplies: (p-1)/p n for an
all-gather of n bytes, 2(p-1)/p n for an all-reduce), the wall time from launch to completion as
this rank saw it, the cost-model term it implements and the layers it carries. Bytes are computed
from the real tensors, so comparing them with the cost model's volume terms checks that the
runtime moves exactly what the model says (DESIGN.md invariant 2).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from hybridpar.core.terms import Term

__all__ = ["Entry", "Ledger", "bus_bytes"]


def bus_bytes(kind: str, n: float, p: int) -> float:
    """Bytes one rank sends for a collective over p ranks whose full buffer is n bytes."""
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) / p * n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * n
    if kind in ("broadcast", "reduce"):  # p - 1 ranks get (or give) n once: per rank on average
        return (p - 1) / p * n
    if kind == "halo":  # n is what this rank sends to its neighbours
        return n
    if kind == "host_reduce":  # through shared memory: nothing on the network
        return 0.0
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass
class Entry:
    kind: str
    group: int
    bytes: float
    seconds: float
    term: str  # cost-model term: allgather, dx_allreduce, dw_allreduce, redistribute, metrics, ...
    layers: dict[str, float] = field(default_factory=dict)  # layer -> share of the bytes
    step: int = 0


class Ledger:
    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.step = 0
        self.enabled = True
        self.recomputing = False  # activation checkpointing's recompute: booked as `recompute`

    def record(
        self,
        kind: str,
        group: int,
        nbytes: float,
        seconds: float,
        term: str,
        layers: dict[str, float] | None = None,
    ) -> Entry:
        """Log one collective; `layers` maps layer names to their element counts in the buffer."""
        b = bus_bytes(kind, nbytes, group)
        if layers:
            total = sum(layers.values())
            shares = {k: b * v / total for k, v in layers.items()} if total else {}
        else:
            shares = {}
        term = Term.RECOMPUTE if self.recomputing else term
        e = Entry(kind, group, b, seconds, term, shares, self.step)
        if self.enabled:
            self.entries.append(e)
        return e

    def clear(self) -> None:
        self.entries.clear()

    def bytes_by_term(self, steps: set[int] | None = None) -> dict[str, float]:
        return self._by_term("bytes", steps)

    def bytes_by_layer_term(self, steps: set[int] | None = None) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = defaultdict(float)
        for e in self.entries:
            if steps is None or e.step in steps:
                for layer, b in e.layers.items():
                    out[(layer, e.term)] += b
        return dict(out)

    def seconds_by_term(self, steps: set[int] | None = None) -> dict[str, float]:
        return self._by_term("seconds", steps)

    def _by_term(self, field: str, steps: set[int] | None) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for e in self.entries:
            if steps is None or e.step in steps:
                out[e.term] += getattr(e, field)
        return dict(out)

    def count(self, term: str | None = None) -> int:
        return sum(1 for e in self.entries if term is None or e.term == term)
