"""The halo transport of the domain style: which rows a rank sends and receives for one window
(`Exchange`, from core.halo's row maps), and the autograd pair that moves them (`_Post` posts the
sends and receives forward and completes the gradients' return backward; `_Wait` waits for the
rows forward and sends their gradients back). Point to point, or through the group's shared
memory on one host."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from hybridpar.core import faults
from hybridpar.core.halo import RowMap
from hybridpar.core.terms import Term
from hybridpar.runtime.comm import p2p
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger


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
        part = window.parts(pr)[me]
        self.band, self.out = part.held, part.out
        plan = window.plan(pr)  # every rank's pieces, in row order
        # what this rank receives, in row order; by sender; and its own rows from across an edge
        self.pieces = [p for p in plan[me] if p.rank != me]
        self.selfs = [p for p in plan[me] if p.rank == me]
        self.receives: dict[int, list] = {}  # by sender, in row order
        for p in self.pieces:
            self.receives.setdefault(p.rank, []).append(p)
        sends = ((r, [p for p in plan[r] if p.rank == me]) for r in range(pr) if r != me)
        self.sends = {r: ps for r, ps in sends if ps}  # by receiver, in row order
        self.needed = any(p.rank != r for r in range(pr) for p in plan[r])  # else nothing moves
        # through shared memory each rank's slot holds its pieces by receiver in rank order
        # (forward: the rows it sends; backward: the gradients of the rows it got, by sender):
        # the most rows a slot holds, and where this rank's piece starts in another's
        sent = [{r: _rows(plan[r], q) for r in range(pr) if r != q} for q in range(pr)]
        got = [{q: _rows(plan[r], q) for q in range(pr) if q != r} for r in range(pr)]
        self.most = max(sum(s.values()) for s in sent)
        self.most_back = max(sum(g.values()) for g in got)
        self.read_at = {q: _before(sent[q], me) for q in self.receives}
        self.back_at = {r: _before(got[r], me) for r in self.sends}
        self.hidden: list[tuple[float, float]] = []  # per forward: (halo seconds, exposed seconds)

    def _shape(self, like: torch.Tensor, rows: int) -> tuple[int, ...]:
        return _rows_like(like, rows, self.dim)

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
            _cat([self._piece(xs, p.lo - lo, p.hi - p.lo) for p in ps], self.dim)
            for _, ps in sorted(self.sends.items())
        ]
        sent = sum(t.numel() * t.element_size() for t in pieces)
        shm = self._shm(x, self.most)
        if shm is not None:
            call["shm"] = (shm, shm.begin(pieces, self.most * self._row_bytes(x)), x)
        else:
            works, bufs = [], {}
            for (q, _), piece in zip(sorted(self.sends.items()), pieces, strict=True):
                works.append(p2p.isend(piece.contiguous(), self.ranks[q], self.group.pg))
            for q, ps in self.receives.items():
                bufs[q] = x.new_empty(_wide(self._shape(x, _rows(ps)), call["width"]))
                works.append(p2p.irecv(bufs[q], self.ranks[q], self.group.pg))
            call["works"], call["bufs"] = works, bufs
        if self.ledger is not None:
            layers = {self.layer: 1.0}
            call["entry"] = self.ledger.record("halo", self.pr, sent, 0.0, Term.HALO_FWD, layers)

    def _piece(self, xs: list[torch.Tensor], start: int, rows: int) -> torch.Tensor:
        """Rows [start, start + rows) of the band (of a strip's pieces, joined along the width)."""
        return _cat([t.narrow(self.dim, start, rows) for t in xs], 3)

    def arrived(self, call: dict) -> list[torch.Tensor]:
        """Wait for the rows this rank reads: one tensor per piece, in row order."""
        if "shm" not in call:
            for w in call["works"]:
                w.wait()
            bufs = call["bufs"]
        else:
            shm, posted, x = call["shm"]
            slots = shm.finish(posted, "send the halo rows of")
            row, bufs = self._row_bytes(x), {}
            for q, ps in self.receives.items():
                off, n = self.read_at[q] * row, _rows(ps) * row
                shape = self._shape(x, _rows(ps))
                bufs[q] = slots[q][off : off + n].view(x.dtype).view(shape).clone()
        at = {q: 0 for q in bufs}
        out = []
        for p in self.pieces:  # each sender's pieces lie in row order in its message
            out.append(bufs[p.rank].narrow(self.dim, at[p.rank], p.hi - p.lo))
            at[p.rank] += p.hi - p.lo
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
            for r, ps in self.sends.items():
                off, n = self.back_at[r] * row, _rows(ps) * row
                inbound[r] = slots[r][off : off + n].view(g.dtype).view(self._shape(g, _rows(ps)))
        else:
            works = []
            for r, ps in self.sends.items():
                inbound[r] = g.new_empty(_wide(self._shape(g, _rows(ps)), call["width"]))
                works.append(p2p.irecv(inbound[r], self.ranks[r], self.group.pg))
            for w in [*call.get("back", []), *works]:
                w.wait()
        if inbound:
            gs = [t.clone() for t in gs]
            for r, ps in self.sends.items():
                first = 0
                for p in ps:  # the receiver's pieces of this band, in row order
                    rows, at = p.hi - p.lo, 0
                    back = inbound[r].narrow(self.dim, first, rows)
                    for t in gs:  # a strip's pieces, side by side along the width
                        part = back.narrow(3, at, t.shape[3]) if len(gs) > 1 else back
                        t.narrow(self.dim, p.lo - lo, rows).add_(part)
                        at += t.shape[3]
                    first += rows
        if self.ledger is not None:
            took, sent = time.perf_counter() - t0, call.get("back_bytes", 0)
            self.ledger.record("halo", self.pr, sent, took, Term.HALO_BWD, {self.layer: 1.0})
        return gs


def _wide(shape: tuple[int, ...], width: int | None) -> tuple[int, ...]:
    """`shape` with `width` columns (a strip's rows: every piece's); None: as it is."""
    return shape if width is None else (*shape[:3], width, *shape[4:])


def _rows_like(like: torch.Tensor, rows: int, dim: int = 2) -> tuple[int, ...]:
    """The shape of `rows` rows (dim 2: the height, or a volume's depth; 3: columns) of `like`."""
    return (*like.shape[:dim], rows, *like.shape[dim + 1 :])


def _rows(pieces, rank: int | None = None) -> int:
    """Rows of the pieces (of rank `rank`'s rows only)."""
    return sum(p.hi - p.lo for p in pieces if rank is None or p.rank == rank)


def _before(rows: dict[int, int], me: int) -> int:
    """Rows of a slot's chunks {rank: rows} of ranks below `me` (a slot's chunks in rank order)."""
    return sum(n for q, n in rows.items() if q < me)


def _cat(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(ts, dim=dim) if len(ts) > 1 else ts[0]


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
    """Forward: wait for the rows posted by _Post; they come back as one tensor per piece the
    band reads (`Exchange.pieces`, in row order: above it, below it, and from across an edge).
    Backward: their gradients go back to their owners (_Post's backward, which runs after this
    one on every rank, completes the exchange)."""

    @staticmethod
    def forward(ctx, x, exchange, call):
        ctx.exchange, ctx.call = exchange, call
        return (*exchange.arrived(call), x.new_empty(0))  # one more: never none

    @staticmethod
    def backward(ctx, *gs):
        ex: Exchange = ctx.exchange
        grads: dict = {}
        for p, g in zip(ex.pieces, gs[:-1], strict=True):  # by sender, in row order
            grads.setdefault(p.rank, []).append(g)
        ex.send_back({q: _cat(g, ex.dim) for q, g in grads.items()}, ctx.call)
        return None, None, None
