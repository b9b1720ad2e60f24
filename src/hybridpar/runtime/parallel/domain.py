"""The domain style (Gholami et al. section 2.4, Eqs. 7 and 9): a segment's activations split by
height over the Pr ranks of a model group, the Pc batch groups splitting the examples.

Each rank holds a band of rows of every example of its batch group (`even_split(H, Pr)`, the
first H mod Pr ranks one row more: core.halo.bands). A 2-d convolution or pooling computes
the output rows it owns from its band and the halo rows its window reads from other bands
(core.halo.Window.plan: stride, dilation and padding included; several bands away when a
band is thinner than the halo). Forward, the halo rows are posted as non-blocking point-to-point
sends and receives, the interior output rows (those its own band alone determines) are computed
while they travel, then the border rows; through a host's shared memory, where the rows arrive in
microseconds, the whole band is one call after the halo is in. Backward, the gradients of the halo rows go back to
their owners and are added to their rows. Batch norm takes its statistics over every rank (rows
and examples); element-wise layers run on the band as they are. Parameters are whole on every
rank: their gradients are summed over all P ranks.

On tiles (`domain(HxWxC)`: rank m of the model group holds tile (m // W, m % W) of each image)
a window's halo columns travel first, along the tile's row of tiles, and the tile widened by
them is what the row exchange sends along its column of tiles: the corners come with the rows
(`_Windowed.setup`).

| function        | forward                                       | backward                        | term      |
| --------------- | --------------------------------------------- | ------------------------------- | --------- |
| _Post           | post the sends and receives of halo rows       | receive the gradients of the    | halo_fwd  |
|                 | (non-blocking); the band passes through        | rows sent, add them to the band |           |
| _Wait           | wait for the halo rows                         | send their gradients back       | halo_bwd  |
| _Transposed     | all-to-all: my examples' bands to their owners | the inverse all-to-all          | redistribute |
|                 | (or back, out of the domain layout)            |                                 |           |
| cut / join      | keep my band (tile) / all-gather them          | all-gather / keep (redistribute.py) | redistribute |

Moves into and out of the domain layout (`MOVES`): from the layout with the same batch groups a
band is kept (its gradient all-gathered backward), from pure batch one all-to-all each way within
the model group (tiles: through the replicated layout), from any other layout through the
replicated layout of the domain grid, and
back the same ways; the cost model (planning.cost.terms.redistribute) prices exactly these.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.instancenorm import _InstanceNorm

from hybridpar.core import faults, ops
from hybridpar.core.halo import RowMap, bands, tile
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style
from hybridpar.core.terms import Term
from hybridpar.runtime.comm import p2p
from hybridpar.runtime.comm.collectives import Via, all_reduce
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.batchnorm import BandStatistics
from hybridpar.runtime.parallel.mappings import Pieces, gather, one_part, split, transpose
from hybridpar.runtime.parallel.redistribute import Chain, Move, replicated
from hybridpar.runtime.parallel.styles import ParallelStyle

__all__ = [
    "MOVES",
    "DomainConv",
    "DomainPool",
    "DomainResample",
    "DomainStyle",
    "DomainTransposed",
    "Exchange",
    "SpaceReduction",
]


class Exchange:
    """The halo rows of one window on this rank: what it receives from whom and sends to whom,
    over the model group (`ranks`: the group's global ranks, in band order), or on tiles along
    one line of it (`line`, `dim`: the columns of a row of tiles, the rows of a column).

    On one host (the group built with shared memory, comm.small) the rows of bands travel
    through the group's shared segment: forward, each rank writes the rows others read into its
    slot and raises its flag (`begin`), computes its interior rows, then waits for the others'
    flags and copies out what it reads (`finish`); backward, one exchange of the gradients in
    `_Post`'s backward, which every rank runs. Elsewhere (several hosts, CUDA, more than the
    segment's limit, tiles) they travel as point-to-point sends and receives (comm.p2p: through
    host buffers where gloo carries them, a GPU's rows included). Either way the ledger books
    the bytes each rank sends to the others, what the cost model prices."""

    def __init__(self, window: RowMap, group: Group, ledger: Ledger | None, layer: str,
                 dim: int = 2, line: list[int] | None = None) -> None:  # fmt: skip
        self.window, self.group, self.ledger, self.layer = window, group, ledger, layer
        # on tiles the exchange runs along one line of the group's ranks (`line`: their ranks in
        # the group, in order; the columns (dim 3) of a tile row or the rows of a tile column)
        self.tiled = line is not None  # point to point: the shared slots are the whole group's
        line = list(range(group.size)) if line is None else line
        pr, me = len(line), line.index(group.rank)
        self.me, self.pr, self.dim = me, pr, dim
        self.ranks = [dist.get_global_rank(group.pg, j) for j in line]
        self.band = window.held(pr)[me]
        self.out = bands(window.h_out, pr)[me]
        plan = window.plan(pr)  # every rank's receives: {rank: [lo, hi)}
        self.receives = plan[me]
        self.sends = {q: plan[q][me] for q in range(pr) if me in plan[q]}
        self.needed = any(plan)  # no rank reads another's rows (1x1, aligned pools): nothing moves
        # through shared memory each rank's slot holds its pieces in rank order (forward: the rows
        # it sends, by receiver; backward: the gradients of the rows it got, by sender): the most
        # rows a slot holds, and where this rank's piece starts in another's
        sent = [{q: plan[q][r] for q in range(pr) if r in plan[q]} for r in range(pr)]
        self.most = max(sum(b - a for a, b in s.values()) for s in sent)
        self.most_back = max(sum(b - a for a, b in got.values()) for got in plan)
        self.read_at = {q: _rows_before(sent[q], me) for q in self.receives}
        self.back_at = {q: _rows_before(plan[q], me) for q in self.sends}
        self.hidden: list[tuple[float, float]] = []  # per forward: (halo seconds, exposed seconds)

    def _shape(self, like: torch.Tensor, rows: tuple[int, int]) -> tuple[int, ...]:
        return _rows_like(like, rows[1] - rows[0], self.dim)

    def _row_bytes(self, like: torch.Tensor) -> int:
        return math.prod(_rows_like(like, 1, self.dim)) * like.element_size()

    def _shm(self, like: torch.Tensor, rows: int):
        """The group's shared-memory reducer when this call can take it (`rows`: the most rows
        any rank writes; not along a line of tiles: its slots are the whole group's), else
        None."""
        shm = self.group.shm
        if shm is None or self.tiled or not shm.fits(like, rows * self._row_bytes(like)):
            return None
        return shm

    def post(self, xs: list[torch.Tensor], call: dict) -> None:
        """Start sending the rows others read and receiving the ones this rank reads: of the
        band, or of a tile's strip (`xs`: its column pieces, joined along the width)."""
        lo, x = self.band[0], xs[0]
        call["t0"] = time.perf_counter()
        call["width"] = sum(t.shape[3] for t in xs) if len(xs) > 1 else None  # a strip's
        pieces = [
            torch.cat([t.narrow(self.dim, a - lo, b - a) for t in xs], dim=3)
            if len(xs) > 1
            else x.narrow(self.dim, a - lo, b - a)
            for _, (a, b) in sorted(self.sends.items())
        ]
        sent = sum(t.numel() * t.element_size() for t in pieces)
        shm = self._shm(x, self.most)
        if shm is not None:
            call["shm"] = (shm, shm.begin(pieces, self.most * self._row_bytes(x)), x)
        else:
            works, bufs = [], {}
            for (q, _), piece in zip(sorted(self.sends.items()), pieces, strict=True):
                works.append(p2p.isend(piece.contiguous(), self.ranks[q], self.group.pg))
            for q, rows in self.receives.items():
                bufs[q] = x.new_empty(_wide(self._shape(x, rows), call["width"]))
                works.append(p2p.irecv(bufs[q], self.ranks[q], self.group.pg))
            call["works"], call["bufs"] = works, bufs
        if self.ledger is not None:
            layers = {self.layer: 1.0}
            call["entry"] = self.ledger.record("halo", self.pr, sent, 0.0, Term.HALO_FWD, layers)

    def arrived(self, call: dict) -> dict[int, torch.Tensor]:
        """Wait for the rows this rank reads: {rank: rows}."""
        if "shm" not in call:
            for w in call["works"]:
                w.wait()
            return call["bufs"]
        shm, posted, x = call["shm"]
        slots = shm.finish(posted, "send the halo rows of")
        row, out = self._row_bytes(x), {}
        for q, rows in self.receives.items():
            off = self.read_at[q] * row
            n = (rows[1] - rows[0]) * row
            out[q] = slots[q][off : off + n].view(x.dtype).view(self._shape(x, rows)).clone()
        return out

    def send_back(self, grads: dict[int, torch.Tensor], call: dict) -> None:
        """Backward: the gradients of the rows received go back to their owners (through shared
        memory they wait for `take_back`, which every rank runs)."""
        faults.at("halo")
        call["t1"] = time.perf_counter()
        call["grads"] = grads
        call["back_bytes"] = sum(g.numel() * g.element_size() for g in grads.values())
        if "shm" not in call:
            ranks = self.ranks
            call["back"] = [p2p.isend(g, ranks[q], self.group.pg) for q, g in grads.items()]

    def take_back(self, gs: list[torch.Tensor], call: dict) -> list[torch.Tensor]:
        """Backward: the gradients other ranks computed for the rows this rank sent them come in
        and are added to its band's (to its strip's pieces, `gs`); once every send back of this
        call has gone."""
        t0 = call.get("t1", time.perf_counter())
        lo, inbound, g = self.band[0], {}, gs[0]
        if "shm" in call:
            shm = call["shm"][0]
            grads = call.get("grads", {})
            pieces = [grads[q] for q in sorted(grads)]
            row = self._row_bytes(g)
            slots = shm.finish(shm.begin(pieces, self.most_back * row), "send halo gradients of")
            for q, rows in self.sends.items():
                off = self.back_at[q] * row
                n = (rows[1] - rows[0]) * row
                inbound[q] = slots[q][off : off + n].view(g.dtype).view(self._shape(g, rows))
        else:
            works = []
            for q, rows in self.sends.items():
                inbound[q] = g.new_empty(_wide(self._shape(g, rows), call["width"]))
                works.append(p2p.irecv(inbound[q], self.ranks[q], self.group.pg))
            for w in [*call.get("back", []), *works]:
                w.wait()
        if inbound:
            gs = [t.clone() for t in gs]
            for q, (a, b) in self.sends.items():
                at = 0
                for t in gs:  # a strip's pieces, side by side along the width
                    part = inbound[q].narrow(3, at, t.shape[3]) if len(gs) > 1 else inbound[q]
                    t.narrow(self.dim, a - lo, b - a).add_(part)
                    at += t.shape[-1]
        if self.ledger is not None:
            took, sent = time.perf_counter() - t0, call.get("back_bytes", 0)
            self.ledger.record("halo", self.pr, sent, took, Term.HALO_BWD, {self.layer: 1.0})
        return gs


def _wide(shape: tuple[int, ...], width: int | None) -> tuple[int, ...]:
    """`shape` with `width` columns (a strip's rows: every piece's); None: as it is."""
    return shape if width is None else (*shape[:3], width)


def _rows_like(like: torch.Tensor, rows: int, dim: int = 2) -> tuple[int, ...]:
    """The shape of `rows` rows (dim 2: the height, or a volume's depth; 3: columns) of `like`."""
    return (*like.shape[:dim], rows, *like.shape[dim + 1 :])


def _rows_before(pieces: dict[int, tuple[int, int]], me: int) -> int:
    """Rows of the pieces {rank: [lo, hi)} of ranks below `me` (a slot's pieces in rank order)."""
    return sum(b - a for q, (a, b) in pieces.items() if q < me)


class _Post(torch.autograd.Function):
    """Forward: start sending this band's rows that other ranks read and receiving the rows it
    reads from them (non-blocking); the band (a tile's strip: its pieces) passes through.
    Backward: the gradients other ranks computed for the rows it sent come in and are added to
    its band's gradient."""

    @staticmethod
    def forward(ctx, exchange, call, *xs):
        exchange.post([x.detach() for x in xs], call)
        ctx.exchange, ctx.call = exchange, call
        ctx.like = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        full = [
            g.contiguous() if g is not None else torch.zeros(s, dtype=d, device=v)
            for g, (s, d, v) in zip(gs, ctx.like, strict=True)
        ]  # a piece no output row read (a padding column the rows' exchange sent)
        grads = ctx.exchange.take_back(full, ctx.call)
        return (
            None,
            None,
            *[g if need else None for g, need in zip(grads, ctx.needs_input_grad[2:], strict=True)],
        )


class _Wait(torch.autograd.Function):
    """Forward: wait for the rows posted by _Post; they come back as the rows above and below
    this rank's band. Backward: their gradients go back to their owners (_Post's backward, which
    runs after this one on every rank, completes the exchange)."""

    @staticmethod
    def forward(ctx, x, exchange, call):
        bufs = exchange.arrived(call)
        ctx.exchange, ctx.call = exchange, call
        below = [bufs[q] for q in sorted(bufs) if q < exchange.me]
        above = [bufs[q] for q in sorted(bufs) if q > exchange.me]
        d = exchange.dim
        empty = x.new_empty(_wide(_rows_like(x, 0, d), call["width"]))
        top = torch.cat(below, dim=d) if below else empty
        bottom = torch.cat(above, dim=d) if above else empty.clone()
        return top, bottom

    @staticmethod
    def backward(ctx, g_top, g_bottom):
        ex: Exchange = ctx.exchange
        grads, at = {}, {"top": 0, "bottom": 0}
        for q in sorted(ex.receives):
            a, b = ex.receives[q]
            side, g = ("top", g_top) if q < ex.me else ("bottom", g_bottom)
            grads[q] = g.narrow(ex.dim, at[side], b - a)
            at[side] += b - a
        ex.send_back(grads, ctx.call)
        return None, None, None


class _Strip:
    """Rows of a tile widened by halo and padding columns, kept as its column pieces (the tile a
    view of what the layer before keeps): what a row exchange and a convolution read of it."""

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        self.pieces = pieces

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.pieces[0].shape
        return (*first[:3], sum(p.shape[3] for p in self.pieces))

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
            a, b = bands(cols.h_out, pw)[j]
            self.cols = (cols.reads(a, b)[0], a, b)
        self.exchange = Exchange(window, group, ledger, layer, line=rows)
        w, (a, b) = window, self.exchange.band
        # the output rows whose window reads only this band (and padding): computed while the
        # halo rows travel
        inside = [
            o
            for o in range(*self.exchange.out)
            if max(w.reads(o, o + 1)[0], 0) >= a and min(w.reads(o, o + 1)[1], w.h_in) <= b
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
        h = (self.exchange if dim == 2 else self.widen).window.h_in
        out = []
        if lo < 0:
            out.append(like.new_full(_rows_like(like, -lo, dim), self.fill))
        for first, t in parts:
            a, b = max(lo, first), min(hi, first + t.shape[dim])
            if a < b:
                out.append(t.narrow(dim, a - first, b - a))
        if hi > h:
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
        parts = [(ex.band[0], x)]
        if ex.needed:
            call: dict = {}
            (x,) = _Post.apply(ex, call, x)
            left, right = _Wait.apply(x, ex, call)
            if "entry" in call:
                call["entry"].seconds = time.perf_counter() - call["t0"]
            parts = [(ex.band[0] - left.shape[3], left), (ex.band[0], x), (ex.band[1], right)]
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
            return self._out([(ex.band[0], x)], o0, o1, x)
        if isinstance(x, _Strip):  # its rows go joined along the width, corners with them
            x = _Strip(list(_Post.apply(ex, call, *x.pieces)))
            like = x.pieces[0]
        else:
            (x,) = _Post.apply(ex, call, x)
            like = x
        own = [(ex.band[0], x)]
        # the interior rows while the halo rows travel, over the network; through shared memory
        # they are there at once, and three pieces (the interior, the rows next to each
        # neighbour, their concatenation, forward and backward) cost more than one call on band
        # and halo (measured in docs/validate.md)
        pieces = i0 < i1 and "shm" not in call
        mid = self._out(own, i0, i1, x) if pieces else None
        t_mid = time.perf_counter()
        top, bottom = _Wait.apply(like, ex, call)
        t_end = time.perf_counter()
        ex.hidden.append((t_end - call["t0"], t_end - t_mid))
        if "entry" in call:
            call["entry"].seconds = t_end - call["t0"]
        parts = [(ex.band[0] - top.shape[2], top), *own, (ex.band[1], bottom)]
        if mid is None:
            return self._out(parts, o0, o1, x)
        pieces = [mid]
        if o0 < i0:
            pieces.insert(0, self._out(parts, o0, i0, x))
        if i1 < o1:
            pieces.append(self._out(parts, i1, o1, x))
        return torch.cat(pieces, dim=2) if len(pieces) > 1 else mid


class DomainConv(_Windowed):
    """F.conv2d (a volume's F.conv3d) on this rank's band of rows (of depth slices), with the
    weight and bias the module's forward hands it (whole on every rank): the height padding
    replaced by the halo and zero rows outside the image."""

    def __init__(self, conv: nn.Module, window: RowMap, group, ledger, layer: str, **tiles):
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self.setup(window, group, ledger, layer, **tiles)
        self.width_padding = (0, 0) if self.cols else (0, *conv.padding[1:])

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None, *args, **kwargs):
        self.weight, self.bias = weight, bias
        try:
            return self.band(x)
        finally:
            self.weight = self.bias = None

    joined = False

    def compute(self, rows: list, lo: int, a: int, b: int) -> torch.Tensor:
        conf = (self.stride, self.width_padding, self.dilation, self.groups)
        if len(rows) == 1 and not isinstance(rows[0], _Strip):  # the band alone (a 1x1
            return _CONV[rows[0].dim()][0](rows[0], self.weight, self.bias, *conf)  # conv)
        layout = tuple(len(r.pieces) if isinstance(r, _Strip) else 1 for r in rows)
        flat = [p for r in rows for p in (r.pieces if isinstance(r, _Strip) else [r])]
        return _ConvOfPieces.apply(self.weight, self.bias, conf, layout, *flat)


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
    if len(first.shape) == 4:
        shape[3] = sum(p.shape[3] for p in rows[0])
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
                    part = gx.narrow(2, r0, p.shape[2])
                    if p.dim() == 4:  # a strip's column piece (else the whole width)
                        part = part.narrow(3, c0, p.shape[3])
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
        width = ((0,), (0,)) if self.cols else (self.padding[1:], self.width_out)
        y = transposed(rows, self.weight, None, self.stride, (0, *width[0]), (0, *width[1]),
                       self.groups, self.dilation)  # fmt: skip
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
        if self.cols is not None:
            return self._along(high, 3, *self.cols)
        n = rows.dim() - 3  # the other dimensions (width; a volume's height and width)
        if self.size is not None:
            rest = self.size[1:] if isinstance(self.size, tuple | list) else (self.size,) * n
            return F.interpolate(high, (b - a, *rest), None, *self.args, **self.kwargs)
        scale = self.scale[1:] if isinstance(self.scale, tuple | list) else (self.scale,) * n
        return F.interpolate(high, None, (1.0, *scale), *self.args, **self.kwargs)


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
        self.width_padding = (0, 0) if self.cols else (0, *tup(pool.padding)[1:])

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


class _SpaceMax(torch.autograd.Function):
    """Forward: each example's maximum per channel over every rank's band (tile): this rank's
    maxima, how often each occurs and where it first occurs in the image (`at`: the image
    index of the band's first element, and (row length, image row length, first column)),
    summed in float64 into a row per rank (an all-gather as an all-reduce). Backward: the
    gradient's sum over the ranks goes to the first maximum in the image's order (`first`: an
    adaptive max pooling's index) or in equal shares to every maximum (amax's ties)."""

    @staticmethod
    def forward(ctx, x, via, first: bool, at: tuple[int, int, int, int]):
        group = via.group
        flat = x.flatten(2)
        top = flat.amax(2)
        hits = flat == top[..., None]
        rows = torch.zeros((group.size, 3, *top.shape), dtype=torch.float64, device=x.device)
        start, width, full, col = at
        local = hits.int().argmax(2)  # the band's first maximum
        rows[group.rank, 0], rows[group.rank, 1] = top, hits.sum(2)
        rows[group.rank, 2] = start + (local // width) * full + col + local % width
        all_reduce(rows, via)
        most = rows[:, 0].amax(0)
        held = rows[:, 0] == most  # (ranks, N, C): the ranks holding a maximum
        if first:  # the first in the image's order
            mine = torch.where(held, rows[:, 2], math.inf).argmin(0) == group.rank
            hits = F.one_hot(local, flat.shape[2]).bool()
            ties = torch.ones_like(most)
        else:
            mine, ties = held[group.rank], (rows[:, 1] * held).sum(0)
        ctx.save_for_backward(hits, mine, ties)
        ctx.shape, ctx.via = x.shape, replace(via, term=Term.BN_GRAD)
        return most.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        hits, mine, ties = ctx.saved_tensors
        total = g.to(torch.float64).contiguous()
        all_reduce(total, ctx.via)
        share = (total * mine / ties).to(g.dtype)
        return (hits * share[..., None]).view(ctx.shape), None, None, None


class _RegionSum(torch.autograd.Function):
    """Forward: each example's sums per channel over k x l regions (`rows` (k, band rows) and
    `cols` (l, the rest of a row): which rows and columns each output cell reads; one region of
    all of them: a global sum), of this rank's band in float64, all-reduced. Backward: the
    gradient's sum over the ranks (each computed its part from its band: its consumers saw its
    band alone) spread back over the regions' rows."""

    @staticmethod
    def forward(ctx, x, rows, cols, via):
        sums = torch.einsum("nchw,kh,lw->nckl", x.to(torch.float64), rows, cols)
        all_reduce(sums, via)
        ctx.save_for_backward(rows, cols)
        ctx.via, ctx.dtype = replace(via, term=Term.BN_GRAD), x.dtype
        return sums.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        rows, cols = ctx.saved_tensors
        total = g.to(torch.float64).contiguous()
        all_reduce(total, ctx.via)
        return torch.einsum("nckl,kh,lw->nchw", total, rows, cols).to(ctx.dtype), None, None, None


def _regions(n_in: int, n_out: int, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
    """(n_out, hi - lo) float64: 1 where output cell i of an adaptive pooling of n_in to n_out
    (torch's regions: floor(i n_in / n_out) .. ceil((i + 1) n_in / n_out) - 1) reads row lo + j."""
    i = torch.arange(n_out, device=like.device)
    start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
    j = torch.arange(lo, hi, device=like.device)
    return ((j >= start[:, None]) & (j < end[:, None])).to(torch.float64)


class SpaceReduction:
    """What the domain style swaps in for a global pooling of a band (core.rows.global_pool:
    AdaptiveAvgPool2d(1), AdaptiveMaxPool2d(1), a mean, sum or amax over height and width, an
    AdaptiveAvgPool2d((k, l))): the value of the whole image, on every rank of the model group,
    in the shape the call returns."""

    def __init__(self, pool: tuple, adaptive: bool, group: Group, ledger: Ledger | None, layer,
                 pw: int = 1):  # fmt: skip
        self.how, self.rows, self.cells, self.rest = pool.how, pool.rows, pool.cells, pool.rest
        self.adaptive = adaptive  # keeps the dims (else the call's keepdim says)
        self.via = Via(group, ledger, Term.BN_STATS, layer)
        i, j = divmod(group.rank, pw)  # on tiles (pw columns of them): a tile's columns
        self.band = bands(self.rows, group.size // pw)[i]
        self.span = bands(self.rest, pw)[j] if pw > 1 else None

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        """Each example's sums (averages: `how` avg) per channel over the k x m cells of an
        adaptive average pooling, or over the whole image or volume (one cell): the regions'
        sums over the bands, (N, C, k, m)."""
        k, m = self.cells if math.prod(self.cells) > 1 else (1, 1)
        # a volume's depth slices as rows of H x W (sized: a batch group may hold no example)
        flat = x.reshape(*x.shape[:3], math.prod(x.shape[3:]))
        span = self.span or (0, self.rest)
        rows, cols = _regions(self.rows, k, *self.band, x), _regions(self.rest, m, *span, x)
        y = _RegionSum.apply(flat, rows, cols, self.via)
        if self.how != "avg":
            return y
        tall = _regions(self.rows, k, 0, self.rows, x).sum(1)
        wide = _regions(self.rest, m, 0, self.rest, x).sum(1)
        return y / (tall[:, None] * wide[None, :]).to(x.dtype)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if math.prod(self.cells) > 1:
            return self._sums(x)
        if self.how in ("max", "first"):
            first, width = self.span or (0, self.rest)
            at = (self.band[0] * self.rest, width - first, self.rest, first)
            y = _SpaceMax.apply(x, self.via, self.how == "first", at)
        else:
            y = self._sums(x).flatten(2).squeeze(2)
        keep = self.adaptive or kwargs.get("keepdim", args[1] if len(args) > 1 else False)
        return y.view(*y.shape, *[1] * (x.dim() - 2)) if keep else y


def _sizes(shape: tuple[int, ...], pr: int, pw: int) -> tuple[list, Pieces]:
    """Every rank's band (tile) of activations of spatial `shape` over Pr ranks with `pw` tile
    columns, and how they lie on the wire: the rows along dim 2, or the tiles flattened."""
    boxes = [tile(shape, pr, pw, r) for r in range(pr)]
    if pw == 1:
        return boxes, Pieces(tuple(b - a for a, b in boxes), 2)
    return boxes, Pieces(tuple((b - a) * (d - c) for (a, b), (c, d) in boxes), 2)


def join(x: torch.Tensor, shape: tuple[int, ...], pr: int, pw: int, via: Via) -> torch.Tensor:
    """The whole activation from every rank's band (tile): one all-gather over the model group
    (backward: this rank's part of the gradient)."""
    boxes, pieces = _sizes(shape, pr, pw)
    if pw == 1:
        return gather(x, pieces, via)
    parts = gather(x.flatten(2), pieces, via).split(list(pieces.sizes), 2)
    flat = [
        t.unflatten(2, (b - a, d - c)) for t, ((a, b), (c, d)) in zip(parts, boxes, strict=True)
    ]
    return torch.cat([torch.cat(flat[i : i + pw], 3) for i in range(0, pr, pw)], 2)


def cut(x: torch.Tensor, pr: int, pw: int, via: Via) -> torch.Tensor:
    """This rank's band (tile) of the whole activation (backward: the parts' all-gather)."""
    boxes, pieces = _sizes(tuple(x.shape[2:]), pr, pw)
    if pw == 1:
        return split(x, pieces, via)
    flat = torch.cat([x[:, :, a:b, c:d].flatten(2) for (a, b), (c, d) in boxes], 2)
    (a, b), (c, d) = boxes[via.group.rank]
    return split(flat, pieces, via).unflatten(2, (b - a, d - c))


class _Rows:
    """Forward pre-hook between the domain layout and the replicated layout of the same grid:
    keep this rank's band or tile (`into`; backward: all-gather the bands' gradients) or
    all-gather them (out of it; backward: keep this rank's part)."""

    def __init__(self, style: Style, m: Move, into: bool) -> None:
        self.group = m.grids.grid(style.pc).model_group
        self.pr, self.pw, self.m, self.into = style.pr, style.pw, m, into

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        faults.at("handoff")
        x, *rest = args
        fed = self.m.fed
        if self.into and fed is not None and tuple(x.shape[2:]) != tuple(fed):
            mine = tile(fed, self.pr, self.pw, self.group.rank)
            spans = mine if self.pw > 1 else (mine,)
            if tuple(x.shape[2 : 2 + len(spans)]) != tuple(b - a for a, b in spans):
                what = " and columns ".join(f"{a}..{b - 1}" for a, b in spans)
                raise ValueError(
                    f"this rank feeds rows {what} of the images (model.input_band()) or the "
                    f"whole {' x '.join(map(str, fed))}; got {' x '.join(map(str, x.shape[2:]))}"
                )
            return args  # fed its band alone
        m = self.m
        via = Via(self.group, m.ledger, Term.REDISTRIBUTE, m.layer, m.codec)
        if self.into:
            return (cut(x, self.pr, self.pw, via), *rest)
        shape = m.size if self.pw > 1 else (m.size[0],)
        return (join(x, shape, self.pr, self.pw, via), *rest)


class _Transpose:
    """Forward pre-hook between pure batch (Pc = P) and the domain layout: one all-to-all within
    the model group (examples -> bands, or back)."""

    def __init__(self, style: Style, m: Move, into: bool) -> None:
        grid = m.grids.grid(style.pc)
        self.group, self.grid, self.pr, self.m, self.into = (
            grid.model_group,
            grid,
            style.pr,
            m,
            into,
        )

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        faults.at("handoff")
        x, *rest = args
        first = self.grid.c * self.pr  # the examples of each rank in pure batch
        examples = Pieces(tuple(self.m.rows.sizes[first : first + self.pr]), 0)
        h = x.shape[2] if self.into else self.m.size[0]
        rows = Pieces(tuple(b - a for a, b in bands(h, self.pr)), 2)
        send, recv = (rows, examples) if self.into else (examples, rows)
        via = Via(self.group, self.m.ledger, Term.REDISTRIBUTE, self.m.layer)
        return (transpose(x, send, recv, via), *rest)


def into_domain(src: Style, dst: Style, m: Move):
    """Into the domain layout: from its own grid's layout keep a band; from pure batch one
    all-to-all; otherwise through its own grid's replicated layout."""
    if src.layout[0] == "dom":
        out = out_of_domain(src, Style.model(src.pr, src.pc), m)
        return Chain(out, into_domain(Style.model(src.pr, src.pc), dst, m))
    if src.pc == dst.pc:
        return _Rows(dst, m, into=True)
    if src.pc == dst.procs and dst.pw == 1:
        return _Transpose(dst, m, into=True)
    return Chain(replicated(src, Style.model(dst.pr, dst.pc), m), _Rows(dst, m, into=True))


class _Whole:
    """Forward pre-hook out of the domain layout for a global pooling's value (whole on every
    rank of the model group): no rows to gather; its gradient becomes one rank's part."""

    def __init__(self, src: Style, m: Move) -> None:
        self.group = m.grids.grid(src.pc).model_group

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (one_part(x, self.group.rank == 0), *rest)


def out_of_domain(src: Style, dst: Style, m: Move):
    """Out of the domain layout, the same ways back; a whole value (a global pooling's) through
    its own grid's replicated layout, which it is already in."""
    if m.whole:
        return Chain(_Whole(src, m), replicated(Style.model(src.pr, src.pc), dst, m))
    if dst.pc == src.pc:
        return _Rows(src, m, into=False)
    if dst.pc == src.procs and src.pw == 1:
        return _Transpose(src, m, into=False)
    return Chain(_Rows(src, m, into=False), replicated(Style.model(src.pr, src.pc), dst, m))


MOVES = {("rep", "dom"): into_domain, ("dom", "rep"): out_of_domain, ("dom", "dom"): into_domain}


_STAND_INS = (
    (nn.Conv2d | nn.Conv3d, DomainConv),
    (nn.ConvTranspose2d | nn.ConvTranspose3d, DomainTransposed),
    (nn.Upsample, DomainResample),
    (nn.Module, DomainPool),
)


class DomainStyle(ParallelStyle):
    """domain(Pr x Pc): a segment's convolutions and poolings on bands of rows with halos, its
    other layers on the bands as they are; parameters whole on every rank."""

    kind = "domain"

    def shard(self, name: str, module: nn.Module, layer: CostLayer) -> nn.Module:
        windows = {w.member: w for w in layer.windows}
        group, ledger = self.grid.model_group, self.ctx.ledger
        pool = next((p for p in layer.pools if p.member == name), None)
        if name in layer.unchanged or (self.spec.pr == 1 and pool):
            return module  # a whole value's, or over a band's channels: unchanged
        pw = self.spec.pw
        if pool:
            stand_in = SpaceReduction(pool, True, group, ledger, layer.name, pw)
            ops.install(module, stand_in, name=name)
            return module
        if isinstance(module, _InstanceNorm | nn.GroupNorm) and self.spec.pr > 1:
            stats = BandStatistics(module, group, ledger, layer.name, self.grid.batch_group)
            ops.install(module, stats, name=name)
            return module
        if name not in windows:
            return module
        cls = next(c for t, c in _STAND_INS if isinstance(module, t))
        stand_in = cls(
            module, windows[name].row_map(), group, ledger, layer.name, **self._tiles(name, layer)
        )
        ops.install(module, stand_in, name=name)
        return module

    def site(self, name: str, owner: nn.Module, layer: CostLayer) -> None:
        """An F.interpolate or a global pooling in a module's own forward (core.ops.install_site)."""
        windows = {w.member: w for w in layer.windows}
        pool = next((p for p in layer.pools if p.member == name), None)
        _, func, k = ops.site_func(name)
        group, ledger = self.grid.model_group, self.ctx.ledger
        if name in windows:
            tiles = self._tiles(name, layer)
            stand_in = DomainResample(
                owner, windows[name].row_map(), group, ledger, layer.name, **tiles
            )
            ops.install_site(owner, func, k, stand_in)
        elif pool and self.spec.pr > 1:
            adaptive = func.__name__.startswith("adaptive")
            reduction = SpaceReduction(pool, adaptive, group, ledger, layer.name, self.spec.pw)
            ops.install_site(owner, func, k, reduction)

    def _tiles(self, name: str, layer: CostLayer) -> dict:
        """On tiles: the column map of `name`'s window and the tile columns."""
        if self.spec.pw == 1:
            return {}
        cols = next(w for w in layer.cols if w.member == name)
        return {"cols": cols.row_map(), "pw": self.spec.pw}

    @property
    def grad_group(self) -> Group:
        """Every rank holds the whole parameters: their gradients are summed over all P."""
        return self.ctx.grids.grid(self.ctx.grids.world_size).batch_group

    @property
    def grad_key(self) -> tuple:
        return ("batch", self.ctx.grids.world_size)

    def bn_group(self) -> Group:
        """Every rank holds other rows or other examples: statistics over all P."""
        return self.ctx.grids.twin_group(self.ctx.grids.world_size, "bn", shm=True)

    @property
    def replicated(self) -> bool:
        return False
