"""Logged collectives: every collective hybridpar runs goes through this module (or the host
reducer) so that the ledger sees it. The autograd pairs built on them are
hybridpar.runtime.parallel.mappings (and the batch norm's and the halo's, beside their
arithmetic). With one rank each is a no-op.

With a codec (hybridpar.runtime.comm.codecs) an all-gather sends each rank's encoded piece and every rank,
the owner included, uses the decoded pieces (so the replicas stay identical); an all-reduce
becomes `compressed_all_reduce`. The ledger books the payload (elements x the codec's bytes per
element) under the term, which is what the cost model predicts, and the per-block scales and
padding under the separate term `codec_overhead`.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpar.core.splits import chunk_sizes, even_split
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import Codec, Encoded
from hybridpar.runtime.comm.group import Group, group_rank, group_size, pg_of
from hybridpar.runtime.comm.ledger import Entry, Ledger

__all__ = [
    "CompressedPipeline",
    "Pending",
    "Started",
    "Via",
    "all_gather_sizes",
    "all_gather_uneven",
    "all_reduce",
    "all_to_all_uneven",
    "chunk_sizes",
    "compressed_all_reduce",
    "even_split",
    "flat_all_gather",
    "flat_reduce_scatter",
    "group_size",
    "reduce_scatter_uneven",
    "start_all_gather",
    "start_broadcast",
    "start_reduce",
    "start_reduce_scatter",
]


@dataclass(frozen=True)
class Via:
    """What a collective runs over and how the ledger books it, as one value: the group, the
    ledger (None: not booked), the cost-model term, the layer it carries (or, for a bucket of
    several, each layer's elements in it), and the codec of its payload (None: unencoded)."""

    group: Group | dist.ProcessGroup
    ledger: Ledger | None = None
    term: str = ""
    layer: str | dict[str, float] | None = None
    codec: Codec | None = None

    @property
    def encoded(self) -> bool:
        return self.codec is not None and self.codec.name != "none"

    def book(self, kind: str, p: int, nbytes: float, seconds: float, numel: int) -> Entry | None:
        """Book `nbytes` of the collective's payload under the term, for `numel` elements of the
        layer."""
        if self.ledger is None:
            return None
        return self.ledger.record(kind, p, nbytes, seconds, self.term, self.layers(numel))

    def layers(self, numel: int) -> dict[str, float] | None:
        if isinstance(self.layer, dict) or self.layer is None:
            return self.layer
        return {self.layer: numel}

    def overhead(self, kind: str, p: int, nbytes: float) -> None:
        """Book a codec's scales and padding apart (`codec_overhead`: measured, not predicted)."""
        if self.ledger is not None and nbytes:
            self.ledger.record(kind, p, nbytes, 0.0, Term.CODEC_OVERHEAD)


def labelled(fn):
    """`fn` (a collective taking a `via`) inside a torch.profiler range
    named "hybridpar <collective> <term> <layers>" while a profiler records (`--profile-trace`),
    so a trace shows what each collective carried; a direct call otherwise."""

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.autograd._profiler_enabled():
            return fn(*args, **kwargs)
        with torch.profiler.record_function(_label(fn.__name__, sig.bind(*args, **kwargs))):
            return fn(*args, **kwargs)

    return call


def _label(name: str, bound) -> str:
    via = bound.arguments["via"]
    layers = via.layer if isinstance(via.layer, str) else ",".join(list(via.layer or ())[:3])
    return f"hybridpar {name} {via.term} {layers or ''}".rstrip()


class Pending:
    """An async collective: wait() blocks, then the ledger entry gets its wall time."""

    def __init__(self, work: dist.Work | None, entry: Entry | None, t0: float) -> None:
        self.work, self.entry, self.t0 = work, entry, t0

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.finished()

    def finished(self) -> None:
        """Stamp the wall time; call from the work's future callback (never wait() there)."""
        if self.entry is not None and self.entry.seconds == 0.0:
            self.entry.seconds = time.perf_counter() - self.t0


@labelled
def all_reduce(t: torch.Tensor, via: Via, async_op: bool = False) -> Pending:
    """Sum `t` in place over `via.group`, booked as `via` says."""
    group = via.group
    p = group_size(group)
    t0 = time.perf_counter()
    if p == 1:
        return Pending(None, None, t0)
    small = None if async_op or not isinstance(group, Group) else group.shm
    nbytes = t.numel() * t.element_size()
    if small is not None and small.fits(t):  # shared memory: microseconds instead of milliseconds
        small.small_all_reduce(t)
        # its seconds: the report's time split counts them as communication
        via.book("all_reduce", p, nbytes, time.perf_counter() - t0, t.numel())
        return Pending(None, None, t0)
    work = dist.all_reduce(t, group=pg_of(group), async_op=async_op)
    pending = Pending(work, via.book("all_reduce", p, nbytes, 0.0, t.numel()), t0)
    if not async_op:
        pending.wait()
    return pending


def flat_all_gather(out: torch.Tensor, mine: torch.Tensor, via: Via, async_op: bool = False):
    """`out` (P times `mine`'s elements) := every rank's `mine`, in rank order (torch's
    all_gather_single; FSDP2's parameters: runtime.parallel.sharded)."""
    t0, p = time.perf_counter(), group_size(via.group)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    work = gather(out, mine, group=pg_of(via.group), async_op=async_op)
    via.book("all_gather", p, out.numel() * out.element_size(), time.perf_counter() - t0, 1)
    return work


def flat_reduce_scatter(out: torch.Tensor, whole: torch.Tensor, via: Via, op, async_op=False):
    """`out` := this rank's 1/P of `whole` summed over the group (reduce_scatter_single; FSDP2's
    gradient sums)."""
    t0, p = time.perf_counter(), group_size(via.group)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(out, whole, op=op, group=pg_of(via.group), async_op=async_op)
    via.book("reduce_scatter", p, whole.numel() * whole.element_size(), time.perf_counter() - t0, 1)
    return work


def all_to_all_uneven(x: torch.Tensor, send, recv, via: Via) -> torch.Tensor:
    """Uneven all-to-all: this rank's `x` cut into `send.sizes` along `send.dim`, piece q to rank
    q; what arrives joined along `recv.dim` (`recv.sizes`: each sender's). Flattened on the wire;
    booked as one all-to-all of this rank's whole buffer."""
    t0 = time.perf_counter()
    me, group = via.group.rank, via.group
    pieces = torch.split(x, list(send.sizes), dim=send.dim)
    shapes = []
    for n in recv.sizes:
        shape = list(x.shape)
        shape[send.dim], shape[recv.dim] = send.sizes[me], n
        shapes.append(shape)
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    out = torch.cat([p.reshape(-1) for p in pieces])
    into = out.new_empty(sum(sizes))
    dist.all_to_all_single(into, out, sizes, [p.numel() for p in pieces], group=group.pg)
    nbytes, took = out.numel() * out.element_size(), time.perf_counter() - t0
    via.book("all_to_all", group.size, nbytes, took, 1)
    parts = [part.view(s) for part, s in zip(torch.split(into, sizes), shapes, strict=True)]
    return torch.cat(parts, dim=recv.dim)


def all_gather_sizes(n: int, via: Via, device: torch.device | None = None) -> list[int]:
    """Every rank's `n`, in rank order (one all-gather of an int64 each, on `device`: the one
    the group's backend carries; booked as `via`)."""
    p = group_size(via.group)
    if p == 1:
        return [n]
    t0 = time.perf_counter()
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(p)]
    dist.all_gather(every, mine, group=pg_of(via.group))
    via.book("all_gather", p, 8 * p, time.perf_counter() - t0, 1)
    return [int(t) for t in every]


