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

Other row maps. Every operation a domain segment runs states which input rows an output band
reads (`RowMap.reads`); the halo and its bytes follow from that alone:

| map          | operation                                | output rows [o0, o1) read                   |
| ------------ | ---------------------------------------- | ------------------------------------------- |
| `Window`     | Conv2d, MaxPool2d, AvgPool2d (ceil_mode) | s*o0 - p .. s*(o1-1) - p + d*(k-1), padded   |
| `Transposed` | ConvTranspose2d                          | the inputs whose taps land in the band      |
| `Pad`        | F.pad (constant or circular)             | o0 - top .. o1 - 1 - top                    |
| `Resample`   | Upsample / F.interpolate                 | the source rows of torch's own weights      |
| `Spread`     | the same, of a whole value (a global     | every row, held by every rank: none moves   |
|              | pooling's) to the image's rows           |                                             |

A resampling's source rows are read off torch itself (the identity interpolated along the height,
cached per geometry), so the rows a band reads are the rows torch reads, whatever the mode
(nearest, nearest-exact, bilinear, bicubic), align_corners or scale.

Wrap-around. A circular padding (`padding_mode="circular"`, `F.pad(..., mode="circular")`) makes
a dimension periodic (`RowMap.wrap`): the rows a band reads above row 0 are the image's last
rows, those below its last row its first. The exchange then cuts what a band reads at the edges
(`Piece`: which rows of whose band, and where they go): the first and last bands send each other
rows, and a band that reads its own rows from across the edge (one rank; or a band of a tile
row) copies them itself.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

__all__ = [
    "TILED",
    "Pad",
    "Part",
    "Piece",
    "Pooled",
    "Resample",
    "RowMap",
    "Span",
    "Spread",
    "Transposed",
    "Window",
    "bands",
    "printed_halo_rows",
    "tile",
]


