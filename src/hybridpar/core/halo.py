"""Halo geometry of the domain style, torch-free: which rows of an activation split by height over
Pr ranks each rank must receive, and from whom, for a sliding window (a convolution or a pooling)
to compute the output rows it owns. The runtime exchanges exactly these rows
(hybridpar.runtime.parallel.domain) and the cost model prices exactly these bytes
(hybridpar.planning.cost.terms.t_halo), so the ledger's halo bytes equal the prediction.

Bands. Every activation in a domain layout is split by height as `even_split(H, Pr)`: rank r
holds rows [lo_r, hi_r) of every example of its batch group, the first H mod Pr ranks one row
more. A window (kernel k, stride s, padding p, dilation d) that produces the output band
[o0, o1) reads the padded input rows [s*o0 - p, s*(o1 - 1) - p + d*(k - 1) + 1): its own input
band, rows of the band above and below (the halo; several bands up or down when a band is
thinner than the halo: multi-hop), and padding outside the image. With stride and dilation the
halo is not floor(k/2) rows, and the first and last bands have one neighbour: Gholami et al.'s
Eq. 9 prints floor(k/2) rows to each side for every rank, which `printed_halo_rows` keeps for the
paper's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Window", "bands", "printed_halo_rows"]


def bands(h: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's rows when h rows split over `parts` ranks, the larger bands first."""
    sizes = [h // parts + (1 if i < h % parts else 0) for i in range(parts)]
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


@dataclass(frozen=True)
class Window:
    """A sliding window along the height: kernel, stride, padding (both sides), dilation, and
    the height it reads."""

    kernel: int
    stride: int
    padding: int
    dilation: int
    h_in: int

    @property
    def span(self) -> int:
        """Rows one output row reads: dilation * (kernel - 1) + 1."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def h_out(self) -> int:
        return (self.h_in + 2 * self.padding - self.span) // self.stride + 1

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        """[lo, hi) of the padded input rows (image rows; < 0 and >= h_in are padding) that the
        output rows [o0, o1) read."""
        return self.stride * o0 - self.padding, self.stride * (o1 - 1) - self.padding + self.span

    def plan(self, parts: int) -> list[dict[int, tuple[int, int]]]:
        """For each rank: {other rank: [lo, hi) of that rank's input rows it receives}."""
        ins, outs = bands(self.h_in, parts), bands(self.h_out, parts)
        got: list[dict[int, tuple[int, int]]] = []
        for r, (o0, o1) in enumerate(outs):
            lo, hi = self.reads(o0, o1)
            lo, hi = max(lo, 0), min(hi, self.h_in)
            mine: dict[int, tuple[int, int]] = {}
            for q, (a, b) in enumerate(ins):
                x, y = max(lo, a), min(hi, b)
                if q != r and x < y:
                    mine[q] = (x, y)
            got.append(mine)
        return got

    def rows_sent(self, parts: int) -> list[int]:
        """Rows each rank sends to the others (forward; their gradients come back backward)."""
        sent = [0] * parts
        for receives in self.plan(parts):
            for q, (a, b) in receives.items():
                sent[q] += b - a
        return sent

    def messages(self, parts: int) -> list[int]:
        """Messages each rank sends (one per rank it sends rows to)."""
        count = [0] * parts
        for receives in self.plan(parts):
            for q in receives:
                count[q] += 1
        return count


def printed_halo_rows(kernel: int) -> int:
    """Rows Gholami et al.'s Eq. 9 sends per neighbour: floor(k / 2), whatever the stride."""
    return kernel // 2