@labelled
def all_gather_uneven(t: torch.Tensor, sizes: Sequence[int], dim: int, via: Via) -> torch.Tensor:
    """Concatenate along `dim` the pieces of every rank of `group`; piece i has sizes[i] along dim.

    On one host (a group built with shared memory: comm.group) through it; otherwise on
    torch.distributed, uneven pieces padded to the largest for the wire. The ledger records the
    bytes of the real (unpadded) result, the quantity the cost model predicts."""
    p = len(sizes)
    if p == 1:
        return t
    if via.encoded:
        return _compressed_all_gather(t, sizes, dim, via)
    t0 = time.perf_counter()
    top = max(sizes)
    t = t.contiguous()
    group = via.group
    small = group.shm if isinstance(group, Group) else None
    inner = math.prod(
        n for i, n in enumerate(t.shape) if i != dim % t.dim()
    )  # a piece may be empty
    if small is not None and small.fits(t, top * inner * t.element_size()):  # alike on every rank
        out = small.all_gather(t, list(sizes), dim)  # shared memory: one copy in, one out
    else:
        out = _gloo_all_gather(t, sizes, dim, group, top)
    seconds = time.perf_counter() - t0
    via.book("all_gather", p, out.numel() * out.element_size(), seconds, out.numel())
    return out