def bands(h: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's rows when h rows split over `parts` ranks, the larger bands first."""
    sizes = [h // parts + (1 if i < h % parts else 0) for i in range(parts)]
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


TILED = "on tiles: "
"""the start of a blocker (core.rows) that ends a domain segment's claim on tiles only (a band
of rows runs it): an operation that mixes columns"""


def tile(shape: tuple[int, ...], pr: int, pw: int, r: int) -> tuple:
    """Of images (volumes) of `shape` (H, W, ...) split over the Pr ranks of a model group, what
    rank r holds: its band of rows (lo, hi), or with `pw` > 1 tile columns its tile
    ((lo, hi), (first, last + 1)): rank r holds tile (r // pw, r % pw)."""
    if pw == 1:
        return bands(shape[0], pr)[r]
    i, j = divmod(r, pw)
    return bands(shape[0], pr // pw)[i], bands(shape[1], pw)[j]


class RowMap:
    """Which input rows an operation's output rows read, along the height (`h_in` -> `h_out`).
    Where `wrap` is set the dimension is periodic: rows read beyond an edge are the image's rows
    from the other edge (a circular padding), which the first and last bands exchange."""

    h_in: int
    wrap: bool = False

    @property
    def h_out(self) -> int:
        raise NotImplementedError

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        """[lo, hi) of the input rows the output rows [o0, o1) read (rows outside [0, h_in)
        are padding, or wrap around; lo >= hi: none)."""
        raise NotImplementedError

    def held(self, parts: int) -> list[tuple[int, int]]:
        """[lo, hi) of the input rows each rank holds."""
        return bands(self.h_in, parts)

    def parts(self, n: int) -> list[Part]:
        """What each of `n` ranks holds, produces and reads: the one place the runtime's
        stand-ins, the halo exchange and the cost model take it from."""
        return _parts(self, n)

    def plan(self, parts: int) -> list[tuple[Piece, ...]]:
        """For each rank: the pieces of other ranks' rows it receives, in row order (its own rows
        wrapped around a periodic dimension among them: `Piece.rank` its own)."""
        return _exchange(self, parts)[0]

    def rows_sent(self, parts: int) -> list[int]:
        """Rows each rank sends to the others (forward; their gradients come back backward)."""
        return list(_exchange(self, parts)[1])

    def messages(self, parts: int) -> list[int]:
        """Messages each rank sends (one per rank it sends rows to: its pieces go together)."""
        return list(_exchange(self, parts)[2])


@dataclass(frozen=True)
class Piece:
    """Input rows [lo, hi) held by rank `rank` that a rank reads, at row `at` of the padded image
    (lo + a multiple of the height: wrapped around a periodic dimension, `RowMap.wrap`)."""

    rank: int
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class Part:
    """One rank's part of a row map over n ranks: the input rows [lo, hi) it holds, the output
    rows it produces, and the input rows (padding included: outside [0, h_in)) those read."""

    held: tuple[int, int]
    out: tuple[int, int]
    reads: tuple[int, int]


@functools.lru_cache(maxsize=4096)
def _parts(m: RowMap, n: int) -> list[Part]:
    outs = bands(m.h_out, n)
    return [Part(h, o, m.reads(*o)) for h, o in zip(m.held(n), outs, strict=True)]


@functools.lru_cache(maxsize=4096)
def _exchange(m: RowMap, parts: int) -> tuple[list[tuple[Piece, ...]], tuple, tuple]:
    """(RowMap.plan, rows each rank sends, messages each rank sends) of map `m` over `parts`
    ranks, once per geometry (the planner asks for the same ones at every grid it weighs). The
    rows a band reads are cut at the image's edges (a periodic dimension's rows beyond them are
    its rows from the other side, else padding) and their holders found by bisection: the bands
    are sorted and contiguous."""
    each, h = m.parts(parts), m.h_in
    ins = [p.held for p in each]
    starts = [a for a, _ in ins]
    got: list[tuple[Piece, ...]] = []
    sent, pairs = [0] * parts, set()
    for r, p in enumerate(each):
        lo, hi = p.reads if p.out[0] < p.out[1] and (m.wrap or p.held != (0, h)) else (0, 0)
        mine = []
        for turn in range(lo // h, -(-hi // h)) if m.wrap and lo < hi else [0]:
            x0, x1 = max(lo - turn * h, 0), min(hi - turn * h, h)
            for q in range(max(bisect.bisect_right(starts, x0) - 1, 0), parts) if x0 < x1 else ():
                a, b = ins[q]
                if a >= x1:
                    break
                x, y = max(x0, a), min(x1, b)
                if x < y and (q != r or turn):
                    mine.append(Piece(q, x, y, x + turn * h))
                    if q != r:
                        sent[q] += y - x
                        pairs.add((q, r))
        got.append(tuple(mine))
    count = [sum(1 for q, _ in pairs if q == s) for s in range(parts)]
    return got, tuple(sent), tuple(count)


@dataclass(frozen=True)
class Window(RowMap):
    """A sliding window along the height: kernel, stride, padding (both sides), dilation, the
    height it reads, and ceil_mode (a pooling's last window may start in the bottom padding's
    place, torch's rule: never past the image and the top padding)."""

    kernel: int
    stride: int
    padding: int
    dilation: int
    h_in: int
    ceil: bool = False
    wrap: bool = False  # padding_mode="circular": the rows beyond the edges wrap around

    @property
    def span(self) -> int:
        """Rows one output row reads: dilation * (kernel - 1) + 1."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def h_out(self) -> int:
        room = self.h_in + 2 * self.padding - self.span
        if not self.ceil:
            return room // self.stride + 1
        out = -(-room // self.stride) + 1
        return out - 1 if (out - 1) * self.stride >= self.h_in + self.padding else out

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        return self.stride * o0 - self.padding, self.stride * (o1 - 1) - self.padding + self.span


@dataclass(frozen=True)
class Transposed(RowMap):
    """A transposed convolution along the height: input row i adds to the output rows
    s*i - p + d*j for the kernel's taps j (output_padding: rows at the bottom no tap reaches
    or that only the last rows' taps reach)."""

    kernel: int
    stride: int
    padding: int
    dilation: int
    h_in: int
    output_padding: int = 0

    @property
    def h_out(self) -> int:
        s, p, d, k = self.stride, self.padding, self.dilation, self.kernel
        return (self.h_in - 1) * s - 2 * p + d * (k - 1) + self.output_padding + 1

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        reach = self.dilation * (self.kernel - 1)
        lo = -(-(o0 + self.padding - reach) // self.stride)
        return max(lo, 0), min((o1 - 1 + self.padding) // self.stride + 1, self.h_in)


@dataclass(frozen=True)
class Pad(RowMap):
    """F.pad along the height: `top` rows before the image and `bottom` after (negative: rows
    cut off), constant or (`wrap`) circular."""

    top: int
    bottom: int
    h_in: int
    wrap: bool = False

    @property
    def h_out(self) -> int:
        return self.h_in + self.top + self.bottom

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        return o0 - self.top, o1 - self.top


@dataclass(frozen=True)
class Resample(RowMap):
    """An interpolation along the height (F.interpolate's mode, align_corners and height scale
    factor, None where a size was given), from h_in rows to h_out."""

    mode: str
    align_corners: bool | None
    scale: float | None
    h_in: int
    rows_out: int

    @property
    def h_out(self) -> int:
        return self.rows_out

    def weights(self):
        """The (h_out, h_in) float64 matrix of torch's own weights of each input row in each
        output row (cached per geometry)."""
        return _resample_weights(self.mode, self.align_corners, self.scale, self.h_in, self.h_out)

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        first, last = _resample_span(self.mode, self.align_corners, self.scale, self.h_in,
                                     self.h_out)  # fmt: skip
        return min(first[o0:o1]), max(last[o0:o1]) + 1


class Spread(Resample):
    """A resampling of a whole value (every rank holds all its rows: a global pooling's) to
    bands of the output rows: each rank computes its band from what it holds."""

    def held(self, parts: int) -> list[tuple[int, int]]:
        return [(0, self.h_in)] * parts


@functools.lru_cache(maxsize=256)
def _resample_weights(mode: str, align: bool | None, scale: float | None, h_in: int, h_out: int):
    import torch
    from torch.nn import functional as F

    eye = torch.eye(h_in, dtype=torch.float64).view(1, h_in, h_in, 1)  # channel i: row i's one
    mode = "bilinear" if mode == "trilinear" else mode  # along one dimension the same weights
    kwargs: dict = {"mode": mode}
    if mode in ("bilinear", "bicubic"):
        kwargs["align_corners"] = align
    if scale is None:
        out = F.interpolate(eye, size=(h_out, 1), **kwargs)
    else:
        out = F.interpolate(eye, scale_factor=(scale, 1.0), **kwargs)
    return out.view(h_in, h_out).t().contiguous()


@functools.lru_cache(maxsize=256)
def _resample_span(mode, align, scale, h_in, h_out) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per output row, the first and last input row with a weight in it."""
    w = _resample_weights(mode, align, scale, h_in, h_out) != 0
    first = w.int().argmax(1)  # the first of the maxima
    last = h_in - 1 - w.flip(1).int().argmax(1)
    return tuple(first.tolist()), tuple(last.tolist())


@dataclass(frozen=True)
class Span:
    """How one leaf's output reads its input along one split axis (the height; the width for
    tiles; a volume's depth): its window, the sizes in and out, and what one row holds. What a
    CostLayer's `windows` (rows) and `cols` (columns) hold, one per leaf that reads other rows:
    the runtime's halo and the cost model's bytes both come from `row_map()`."""

    member: str  # the leaf (a module's name, or a function call's site: core.ops.site_name)
    kernel: int
    stride: int
    padding: int  # each side
    dilation: int
    size_in: int  # rows in (H in)
    size_out: int  # rows out (H out)
    channels: int  # C in
    across: int  # elements of one row of one channel (W in; a volume's H x W)
    how: str = ""  # "" a sliding window, "ceil" a pooling with ceil_mode, "circular" a window
    # on a periodic dimension, "transposed", "resample" (an interpolation), "spread" (the same,
    # of a whole value), "pad" (F.pad: `padding` rows before)
    extra: object = None  # transposed: the output padding; resample/spread: (mode,
    # align_corners, scale or None); pad: (rows after, circular)

    def row_map(self) -> RowMap:
        k, s, p, d, h_in = self.kernel, self.stride, self.padding, self.dilation, self.size_in
        if self.how == "transposed":
            return Transposed(k, s, p, d, h_in, self.extra)
        if self.how == "pad":
            return Pad(p, self.extra[0], h_in, self.extra[1])
        if self.how in ("resample", "spread"):
            mode, align, scale = self.extra[:3]
            cls = Spread if self.how == "spread" else Resample
            return cls(mode, align, scale, h_in, self.size_out)
        return Window(k, s, p, d, h_in, self.how == "ceil", self.how == "circular")

    @property
    def whole_in(self) -> bool:
        """Its input is a whole value (every rank holds all its rows)."""
        return self.how == "spread"


@dataclass(frozen=True)
class Pooled:
    """A global pooling riding along with a layer (core.rows.global_pool): on bands its sums are
    all-reduced over the ranks holding an example's bands."""

    member: str
    how: str  # avg, sum, max, first
    channels: int
    rows: int  # the height it pools over
    grad: bool  # its input needs a gradient
    cells: tuple[int, ...]  # (1, 1), or (k, l) of an adaptive average pooling
    rest: int  # elements of one row (W; a volume's H x W)


def printed_halo_rows(kernel: int) -> int:
    """Rows Gholami et al.'s Eq. 9 sends per neighbour: floor(k / 2), whatever the stride."""
    return kernel // 2
