"""Logged collectives: every collective hybridpar runs goes through this module (or the host
reducer) so that the ledger sees it. The autograd pairs built on them live next to the layers that
use them (hybridpar.parallel.model, .redistribute, .batchnorm). With one rank each is a no-op.

With a codec (hybridpar.comm.codecs) an all-gather sends each rank's encoded piece and every rank,
the owner included, uses the decoded pieces (so the replicas stay identical); an all-reduce
becomes `compressed_all_reduce`. The ledger books the payload (elements x the codec's bytes per
element) under the term, which is what the cost model predicts, and the per-block scales and
padding under the separate term `codec_overhead`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridpar.comm import small as _small
from hybridpar.comm.codecs import Codec, Encoded
from hybridpar.comm.ledger import Entry, Ledger
from hybridpar.plan import Term

__all__ = [
    "Pending",
    "all_gather_uneven",
    "all_reduce",
    "chunk_sizes",
    "compressed_all_reduce",
    "even_split",
    "group_size",
]


def even_split(n: int, parts: int) -> list[int]:
    """Split n into `parts` sizes differing by at most one, the larger ones first: how examples
    split over ranks and how a layer's output features split over a model group."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """torch.chunk's split of n into `parts` (ceil(n / parts) each, the rest to the last, possibly
    none): how a split layer's output units lie on its model group. It is DTensor's Shard layout,
    so checkpoints (torch.distributed.checkpoint) can re-split them onto another grid."""
    c = -(-n // parts)
    return [max(0, min(c, n - i * c)) for i in range(parts)]


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


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


def all_reduce(
    t: torch.Tensor,
    group: dist.ProcessGroup,
    ledger: Ledger | None,
    term: str,
    layers: dict[str, float] | None = None,
    async_op: bool = False,
) -> Pending:
    """Sum `t` in place over `group`, logged under `term`."""
    p = group_size(group)
    t0 = time.perf_counter()
    if p == 1:
        return Pending(None, None, t0)
    small = None if async_op else _small.reducer_for(group)
    if small is not None and small.fits(t):  # shared memory: microseconds instead of milliseconds
        small.small_all_reduce(t)
        if ledger:
            ledger.record("all_reduce", p, t.numel() * t.element_size(), 0.0, term, layers)
        return Pending(None, None, t0)
    work = dist.all_reduce(t, group=group, async_op=async_op)
    entry = (
        ledger.record("all_reduce", p, t.numel() * t.element_size(), 0.0, term, layers)
        if ledger
        else None
    )
    pending = Pending(work, entry, t0)
    if not async_op:
        pending.wait()
    return pending


def all_gather_uneven(
    t: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    group: dist.ProcessGroup,
    ledger: Ledger | None,
    term: str,
    layer: str | None,
    codec: Codec | None = None,
) -> torch.Tensor:
    """Concatenate along `dim` the pieces of every rank of `group`; piece i has sizes[i] along dim.

    Uneven pieces are padded to the largest for the wire; the ledger records the bytes of the
    real (unpadded) result, the quantity the cost model predicts."""
    p = len(sizes)
    if p == 1:
        return t
    if codec is not None and codec.name != "none":
        return _compressed_all_gather(t, sizes, dim, group, ledger, term, layer, codec)
    t0 = time.perf_counter()
    top = max(sizes)
    t = t.contiguous()
    if t.shape[dim] < top:
        pad_shape = list(t.shape)
        pad_shape[dim] = top - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    pieces = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(pieces, t, group=group)
    out = torch.cat([x.narrow(dim, 0, n) for x, n in zip(pieces, sizes, strict=True)], dim=dim)
    if ledger is not None:
        ledger.record(
            "all_gather",
            p,
            out.numel() * out.element_size(),
            time.perf_counter() - t0,
            term,
            {layer: out.numel()} if layer else None,
        )
    return out


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
    dist.all_gather(pieces, buf, group=group)
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


def _compressed_all_gather(t, sizes, dim, group, ledger, term, layer, codec: Codec) -> torch.Tensor:
    t0 = time.perf_counter()
    t = t.contiguous()
    inner = math.prod(
        n for i, n in enumerate(t.shape) if i != dim % t.dim()
    )  # a piece may be empty
    numels = [n * inner for n in sizes]
    lengths = [codec.wire_bytes(n) for n in numels]
    mine = codec.to_bytes(codec.encode(t))
    got = _gather_bytes(mine, lengths, group)
    parts = [
        codec.decode(codec.from_bytes(b, n)).view(_shape_with(t, dim, k))
        for b, n, k in zip(got, numels, sizes, strict=True)
    ]
    out = torch.cat(parts, dim=dim).to(t.dtype)
    payload = out.numel() * codec.bits / 8
    _book(
        ledger,
        "all_gather",
        len(sizes),
        payload,
        len(sizes) * max(lengths) - payload,
        time.perf_counter() - t0,
        term,
        {layer: out.numel()} if layer else None,
    )
    return out


def compressed_all_reduce(
    t: torch.Tensor,
    group: dist.ProcessGroup,
    codec: Codec,
    ledger: Ledger | None,
    term: str,
    layers: dict[str, float] | None = None,
    residuals: dict | None = None,
    key: object = None,
) -> torch.Tensor:
    """Sum `t` over `group` in place, with every byte on the wire encoded by `codec`.

    Krizhevsky's section 4.1 scheme: each rank owns 1/p of the tensor. Every rank encodes the
    chunks it does not own and sends them to their owners in one all-to-all; the owner decodes
    them, adds them to its own chunk in float32, encodes the sum once and sends it to everyone in
    one all-gather; every rank (the owner too) decodes all the chunks, so all end up with the same
    tensor. Wire bytes per element: about 2 (p-1)/p x the codec's size, against 8 (p-1)/p for a
    float32 ring all-reduce.

    No copies beyond the codec's own passes: chunks are encoded straight into the send buffer
    (one frame per chunk: scales, then payload; `_frame`), the owner decodes and adds in one pass
    (`Codec.decode_add`), and the gathered sums are decoded straight into `t`. The byte buffers
    are kept per thread and reused (`_scratch`).

    Error feedback (as in 1-bit SGD): with a `residuals` dict, what the encoding lost this time
    (of the chunks sent, and of the owned sum) is kept under `key` and added back next time.
    """
    p = group_size(group)
    if p == 1:
        return t
    t0 = time.perf_counter()
    flat = t.view(-1)
    n = flat.numel()
    me = dist.get_rank(group)
    sizes = even_split(n, p)
    offs = [sum(sizes[:j]) for j in range(p)]
    x = flat.float()  # flat itself when it is float32
    res = None
    if residuals is not None:
        res = residuals.get(key)
        if res is None or res[0].numel() != n:
            res = (
                torch.zeros_like(x),
                torch.zeros(sizes[me], dtype=torch.float32, device=x.device),
            )
            residuals[key] = res
        x = x + res[0]
    frames = [_frame_bytes(codec, k) for k in sizes]
    send_len = [0 if j == me else frames[j] for j in range(p)]
    recv_len = [0 if j == me else frames[me] for j in range(p)]
    send = _scratch("send", sum(send_len), x.device)
    pos = 0
    for j in range(p):
        if j == me:
            continue
        piece = x[offs[j] : offs[j] + sizes[j]]
        enc = _encode_into(codec, piece, _frame(codec, send[pos : pos + frames[j]], sizes[j]))
        pos += frames[j]
        if res is not None:
            lost = res[0][offs[j] : offs[j] + sizes[j]]
            torch.sub(piece, codec.decode(enc, out=lost).view(-1), out=lost)
    recv = _scratch("recv", sum(recv_len), x.device)
    dist.all_to_all_single(recv, send, recv_len, send_len, group=group)
    acc = x[offs[me] : offs[me] + sizes[me]]  # x is not read again: sum into it
    if x.data_ptr() == flat.data_ptr():
        acc = acc.clone() if res is not None else acc
    pos = 0
    for j in range(p):
        if j != me:
            codec.decode_add(_frame(codec, recv[pos : pos + frames[me]], sizes[me]), acc)
            pos += frames[me]
    if res is not None:
        acc += res[1]
    top = frames[0]  # even_split puts the largest chunk first; every frame is padded to it
    mine = _scratch("gather", top, x.device)
    enc = _encode_into(codec, acc, _frame(codec, mine[: frames[me]], sizes[me]))
    if res is not None:
        torch.sub(acc, codec.decode(enc, out=res[1]).view(-1), out=res[1])
    got = _scratch("gathered", p * top, x.device)
    _all_gather_single(got, mine, group=group)
    dst = flat if flat.dtype == torch.float32 else x
    for j in range(p):
        chunk = dst[offs[j] : offs[j] + sizes[j]]
        codec.decode(_frame(codec, got[j * top : j * top + frames[j]], sizes[j]), out=chunk)
    if dst is not flat:
        flat.copy_(dst)
    payload = n * codec.bits / 8
    seconds = time.perf_counter() - t0
    _book(ledger, "all_to_all", p, payload, sum(frames) - payload, seconds, term, layers)
    _book(ledger, "all_gather", p, payload, p * top - payload, 0.0, term, layers)
    return t


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


# all_gather_into_tensor is deprecated from torch 2.13 on, under its new name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCRATCH = threading.local()


def _scratch(name: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer of `nbytes`, kept per thread, name and device and reused across calls (fresh
    pages on every call would each cost a page fault); valid until this thread's next call."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    buf = bufs.get((name, device))
    if buf is None or buf.numel() < nbytes:
        buf = bufs[(name, device)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]