@labelled
def reduce_scatter_uneven(
    t: torch.Tensor, sizes: Sequence[int], dim: int, via: Via
) -> torch.Tensor:
    """The sum of `t` over `group`, of which this rank keeps its piece along `dim` (rank i's has
    sizes[i]): the reverse of all_gather_uneven. The ledger books the whole tensor's bytes, as the
    cost model's reduce_scatter takes them."""
    return start_reduce_scatter(t, sizes, dim, via).wait()


class Started:
    """A collective in flight (split phase): `wait()` finishes it and returns its result. On one
    host through shared memory (comm.small's begin/finish: the group must carry nothing else in
    between), else an asynchronous torch.distributed call. The ledger entry is booked at the start;
    its seconds are the time this rank spent in the collective, starting it and waiting for it:
    the part the work between the two did not hide (exposed communication)."""

    def __init__(self, finish, entry: Entry | None, t0: float, label: str = "") -> None:
        self._finish, self.entry, self.label = finish, entry, label
        self.seconds = time.perf_counter() - t0  # starting it

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(f"hybridpar wait {self.label}".rstrip()):
                out = self._finish()
        else:
            out = self._finish()
        self.seconds += time.perf_counter() - t0
        if self.entry is not None:
            self.entry.seconds = self.seconds
        return out


def _started(kind: str, p: int, nbytes: float, via: Via, numel: int, finish, t0) -> Started:
    entry = via.book(kind, p, nbytes, 0.0, numel)
    return Started(finish, entry, t0, f"{kind} {via.term} {via.layer or ''}".rstrip())


def _small(group, t: torch.Tensor, nbytes: int):
    small = group.shm if isinstance(group, Group) else None
    return small if small is not None and small.fits(t, nbytes) else None


def _padded(t: torch.Tensor, dim: int, top: int) -> torch.Tensor:
    if t.shape[dim] == top:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(_shape_with(t, dim, top - t.shape[dim]))], dim=dim)


