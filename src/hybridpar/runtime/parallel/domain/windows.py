"""The stand-ins of the domain style's windowed operations: a convolution, a transposed
convolution, an interpolation, a pad and a max or average pooling on this rank's band of rows
(or tile), from the band and the halo rows (columns) its window reads (`_Windowed`, over
halo.py's exchange).
A convolution joins band, halo and padding once (`_ConvOfPieces`: a tile's widened rows are kept
as their pieces)."""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn import functional as F

from hybridpar.core.halo import RowMap, Transposed
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.domain.halo import (
    Exchange,
    _Post,
    _rows_like,
    _Wait,
)


class _Strip:
    """Rows of a tile widened by halo and padding columns, kept as its column pieces (the tile a
    view of what the layer before keeps): what a row exchange and a convolution read of it."""

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        self.pieces = pieces

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.pieces[0].shape
        return (*first[:3], sum(p.shape[3] for p in self.pieces), *first[4:])

    def narrow(self, dim: int, start: int, length: int) -> _Strip:
        assert dim == 2, "a strip is cut by rows"
        return _Strip([p.narrow(2, start, length) for p in self.pieces])

    def joined(self) -> torch.Tensor:
        return torch.cat(self.pieces, dim=3)

    def new_full(self, shape, value) -> torch.Tensor:
        return self.pieces[0].new_full(shape, value)

    def new_zeros(self, shape) -> torch.Tensor:
        return self.pieces[0].new_zeros(shape)