@labelled
def start_all_gather(t: torch.Tensor, sizes: Sequence[int], dim: int, via: Via) -> Started:
    """all_gather_uneven, split phase (with a codec: each rank's piece encoded, every piece
    decoded on arrival, as all_gather_uneven does)."""
    if via.encoded:
        return _start_compressed_all_gather(t, sizes, dim, via)
    t0 = time.perf_counter()
    t, sizes, group = t.contiguous(), list(sizes), via.group
    out_shape = _shape_with(t, dim, sum(sizes))
    numel = math.prod(out_shape)
    nbytes = numel * t.element_size()
    top = max(sizes)
    inner = math.prod(n for i, n in enumerate(t.shape) if i != dim % t.dim())
    small = _small(group, t, top * inner * t.element_size())
    if small is not None:
        posted = small.begin([t.view(-1)], top * inner * t.element_size())

        def finish() -> torch.Tensor:
            slots = small.finish(posted, "join an all-gather on")
            return torch.cat(small.pieces(slots, t, sizes, dim), dim=dim)

    else:
        mine = _padded(t, dim, top)
        pieces = [torch.empty_like(mine) for _ in sizes]
        work = dist.all_gather(pieces, mine, group=pg_of(group), async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            return torch.cat([x.narrow(dim, 0, n) for x, n in zip(pieces, sizes, strict=True)], dim)

    return _started("all_gather", len(sizes), nbytes, via, numel, finish, t0)


def _start_compressed_all_gather(t, sizes, dim, via: Via) -> Started:
    t0, codec = time.perf_counter(), via.codec
    t = t.contiguous()
    inner = math.prod(n for i, n in enumerate(t.shape) if i != dim % t.dim())
    numels = [n * inner for n in sizes]
    lengths = [codec.wire_bytes(n) for n in numels]
    top = max(lengths)
    mine = torch.zeros(1, top, dtype=torch.uint8, device=t.device)
    encoded = codec.to_bytes(codec.encode(t))
    mine[0, : encoded.numel()] = encoded
    wire = start_all_gather(mine, [1] * len(sizes), 0, Via(via.group, term=via.term))

    def finish() -> torch.Tensor:
        got = wire.wait()
        parts = [
            codec.decode(codec.from_bytes(got[i, :n], k)).view(_shape_with(t, dim, s))
            for i, (n, k, s) in enumerate(zip(lengths, numels, sizes, strict=True))
        ]
        return torch.cat(parts, dim=dim).to(t.dtype)

    numel = sum(numels)
    payload = numel * codec.bits / 8
    started = _started("all_gather", len(sizes), payload, via, numel, finish, t0)
    via.overhead("all_gather", len(sizes), len(sizes) * top - payload)
    return started


@labelled
def start_reduce_scatter(t: torch.Tensor, sizes: Sequence[int], dim: int, via: Via) -> Started:
    """reduce_scatter_uneven, split phase."""
    t0 = time.perf_counter()
    t, sizes, group = t.contiguous(), list(sizes), via.group
    p, me = len(sizes), group_rank(group)
    nbytes = t.numel() * t.element_size()
    small = _small(group, t, nbytes)
    if small is not None:
        posted = small.begin([t.view(-1)], nbytes)

        def finish() -> torch.Tensor:
            return small.my_sum(small.finish(posted, "join a reduce-scatter on"), t, sizes, dim)

    else:
        top = max(sizes)
        starts = [sum(sizes[:i]) for i in range(p)]
        ins = [_padded(t.narrow(dim, a, n), dim, top) for a, n in zip(starts, sizes, strict=True)]
        out = torch.empty_like(ins[0])
        work = dist.reduce_scatter(out, ins, group=pg_of(group), async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            return out.narrow(dim, 0, sizes[me])

    return _started("reduce_scatter", p, nbytes, via, t.numel(), finish, t0)


@labelled
def start_broadcast(t: torch.Tensor, root: int, via: Via) -> Started:
    """`t` of the group's rank `root` onto every rank (t: the root's tensor, or a buffer of its
    shape elsewhere), asynchronous on torch.distributed."""
    return _rooted("broadcast", t.contiguous(), root, via)


@labelled
def start_reduce(t: torch.Tensor, root: int, via: Via) -> Started:
    """The sum of `t` over the group onto its rank `root` (elsewhere the result is undefined),
    asynchronous on torch.distributed."""
    return _rooted("reduce", t.contiguous().clone(), root, via)


def _rooted(kind: str, buf, root: int, via: Via) -> Started:
    """A broadcast from, or a reduce onto, the group's rank `root`, in place in `buf`."""
    t0 = time.perf_counter()
    pg = pg_of(via.group)
    at = dist.get_global_rank(pg, root)
    if kind == "broadcast":
        work = dist.broadcast(buf, src=at, group=pg, async_op=True)
    else:
        work = dist.reduce(buf, dst=at, group=pg, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return buf

    n = buf.numel()
    return _started(kind, group_size(via.group), n * buf.element_size(), via, n, finish, t0)


def _gloo_all_gather(
    t: torch.Tensor, sizes: Sequence[int], dim: int, group: Group | dist.ProcessGroup, top: int
) -> torch.Tensor:
    """all_gather_uneven on torch.distributed: pieces padded to the largest for the wire."""
    if t.shape[dim] < top:
        pad_shape = list(t.shape)
        pad_shape[dim] = top - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    pieces = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(pieces, t, group=pg_of(group))
    return torch.cat([x.narrow(dim, 0, n) for x, n in zip(pieces, sizes, strict=True)], dim=dim)


def _shape_with(t: torch.Tensor, dim: int, n: int) -> list[int]:
    shape = list(t.shape)
    shape[dim] = n
    return shape


def _gather_bytes(
    mine: torch.Tensor, lengths: Sequence[int], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """All-gather byte buffers of the given lengths (padded to the longest on the wire)."""
    top = max(lengths)
    buf = torch.zeros(top, dtype=torch.uint8, device=mine.device)
    buf[: mine.numel()] = mine
    pieces = [torch.empty_like(buf) for _ in lengths]
    dist.all_gather(pieces, buf, group=pg_of(group))
    return [x[:n] for x, n in zip(pieces, lengths, strict=True)]


def _book(
    ledger: Ledger | None,
    kind: str,
    p: int,
    payload: float,
    overhead: float,
    seconds: float,
    term: str,
    layers: dict[str, float] | None,
) -> None:
    if ledger is None:
        return
    ledger.record(kind, p, payload, seconds, term, layers)
    if overhead:
        ledger.record(kind, p, overhead, 0.0, Term.CODEC_OVERHEAD)


def _compressed_all_gather(t, sizes, dim, via: Via) -> torch.Tensor:
    t0, codec = time.perf_counter(), via.codec
    t = t.contiguous()
    inner = math.prod(
        n for i, n in enumerate(t.shape) if i != dim % t.dim()
    )  # a piece may be empty
    numels = [n * inner for n in sizes]
    lengths = [codec.wire_bytes(n) for n in numels]
    mine = codec.to_bytes(codec.encode(t))
    got = _gather_bytes(mine, lengths, via.group)
    parts = [
        codec.decode(codec.from_bytes(b, n)).view(_shape_with(t, dim, k))
        for b, n, k in zip(got, numels, sizes, strict=True)
    ]
    out = torch.cat(parts, dim=dim).to(t.dtype)
    payload = out.numel() * codec.bits / 8
    via.book("all_gather", len(sizes), payload, time.perf_counter() - t0, out.numel())
    via.overhead("all_gather", len(sizes), len(sizes) * max(lengths) - payload)
    return out


@labelled
def compressed_all_reduce(
    t: torch.Tensor, via: Via, residuals: dict | None = None, key: object = None
) -> torch.Tensor:
    """Sum `t` over `via.group` in place, with every byte on the wire encoded by `via.codec`.

    Krizhevsky's section 4.1 scheme: each rank owns 1/p of the tensor. Every rank encodes the
    chunks it does not own and sends them to their owners in one all-to-all; the owner decodes
    them, adds them to its own chunk in float32, encodes the sum once and sends it to every other
    rank; every rank (the owner too) decodes all the chunks, so all end up with the same tensor.
    Wire bytes per element: about 2 (p-1)/p x the codec's size, against 8 (p-1)/p for a float32
    ring all-reduce. This is a `CompressedPipeline` of one piece: two all-to-alls.

    Error feedback (as in 1-bit SGD): with a `residuals` dict, what the encoding lost this time
    (of the chunks sent, and of the owned sum) is kept under `key` and added back next time.
    """
    if group_size(via.group) == 1:
        return t
    # one-shot pipelines end flushed, so they can all use this thread's "once" buffers
    pipe = CompressedPipeline(via.group, via.codec, via.ledger, via.term, residuals, buffers="once")
    pipe.push(t, via.layers(t.numel()), key)
    pipe.flush()
    return t


class _Piece:
    """One tensor's compressed reduction in flight: its chunks' frames are encoded when it is
    sent, its owned chunk summed when they arrive, and the sums decoded into it at the end."""

    def __init__(self, pipe: CompressedPipeline, t: torch.Tensor, layers, key, on_done) -> None:
        self.layers, self.on_done = layers, on_done
        self.t0 = time.perf_counter()
        p, me, codec = pipe.p, pipe.me, pipe.codec
        self.flat = t.view(-1)
        n = self.flat.numel()
        self.sizes = even_split(n, p)
        self.offs = [sum(self.sizes[:j]) for j in range(p)]
        self.frames = [_frame_bytes(codec, k) for k in self.sizes]
        self.x = self.flat.float()  # flat itself when it is float32
        self.res = None
        if pipe.residuals is not None:
            res = pipe.residuals.get(key)
            if res is None or res[0].numel() != n:
                res = (
                    torch.zeros_like(self.x),
                    torch.zeros(self.sizes[me], dtype=torch.float32, device=self.x.device),
                )
                pipe.residuals[key] = res
            self.res = res
            self.x = self.x + res[0]
        self.chunk = lambda j: slice(self.offs[j], self.offs[j] + self.sizes[j])
        self.slot, self.returning = 0, False
        self.recv: torch.Tensor | None = None
        self.work = None

    def encode_chunk(self, codec: Codec, j: int, out: torch.Tensor) -> None:
        """Chunk j (owned by rank j) into the frame `out`; its loss into the residual."""
        piece = self.x[self.chunk(j)]
        enc = _encode_into(codec, piece, _frame(codec, out, self.sizes[j]))
        if self.res is not None:
            lost = self.res[0][self.chunk(j)]
            torch.sub(piece, codec.decode(enc, out=lost).view(-1), out=lost)

    def owner_sum(self, codec: Codec, me: int, received: list[torch.Tensor], out: torch.Tensor):
        """Sum the owned chunk and the frames received for it; encode the sum into `out`."""
        acc = self.x[self.chunk(me)]  # x is not read again: sum into it, unless it is t itself
        if self.res is not None and self.x.data_ptr() == self.flat.data_ptr():
            acc = acc.clone()
        for frame in received:
            codec.decode_add(_frame(codec, frame, self.sizes[me]), acc)
        if self.res is not None:
            acc += self.res[1]
        enc = _encode_into(codec, acc, _frame(codec, out, self.sizes[me]))
        if self.res is not None:
            torch.sub(acc, codec.decode(enc, out=self.res[1]).view(-1), out=self.res[1])

    def finish(self, pipe: CompressedPipeline, sums: list[torch.Tensor]) -> None:
        """Decode every rank's summed chunk (frame j from rank j) into t; book the bytes."""
        codec, p = pipe.codec, pipe.p
        dst = self.flat if self.flat.dtype == torch.float32 else self.x
        for j in range(p):
            codec.decode(_frame(codec, sums[j], self.sizes[j]), out=dst[self.chunk(j)])
        if dst is not self.flat:
            self.flat.copy_(dst)
        payload = self.flat.numel() * codec.bits / 8
        frames, seconds = sum(self.frames), time.perf_counter() - self.t0
        layers, term = self.layers, pipe.term
        _book(pipe.ledger, "all_to_all", p, payload, frames - payload, seconds, term, layers)
        _book(pipe.ledger, "all_gather", p, payload, frames - payload, 0.0, term, layers)
        if self.on_done is not None:
            self.on_done()


class CompressedPipeline:
    """compressed_all_reduce over a stream of tensors (a reducer thread's bucket pieces), with
    the collectives of consecutive pieces in flight together: the all-to-all that carries piece
    k's chunks to their owners and the one that carries piece k-1's sums back run at the same
    time, while this thread encodes, sums and decodes. So the link is not idle during the codec
    work, and where a collective costs milliseconds of latency (ranks outnumbering the cores)
    two latencies overlap.

    `push(t)` encodes t's chunks and starts sending them; it then finishes what earlier pushes
    started: the previous piece's owned chunk is summed and its sum sent back, and the piece
    before that decoded into its tensor. `flush()` finishes everything. A pushed tensor holds
    its sum once the push two after it, or a flush, returns (`on_done` says when). Every rank
    must push the same sequence and flush at the same points (the hooks flush after a step's last
    bucket): the collectives are then started in the same order everywhere (gloo keeps
    concurrent collectives of one group apart by sequence number). Bytes and sums are those of
    compressed_all_reduce, bit for bit.
    """

    SLOTS = 3  # pieces whose buffers may be in use at once: sending, returning, being created

    def __init__(
        self,
        group: Group | dist.ProcessGroup,
        codec: Codec,
        ledger: Ledger | None,
        term: str,
        residuals: dict | None = None,
        buffers: object = None,
    ) -> None:
        self.group, self.codec, self.ledger, self.term = pg_of(group), codec, ledger, term
        self.residuals = residuals
        # whose byte buffers (per thread, `_scratch`): its own unless the caller says otherwise, so
        # two pipelines on one thread (two groups' reducers on one worker) never share buffers
        # that a collective in flight still reads
        self.buffers = buffers if buffers is not None else id(self)
        self.p, self.me = group_size(group), dist.get_rank(self.group)
        self.live: list[_Piece] = []
        self.count = 0

    def push(self, t: torch.Tensor, layers=None, key: object = None, on_done=None) -> None:
        """`on_done()` is called (on this thread) once t holds its sum."""
        piece = _Piece(self, t, layers, key, on_done)
        piece.slot, self.count = self.count % self.SLOTS, self.count + 1
        self._guarded(lambda: (self._scatter(piece), self._advance(keep=1)))

    def flush(self) -> None:
        self._guarded(lambda: self._advance(keep=0))

    def _guarded(self, fn) -> None:
        try:
            fn()
        except BaseException:
            self.live.clear()  # nothing half-done carries over into the next call
            raise

    def _buf(self, piece: _Piece, name: str, nbytes: int) -> torch.Tensor:
        return _scratch((self.buffers, name, piece.slot), nbytes, piece.x.device)

    def _scatter(self, piece: _Piece) -> None:
        """Encode the chunks other ranks own into one frame each and start sending them."""
        p, me, f = self.p, self.me, piece.frames
        send_len = [0 if j == me else f[j] for j in range(p)]
        recv_len = [0 if j == me else f[me] for j in range(p)]
        send = self._buf(piece, "send", sum(send_len))
        pos = 0
        for j in range(p):
            if j != me:
                piece.encode_chunk(self.codec, j, send[pos : pos + f[j]])
                pos += f[j]
        piece.recv = self._buf(piece, "recv", sum(recv_len))
        piece.work = dist.all_to_all_single(
            piece.recv, send, recv_len, send_len, group=self.group, async_op=True
        )
        self.live.append(piece)

    def _give_back(self, piece: _Piece) -> None:
        """Sum the owned chunk and start sending the encoded sum to every other rank."""
        p, me, f = self.p, self.me, piece.frames
        piece.work.wait()
        k = f[me]
        received = [piece.recv[i * k : (i + 1) * k] for i in range(p - 1)]
        send = self._buf(piece, "back", (p - 1) * k)
        piece.owner_sum(self.codec, me, received, send[:k])
        for i in range(1, p - 1):
            send[i * k : (i + 1) * k].copy_(send[:k])
        send_len = [0 if j == me else k for j in range(p)]
        recv_len = [0 if j == me else f[j] for j in range(p)]
        piece.recv = self._buf(piece, "sums", sum(recv_len))
        piece.work = dist.all_to_all_single(
            piece.recv, send, recv_len, send_len, group=self.group, async_op=True
        )
        piece.returning = True

    def _finish(self, piece: _Piece) -> None:
        piece.work.wait()
        sums, pos = [], 0
        for j in range(self.p):
            if j == self.me:
                sums.append(self._buf(piece, "back", piece.frames[j]))
            else:
                sums.append(piece.recv[pos : pos + piece.frames[j]])
                pos += piece.frames[j]
        piece.finish(self, sums)

    def _advance(self, keep: int) -> None:
        """Send back the sums of every piece but the newest `keep`, then decode every piece
        whose sums are on their way, but the newest `keep` of those."""
        for piece in self.live[: len(self.live) - keep]:
            if not piece.returning:
                self._give_back(piece)
        returning = [q for q in self.live if q.returning]
        for piece in returning[: len(returning) - keep]:
            self._finish(piece)
            self.live.remove(piece)


def _frame_bytes(codec: Codec, numel: int) -> int:
    """Bytes of one chunk on compressed_all_reduce's wire: its scales, then its payload, padded to
    4 bytes so that the next frame's scales stay aligned."""
    return 4 * codec.blocks(numel) + -(-numel * codec.bits // 8 // 4) * 4


def _frame(codec: Codec, buf: torch.Tensor, numel: int) -> Encoded:
    """The Encoded whose scales and payload are views of the frame `buf`."""
    sb, nb = 4 * codec.blocks(numel), numel * codec.bits // 8
    if codec.eight_bit:
        return Encoded(codec.name, buf[sb : sb + nb], buf[:sb].view(torch.float32), (numel,))
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(codec.name, torch.float32)
    return Encoded(codec.name, buf[:nb].view(dt), None, (numel,))


def _encode_into(codec: Codec, x: torch.Tensor, frame: Encoded) -> Encoded:
    """Encode x into the frame's views (copied there when the codec could not write in place)."""
    e = codec.encode(x, out=frame)
    if e.payload.numel() and e.payload.data_ptr() != frame.payload.data_ptr():
        frame.payload.copy_(e.payload.view(-1))
    if e.scales is not None and e.scales.numel() and e.scales.data_ptr() != frame.scales.data_ptr():
        frame.scales.copy_(e.scales)
    return frame


_SCRATCH = threading.local()


def _scratch(name: object, nbytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer of `nbytes`, kept per thread, name and device and reused across calls (fresh
    pages on every call would each cost a page fault); valid until this thread's next call."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    buf = bufs.get((name, device))
    if buf is None or buf.numel() < nbytes:
        buf = bufs[(name, device)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]