class _Windowed:
    """An operation on a band of rows (what the style swaps in for F.conv2d, a pooling, a
    transposed convolution or an interpolation in the module's own forward: core.ops):
    `compute(rows, lo, a, b)` turns the input rows it reads (padded: no padding left to add along
    the height) into output rows [a, b).

    On tiles (`cols`: the column map, `pw` tile columns; the group's rank m holds tile
    (m // pw, m % pw)) the halo columns come first, over the tile's row of tiles, and the tile
    widened by them (and by the padding's columns) is what the row exchange, over its column of
    tiles, sends: the corners travel with the rows. `compute` then reads `self.cols`: the
    widened tile's first column and the output columns [a, b) it makes, no width padding left."""

    fill = 0.0  # what the rows outside the image hold (the height padding)
    cols: tuple[int, int, int] | None = None  # on tiles: (first input column, a, b)

    def setup(self, window: RowMap, group: Group, ledger: Ledger | None, layer: str,
              cols: RowMap | None = None, pw: int = 1) -> None:  # fmt: skip
        rows = None
        if pw > 1 and cols is not None:
            i, j = divmod(group.rank, pw)
            rows = list(range(j, group.size, pw))  # this tile's column of tiles
            line = list(range(i * pw, (i + 1) * pw))  # its row of tiles
            self.widen = Exchange(cols, group, ledger, layer, dim=3, line=line)
            part = cols.parts(pw)[j]
            self.cols = (part.reads[0], *part.out)
        self.exchange = Exchange(window, group, ledger, layer, line=rows)
        w, (a, b) = window, self.exchange.band
        # the output rows whose window reads only this band (and padding): computed while the
        # halo rows travel
        edge = (-math.inf, math.inf) if w.wrap else (0, w.h_in)  # periodic: no padding
        inside = [
            o
            for o in range(*self.exchange.out)
            if max(w.reads(o, o + 1)[0], edge[0]) >= a and min(w.reads(o, o + 1)[1], edge[1]) <= b
        ]
        self.interior = (inside[0], inside[-1] + 1) if inside else (0, 0)

    def compute(self, rows: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        """The output rows [a, b) from the padded input rows `rows` they read, the first of
        which is image row `lo` (negative: padding above the image)."""
        raise NotImplementedError

    joined = True  # compute takes the rows as one tensor (else as the list of their pieces)

    def _rows(self, parts: list[tuple[int, torch.Tensor]], lo: int, hi: int, like,
              dim: int = 2, joined: bool | None = None):  # fmt: skip
        """Padded input rows (dim 3: columns) [lo, hi) from the pieces (first image row, rows)
        and the fill: one tensor, or where `joined` is off the list of pieces (the band's a view
        of it)."""
        window = (self.exchange if dim == 2 else self.widen).window
        h, out = window.h_in, []
        if lo < 0 and not window.wrap:
            out.append(like.new_full(_rows_like(like, -lo, dim), self.fill))
        for first, t in sorted(parts, key=lambda p: p[0]):
            a, b = max(lo, first), min(hi, first + t.shape[dim])
            if a < b:
                out.append(t.narrow(dim, a - first, b - a))
        if hi > h and not window.wrap:
            out.append(like.new_full(_rows_like(like, hi - h, dim), self.fill))
        if not out:  # output rows no input row reaches (a transposed convolution's gaps)
            out.append(like.new_zeros(_rows_like(like, 0, dim)))
        if not (self.joined if joined is None else joined):
            return out
        out = [t.joined() if isinstance(t, _Strip) else t for t in out]
        return torch.cat(out, dim=dim) if len(out) > 1 else out[0]

    def _widened(self, x: torch.Tensor) -> torch.Tensor | _Strip:
        """On tiles: the tile with the halo columns its output columns read, and the padding's,
        as its column pieces (no copy of the tile)."""
        ex = self.widen
        got = []
        if ex.needed:
            call: dict = {}
            (x,) = _Post.apply(ex, call, x)
            got = [(p.at, t) for p, t in zip(ex.pieces, _Wait.apply(x, ex, call), strict=False)]
            if "entry" in call:
                call["entry"].seconds = time.perf_counter() - call["t0"]
        parts = [*_own(ex, x), *got]
        lo, a, b = self.cols
        pieces = self._rows(parts, lo, max(lo, ex.window.reads(a, b)[1]), x, dim=3, joined=False)
        return pieces[0] if len(pieces) == 1 else _Strip(pieces)

    def _out(self, parts: list, a: int, b: int, like: torch.Tensor) -> torch.Tensor:
        """Output rows [a, b) from the input pieces."""
        lo, hi = self.exchange.window.reads(a, b)
        hi = max(lo, hi)
        return self.compute(self._rows(parts, lo, hi, like), lo, a, b)

    def band(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output rows of its band `x` and the halo rows it receives."""
        if self.cols is not None:
            x = self._widened(x)
        ex, call = self.exchange, {}
        (o0, o1), (i0, i1) = ex.out, self.interior
        if not ex.needed:
            return self._out(_own(ex, x), o0, o1, x)
        if isinstance(x, _Strip):  # its rows go joined along the width, corners with them
            x = _Strip(list(_Post.apply(ex, call, *x.pieces)))
            like = x.pieces[0]
        else:
            (x,) = _Post.apply(ex, call, x)
            like = x
        own = [(ex.band[0], x)]  # the band alone (its rows from across an edge come with the halo)
        # the interior rows while the halo rows travel, over the network; through shared memory
        # they are there at once, and three pieces (the interior, the rows next to each
        # neighbour, their concatenation, forward and backward) cost more than one call on band
        # and halo
        pieces = i0 < i1 and "shm" not in call
        mid = self._out(own, i0, i1, x) if pieces else None
        t_mid = time.perf_counter()
        got = _Wait.apply(like, ex, call)
        t_end = time.perf_counter()
        ex.hidden.append((t_end - call["t0"], t_end - t_mid))
        if "entry" in call:
            call["entry"].seconds = t_end - call["t0"]
        parts = [*_own(ex, x), *((p.at, t) for p, t in zip(ex.pieces, got, strict=False))]
        if mid is None:
            return self._out(parts, o0, o1, x)
        pieces = [mid]
        if o0 < i0:
            pieces.insert(0, self._out(parts, o0, i0, x))
        if i1 < o1:
            pieces.append(self._out(parts, i1, o1, x))
        return torch.cat(pieces, dim=2) if len(pieces) > 1 else mid


def _own(ex: Exchange, x) -> list[tuple[int, object]]:
    """(first row, rows) of the band `x` and of its rows a window reads from across an edge."""
    lo = ex.band[0]
    return [(lo, x), *((p.at, x.narrow(ex.dim, p.lo - lo, p.hi - p.lo)) for p in ex.selfs)]


class DomainConv(_Windowed):
    """F.conv2d (a volume's F.conv3d) on this rank's band of rows (of depth slices), with the
    weight and bias the module's forward hands it (whole on every rank): the height padding
    replaced by the halo and zero rows outside the image."""

    def __init__(self, conv: nn.Module, window: RowMap, group, ledger, layer: str, **tiles):
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self.setup(window, group, ledger, layer, **tiles)
        circular = getattr(conv, "padding_mode", "zeros") == "circular"
        circular = circular and not isinstance(conv.padding, str)  # 'valid' pads nothing
        split = 2 if self.cols else 1  # the rows' padding (a tile's columns'): the halo's
        zeros = (0,) * len(conv.padding)
        self.width_padding = zeros if circular else (0,) * split + tuple(conv.padding[split:])
        # a circular padding of the dims a rank holds whole, F.pad's pairs (last dim first): what
        # `compute` pads; the split dims wrap by the rows (columns) the exchange brings
        pairs = [v for p in reversed(conv.padding[split:]) for v in (p, p)] if circular else []
        self.wrap = [*pairs, *[0] * (2 * split)] if any(pairs) else []

    def through(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The module's circular F.pad of its input before its convolution: none here (`wrap`,
        and the exchange's rows from across the edges, core.halo.RowMap.wrap); its rows travel
        unpadded, as the cost model prices them."""
        return x

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None, *args, **kwargs):
        self.weight, self.bias = weight, bias
        try:
            return self.band(x)
        finally:
            self.weight = self.bias = None

    joined = False

    def compute(self, rows: list, lo: int, a: int, b: int) -> torch.Tensor:
        conf = (self.stride, self.width_padding, self.dilation, self.groups)
        if self.wrap and len(rows[0].shape) == 5:  # a volume's width (and height): padded whole
            x = torch.cat([r.joined() if isinstance(r, _Strip) else r for r in rows], dim=2)
            return _CONV[5][0](F.pad(x, self.wrap, "circular"), self.weight, self.bias, *conf)
        if self.wrap:  # the width wraps: its last and first columns as pieces (views) of a strip
            rows = [_wrapped(r, *self.wrap[:2]) for r in rows]
        if len(rows) == 1 and not isinstance(rows[0], _Strip):  # the band alone (a 1x1
            return _CONV[rows[0].dim()][0](rows[0], self.weight, self.bias, *conf)  # conv)
        layout = tuple(len(r.pieces) if isinstance(r, _Strip) else 1 for r in rows)
        flat = [p for r in rows for p in (r.pieces if isinstance(r, _Strip) else [r])]
        return _ConvOfPieces.apply(self.weight, self.bias, conf, layout, *flat)


def _wrapped(rows: torch.Tensor, left: int, right: int) -> _Strip:
    """`rows` widened by their last `left` and first `right` columns (views, not copies)."""
    return _Strip([rows.narrow(3, rows.shape[3] - left, left), rows, rows.narrow(3, 0, right)])


# input dims -> the convolution, its input gradient and its weight gradient
_CONV = {
    4: (F.conv2d, torch.nn.grad.conv2d_input, torch.nn.grad.conv2d_weight),
    5: (F.conv3d, torch.nn.grad.conv3d_input, torch.nn.grad.conv3d_weight),
}


def _join(layout: tuple[int, ...], pieces: list[torch.Tensor], dtype: torch.dtype):
    """One tensor of rows of pieces (`layout`: how many pieces each row has, a row of several
    being a strip's columns), copied once; and where each piece lies in it (row, column)."""
    first = pieces[0]
    rows, at, where = [], 0, []
    for n in layout:
        rows.append(pieces[at : at + n])
        at += n
    height = sum(row[0].shape[2] for row in rows)
    shape = list(first.shape)
    shape[2] = height
    shape[3] = sum(p.shape[3] for p in rows[0])  # a strip's columns (else the piece's own)
    out, r0 = first.new_empty(shape, dtype=dtype), 0
    for row in rows:
        c0 = 0
        for p in row:
            part = out.narrow(2, r0, p.shape[2])
            if len(row) > 1:
                part = part.narrow(3, c0, p.shape[3])
            part.copy_(p)
            where.append((r0, c0))
            c0 += p.shape[3] if len(row) > 1 else 0
        r0 += row[0].shape[2]
    return out, where


class _ConvOfPieces(torch.autograd.Function):
    """Forward: F.conv2d of the pieces (padding, halo rows, the band; on tiles a strip's columns
    as a row of pieces: `layout`) joined along the height, copied once. Backward: the gradients
    of the input, the weight and the bias from the pieces joined again; only the pieces are kept
    in between, not their join: the band (tile) is what the layer before keeps already (a
    ReLU's output), so the halo's and the padding's rows (and columns) are all it adds."""

    @staticmethod
    def forward(ctx, weight, bias, conf, layout, *pieces):
        ctx.conf, ctx.layout, ctx.bias = conf, layout, None if bias is None else bias.dtype
        ctx.save_for_backward(weight, *pieces)
        return _CONV[weight.dim()][0](_join(layout, pieces, pieces[0].dtype)[0], weight, bias,
                                      *conf)  # fmt: skip

    @staticmethod
    def backward(ctx, g):
        weight, *pieces = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        # under autocast: what the conv computed on
        rows, where = _join(ctx.layout, pieces, g.dtype)
        w = weight.to(g.dtype)
        _, conv_input, conv_weight = _CONV[w.dim()]
        grads = [None] * (4 + len(pieces))
        if any(ctx.needs_input_grad[4:]):
            gx = conv_input(rows.shape, w, g, stride, padding, dilation, groups)
            for i, (p, (r0, c0)) in enumerate(zip(pieces, where, strict=True)):
                if ctx.needs_input_grad[4 + i]:
                    part = gx.narrow(2, r0, p.shape[2]).narrow(3, c0, p.shape[3])  # its columns
                    grads[4 + i] = part.to(p.dtype)
        if ctx.needs_input_grad[0]:
            gw = conv_weight(rows, w.shape, g, stride, padding, dilation, groups)
            grads[0] = gw.to(weight.dtype)
        if ctx.bias is not None and ctx.needs_input_grad[1]:
            grads[1] = g.sum([0, *range(2, g.dim())]).to(ctx.bias)
        return tuple(grads)


class DomainTransposed(_Windowed):
    """F.conv_transpose2d on this rank's band of rows: the input rows whose taps land in its
    output band (core.halo.Transposed), transposed without height padding, the band's rows cut
    out of the result (rows no tap reaches hold the bias alone, as in the whole image)."""

    def __init__(self, conv: nn.ConvTranspose2d, window: RowMap, group, ledger, layer: str,
                 **tiles):  # fmt: skip
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self.padding = conv.padding
        self.setup(window, group, ledger, layer, **tiles)

    def __call__(self, x, weight, bias=None, stride=1, padding=0, output_padding=0, *args, **kw):
        out = kw.get("output_padding", output_padding)
        out = tuple(out) if isinstance(out, tuple | list) else (out,) * (x.dim() - 2)
        self.weight, self.bias, self.width_out = weight, bias, out[1:]
        try:
            return self.band(x)
        finally:
            self.weight = self.bias = None

    def compute(self, rows: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        for d in range(2, 2 + (self.cols is not None) + 1):
            if rows.shape[d] == 0:  # no input row reaches these output rows: the bias alone
                rows = rows.new_zeros(_rows_like(rows, 1, d))
        transposed = F.conv_transpose3d if rows.dim() == 5 else F.conv_transpose2d
        split = 2 if self.cols else 1  # dims the halo's rows (a tile's columns) padded
        width = (self.padding[split:], self.width_out[split - 1 :])
        pads = ((0,) * split + tuple(width[0]), (0,) * split + tuple(width[1]))
        y = transposed(rows, self.weight, None, self.stride, *pads, self.groups, self.dilation)
        y = self._crop(y, 2, lo, a, b)
        if self.cols is not None:
            y = self._crop(y, 3, *self.cols)
        return y if self.bias is None else y + self.bias.view(1, -1, *[1] * (y.dim() - 2))

    def _crop(self, y: torch.Tensor, dim: int, lo: int, a: int, b: int) -> torch.Tensor:
        """Output rows (columns) [a, b) of y, which starts where input row `lo` lands; zero where
        no tap reaches."""
        start = lo * self.stride[dim - 2] - self.padding[dim - 2]  # the output row of y's first
        off = min(max(a - start, 0), y.shape[dim])
        y = y.narrow(dim, off, y.shape[dim] - off)
        first = max(start - a, 0)
        pad = [0, 0] * (y.dim() - 2)  # F.pad's pairs run from the last dimension
        at = 2 * (y.dim() - 1 - dim)
        pad[at : at + 2] = [first, max(b - a - first - y.shape[dim], 0)]
        return F.pad(y, pad).narrow(dim, 0, b - a)


class DomainResample(_Windowed):
    """F.interpolate on this rank's band of rows: along the height the band's output rows are
    weighed from the rows they read with torch's own weights (core.halo.Resample), along the
    width torch interpolates as it would the whole image (the height kept: an identity); on
    tiles the columns are weighed as the rows are."""

    def __init__(self, module: nn.Module, window: RowMap, group, ledger, layer: str, **tiles):
        self.setup(window, group, ledger, layer, **tiles)
        self.taps: dict = {}

    def __call__(self, x, size=None, scale_factor=None, *args, **kwargs):
        self.size, self.scale = size, scale_factor
        self.args, self.kwargs = args, kwargs
        return self.band(x)

    def _taps(self, like: torch.Tensor, a: int, b: int, lo: int, dim: int = 2):
        """(index, weight) of each output row (dim 3: column) of [a, b): (rows, taps) each,
        from row `lo` on."""
        key = (a, b, lo, dim, like.dtype, like.device)
        if key not in self.taps:
            w = (self.exchange if dim == 2 else self.widen).window.weights()[a:b]
            taps = max(int((w != 0).sum(1).max()), 1)
            index = w.abs().topk(taps, dim=1).indices
            weight = w.gather(1, index)
            index = torch.where(weight != 0, index - lo, 0)  # a row with fewer taps: weight 0
            self.taps[key] = (index.to(like.device), weight.to(like))
        return self.taps[key]

    def _along(self, rows: torch.Tensor, dim: int, lo: int, a: int, b: int) -> torch.Tensor:
        """Output rows (dim 3: columns) [a, b) weighed from the input ones, from `lo` on."""
        index, weight = self._taps(rows, a, b, lo, dim)
        shape = [1] * rows.dim()
        shape[dim] = -1
        return sum(
            rows.index_select(dim, index[:, j]) * weight[:, j].view(shape)
            for j in range(index.shape[1])
        )

    def compute(self, rows: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        high = self._along(rows, 2, lo, a, b)
        split = 1  # the dims weighed here: the rows (and a tile's columns)
        if self.cols is not None:
            high, split = self._along(high, 3, *self.cols), 2
        n = rows.dim() - 2  # the spatial dims; torch interpolates those beyond the split ones
        if n == split:
            return high
        if self.size is not None:
            size = tuple(self.size) if isinstance(self.size, tuple | list) else (self.size,) * n
            return F.interpolate(high, (*high.shape[2 : 2 + split], *size[split:]), None,
                                 *self.args, **self.kwargs)  # fmt: skip
        scale = tuple(self.scale) if isinstance(self.scale, tuple | list) else (self.scale,) * n
        return F.interpolate(high, None, (1.0,) * split + scale[split:], *self.args, **self.kwargs)


class DomainPool(_Windowed):
    """A max or average pooling (2-d, or a volume's 3-d) on this rank's band of rows (-inf or
    zero rows outside the image; an average without padding counts only the image's elements,
    as AvgPool2d does)."""

    def __init__(self, pool: nn.Module, window: RowMap, group, ledger, layer: str, **tiles):
        n = 3 if isinstance(pool, nn.MaxPool3d | nn.AvgPool3d) else 2
        tup = nn.modules.utils._ntuple(n)
        self.pool = pool
        self.kernel, self.stride = tup(pool.kernel_size), tup(pool.stride or pool.kernel_size)
        self.is_max = isinstance(pool, nn.MaxPool2d | nn.MaxPool3d)
        self.fill = float("-inf") if self.is_max else 0.0
        self.max_pool, self.avg_pool = (
            (F.max_pool3d, F.avg_pool3d) if n == 3 else (F.max_pool2d, F.avg_pool2d)
        )
        self.setup(window, group, ledger, layer, **tiles)
        split = 2 if self.cols else 1  # the rows' padding (a tile's columns'): the halo's
        self.width_padding = (0,) * split + tup(pool.padding)[split:]

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.band(x)

    def _inside(self, rows: torch.Tensor, lo: int, padded: bool) -> list[tuple[int, torch.Tensor]]:
        """Per split dim, 1 on its rows (columns) inside the image (`padded`: and its padding),
        0 on the fill, shaped to broadcast along that dim."""
        out = []
        along = [(2, self.exchange, lo)] + ([(3, self.widen, self.cols[0])] if self.cols else [])
        for dim, ex, first in along:
            window, n = ex.window, rows.shape[dim]
            index = torch.arange(first, first + n, device=rows.device)
            pad = window.padding if padded else 0
            shape = [1] * rows.dim()
            shape[dim] = n
            inside = (index >= -pad) & (index < window.h_in + pad)
            out.append((dim, inside.to(rows.dtype).view(shape)))
        return out

    def compute(self, rows: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        p, k, st, pad = self.pool, self.kernel, self.stride, self.width_padding
        ceil = p.ceil_mode  # the band's rows are exact either way; the width follows it
        if self.is_max:
            return self.max_pool(rows, k, st, pad, p.dilation, ceil)
        avg = self.avg_pool
        if p.divisor_override:
            return avg(rows, k, st, pad, ceil, True, p.divisor_override)
        mean = avg(rows, k, st, pad, ceil, True)  # the whole window's rows counted
        if p.count_include_pad:
            if not ceil:
                return mean
            # a window past the bottom padding (ceil_mode) counts the rows up to it only
            for dim, inside in self._inside(rows, lo, padded=True):
                one = [1] * (rows.dim() - 2)
                kd, sd = list(one), list(one)
                kd[dim - 2], sd[dim - 2] = k[dim - 2], st[dim - 2]
                mean = mean / avg(inside, tuple(kd), tuple(sd))
            return mean
        # AvgPool2d divides by the image's elements only: the window's share of them, from a mask
        # of ones on the image's rows and columns (and zeros on the padding's)
        mask = math.prod(m for _, m in self._inside(rows, lo, padded=False))
        mask = mask.expand(1, 1, *rows.shape[2:])
        return mean / avg(mask, k, st, pad, ceil, True)


class DomainShuffle(_Windowed):
    """F.pixel_shuffle (F.pixel_unshuffle) by r on this rank's band of rows (or tile): the input
    rows its output rows come from (core.operations: r taps at stride r, transposed; a window of
    r at stride r), shuffled whole, the band's rows (the tile's columns) cut out of the result."""

    def __init__(self, module: nn.Module, window: RowMap, group, ledger, layer: str, **tiles):
        self.up = isinstance(window, Transposed)
        self.setup(window, group, ledger, layer, **tiles)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        (self.factor,) = (*args, *kwargs.values())
        return self.band(x)

    def compute(self, rows: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        r = self.factor
        y = (F.pixel_shuffle if self.up else F.pixel_unshuffle)(rows, r)
        along = [(2, lo, a, b)] + ([(3, *self.cols)] if self.cols is not None else [])
        for dim, first, c0, c1 in along:  # y's first row (column) is input row `first`'s
            y = y.narrow(dim, c0 - (first * r if self.up else first // r), c1 - c0)
        return y


class DomainPad(_Windowed):
    """F.pad on this rank's band of rows (or tile): the rows (columns) beyond the image's edges
    are the fill or, circular, the image's rows from across the edge (the exchange brings them);
    the dimensions a rank holds whole are padded as torch pads them."""

    def __init__(self, module: nn.Module, window: RowMap, group, ledger, layer: str, **tiles):
        self.setup(window, group, ledger, layer, **tiles)

    def __call__(self, x: torch.Tensor, pad, mode: str = "constant", value=None) -> torch.Tensor:
        self.pad, self.mode, self.value = list(pad), mode, value
        self.fill = 0.0 if value is None else float(value)
        return self.band(x)

    def compute(self, rows: torch.Tensor, lo: int, a: int, b: int) -> torch.Tensor:
        pad = list(self.pad)
        for d in range(2, 3 + (self.cols is not None)):  # the rows (columns) padded already
            at = 2 * (rows.dim() - 1 - d)
            pad[at : at + 2] = [0, 0][: max(len(pad) - at, 0)]
        if not any(pad):
            return rows
        value = {"value": self.value} if self.value is not None else {}
        return F.pad(rows, pad, self.mode, **value)


STAND_INS = {
    "pad": DomainPad,
    "conv": DomainConv,
    "transposed": DomainTransposed,
    "resample": DomainResample,
    "pool": DomainPool,
    "shuffle": DomainShuffle,
}
"""core.operations' stand-in names -> the classes"""
