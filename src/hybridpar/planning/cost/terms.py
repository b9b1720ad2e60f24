"""Per-layer communication cost of each style: Gholami et al. (SPAA'18) Eqs. 3-9, term by term.

Conventions (stated once; docs/cost-model.md repeats them with a worked example):

- Only layers with weights (conv, linear) are layers i = 1..L of the equations. Pooling, activation,
  norm and reshape layers ride along with the weighted layer before them, or with the one after
  them when a segment boundary (hybridpar.core.analysis) lies in between: a layer rides with the
  weighted layer whose layout it runs in.
- d_i is layer i's output per sample *before* pooling; d_{i-1} is its actual input per sample
  (after the previous layer's pooling). X (input) and Y (output) are (C, H, W) likewise.
- Sizes are elements x bytes per element (4 for fp32, a codec's rate otherwise); beta is seconds
  per byte; log is ceil(log2).
- |W_i| counts weights *and* biases: both are all-reduced in practice (Eq. 2 counts weights only;
  the difference is below 0.03 % for every layer of AlexNet). Parameters of an unweighted layer
  that rides along (batch norm's scale and shift) count with its host layer.
- Index ranges as printed: the forward all-gather sums over i = 1..L, the dX all-reduce over
  i = 2..L (nothing is back-propagated into the input). The weight all-reduce sums are printed
  from i = 0, but there is no layer 0 (d_0 is the input, W_0 does not exist): we sum over the
  layers 1..L. Read literally, i = 0 would add one latency-only term 2*alpha*ceil(log P) and break
  the identity "Eq. 9 with no domain layers is Eq. 8" that the paper states.
- A domain layer's halo terms vanish when the image is not split (Pr = 1) and when the kernel is
  1 wide (floor(k/2) = 0: "for a 1x1 convolution no communication is needed"); Eq. 9's backward
  halo uses Y_i = X_{i+1} and k_w as printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridpar.core.cluster import SHM_MAX_BYTES, Cluster, Priced, as_priced
from hybridpar.core.errors import ConfigError
from hybridpar.core.halo import Span
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style
from hybridpar.core.splits import group_rows
from hybridpar.core.terms import Term
from hybridpar.planning.cost.collectives import (
    Comm,
    all_gather,
    all_reduce,
    all_to_all,
    compressed_all_reduce,
    halo,
    reduce_scatter,
)

__all__ = [
    "Wire",
    "codec_s",
    "eq3_model",
    "eq4_batch",
    "eq5_volume_ratio",
    "eq6_redistribute",
    "eq7_domain",
    "eq8_integrated",
    "eq9_integrated_domain",
    "largest_halo",
    "layer_comms",
    "on_host",
    "padded",
    "plus",
    "redistribute",
    "sharded_elements",
    "t_halo",
    "t_loss_join",
    "t_norms",
    "t_sharded",
]


# --- the terms ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wire:
    """Bytes per element on the wire by kind of traffic, for a codec that compresses some of it:
    `grads` for weight-gradient reductions, `acts` for activations and their gradients (the
    all-gathers of Y, the dX all-reduces, the redistributions, the halos). A compressed reduction
    runs as all-to-all + all-gather (hybridpar.runtime.comm.collectives.compressed_all_reduce); gradient
    reductions at one all-to-all's latency (the pipeline: cost.collectives.compressed_all_reduce)."""

    grads: float
    acts: float
    grads_compressed: bool = False
    acts_compressed: bool = False
    raw_acts: float = 0.0
    """activations as tensors hold them (the halos travel so, never encoded); 0: `acts`"""
    encode_s: float = 0.0
    """seconds a rank takes to encode one element with the codec (`codec_s`); 0: not measured"""
    decode_s: float = 0.0

    @staticmethod
    def of(e: float | Wire) -> Wire:
        return e if isinstance(e, Wire) else Wire(e, e)

    @property
    def halo(self) -> float:
        return self.raw_acts or self.acts


def codec_s(n: float, p: int, w: Wire, grads: bool, reduce: bool) -> float:
    """Seconds one rank spends encoding and decoding an encoded collective of `n` wire bytes over
    p ranks (runtime.comm.collectives): a reduction encodes every element once (the chunks for
    their owners, then its owned sum) and decodes (2p - 1)/p of them (the chunks it sums, then
    every chunk of the result); an all-gather encodes its 1/p and decodes the (p - 1)/p it
    receives. 0 where that traffic travels unencoded or the cluster has no codec times."""
    on = w.grads_compressed if grads else w.acts_compressed
    if not on or p <= 1 or not (w.encode_s or w.decode_s):
        return 0.0
    elems = n / (w.grads if grads else w.acts)
    if reduce:
        return elems * w.encode_s + (2 * p - 1) / p * elems * w.decode_s
    return elems / p * w.encode_s + (p - 1) / p * elems * w.decode_s


def plus(c: Comm, seconds: float) -> Comm:
    """`c` taking `seconds` longer."""
    return c if not seconds else Comm(c.kind, c.group, c.bytes, c.seconds + seconds)


def _reduce(
    n: float, p: int, net: Cluster | Priced, compressed: bool, pipelined: bool = False
) -> Comm:
    return compressed_all_reduce(n, p, net, pipelined) if compressed else all_reduce(n, p, net)


def on_host(c: Comm, net: Cluster | Priced, compressed: bool, rank_bytes: float) -> Comm:
    """An activation collective as the runtime runs it on one host: through shared memory
    (comm.small), small_alpha + shm_beta * bytes, where `hybridpar calibrate` measured both.
    Encoded activations (a codec), clusters without those numbers, and collectives of more than
    SHM_MAX_BYTES per rank stay on alpha-beta, as the runtime sends them on gloo (`rank_bytes`:
    what one rank contributes, the size the runtime compares with that limit)."""
    if compressed or not net.shm_paths or c.group <= 1:
        return c
    if rank_bytes > SHM_MAX_BYTES:
        return c
    return Comm(c.kind, c.group, c.bytes, net.small_alpha + net.shm_beta * c.bytes)


def t_allgather(
    layer: CostLayer, pr: int, pc: int, B: int, net: Cluster | Priced, e: float | Wire
) -> Comm:
    """alpha*ceil(log Pr) + beta*(B/Pc)*(Pr-1)/Pr*d_i: forward all-gather of Y over the model group."""
    net = as_priced(net, pr * pc)
    w, net = Wire.of(e), net.group("model", pr, pc)
    n = B / pc * layer.d_out * w.acts
    c = on_host(all_gather(n, pr, net), net, w.acts_compressed, n / pr)
    return plus(c, codec_s(n, pr, w, grads=False, reduce=False))


def t_loss_join(layer: CostLayer, s: Style, B: int, net: Cluster | Priced, e) -> Comm:
    """The model's outputs (the last layer's, `out` elements an example) all-gathered onto every
    rank for a loss that does not split: every rank sends what it holds (a channel split's
    replicas their copies: Pr of each example), never encoded."""
    p = s.pr * s.pc
    net = as_priced(net, p)
    n = B * (layer.out or layer.d_out) * (s.pr if s.kind == "model" else 1) * Wire.of(e).halo
    return on_host(all_gather(n, p, net), net, False, n / p)


def t_dx_allreduce(
    layer: CostLayer, pr: int, pc: int, B: int, net: Cluster | Priced, e: float | Wire
) -> Comm:
    """2*(alpha*ceil(log Pr) + beta*(B/Pc)*(Pr-1)/Pr*d_{i-1}): backward all-reduce of dX (encoded:
    two calls, an all-to-all and an all-gather)."""
    net = as_priced(net, pr * pc)
    w, net = Wire.of(e), net.group("model", pr, pc)
    n = B / pc * layer.d_in * w.acts
    c = on_host(_reduce(n, pr, net, w.acts_compressed), net, w.acts_compressed, n)
    c = plus(c, codec_s(n, pr, w, grads=False, reduce=True))
    return replace(c, calls=(0, 2)) if w.acts_compressed and c.bytes > 0 else c


def t_dx_allgather(
    layer: CostLayer, pr: int, pc: int, B: int, net: Cluster | Priced, e: float | Wire
) -> Comm:
    """alpha*ceil(log Pr) + beta*(B/Pc)*(Pr-1)/Pr*d_{i-1}: a grouped convolution's backward. Each
    rank of the model group reads only the input channels of its own groups, so its dX is nonzero
    there alone: the slices are all-gathered, half the bytes of the all-reduce a dense layer needs."""
    net = as_priced(net, pr * pc)
    w, net = Wire.of(e), net.group("model", pr, pc)
    n = B / pc * layer.d_in * w.acts
    c = on_host(all_gather(n, pr, net), net, w.acts_compressed, n / pr)
    return plus(c, codec_s(n, pr, w, grads=False, reduce=False))


def t_dw_allreduce(
    layer: CostLayer,
    p: int,
    shard: int,
    net: Cluster | Priced,
    e: float | Wire,
    reducer: str = "process-group",
    bucket: float | None = None,
) -> Comm:
    """2*(alpha*ceil(log p) + beta*(p-1)/p*|W_i|/shard): all-reduce of the weight gradient over
    the p ranks that hold the same 1/shard of W (riding-along batch-norm parameters are whole on
    every rank, not split): the batch groups of grid shard x p. With a `bucket` size its latency
    fused (`fused`); with the host reducer, see `t_host_reduce`."""
    net = as_priced(net, p * shard)
    w = Wire.of(e)
    sharded = layer.params - layer.extra_params
    elems = sharded / shard + layer.extra_params
    if reducer == "host":
        return t_host_reduce(elems, p, shard, net, w, bucket)
    group = net.group("batch", shard, p)
    # compressed gradients stream through the reducer thread's pipeline (hooks.compressed_hook)
    c = fused(_reduce(elems * w.grads, p, group, w.grads_compressed, True), group, bucket)
    return plus(c, codec_s(elems * w.grads, p, w, grads=True, reduce=True))


def t_host_reduce(
    elems: float, p: int, shard: int, net: Cluster | Priced, w: Wire, bucket: float | None = None
) -> Comm:
    """The host reducer's all-reduce of `elems` gradient elements over the batch groups of grid
    shard x p (Sekiyama et al.; runtime.comm.host): the L members of a group on one host sum in
    shared memory, float32 (2(L-1)/L of the bytes through it, at the calibrated shm_beta and
    small_alpha; alpha-beta where they are unknown), then one leader per host all-reduces the
    host sums over the network (encoded where the codec takes gradients). Bytes: the flat
    all-reduce's, as the plan books them; the report scales them by the hosts the run found
    (runtime.train.report.predicted)."""
    net = as_priced(net, p * shard)
    flat = _reduce(elems * w.grads, p, net, w.grads_compressed, True)
    if p <= 1:
        return flat
    s = net.span("batch", shard, p)
    L, H, share = min(s.per_host, p), s.hosts, 1.0
    if bucket is not None:  # the reducer sums whole buckets: a layer pays its share of one
        share = min(1.0, elems * w.grads / bucket)  # wire bytes, as `fused` takes them
    intra = all_reduce(elems * 4.0, L, net)  # float32 in shared memory, whatever the codec
    if L > 1 and net.small_alpha is not None and net.shm_beta is not None:
        intra_s = share * net.small_alpha + net.shm_beta * intra.bytes
    else:
        intra_s = fused(intra, net, bucket).seconds
    leaders = net.group("batch", shard, p)
    inter = fused(_reduce(elems * w.grads, H, leaders, w.grads_compressed, True), leaders, bucket)
    inter = plus(inter, codec_s(elems * w.grads, H, w, grads=True, reduce=True))
    return Comm("all_reduce", p, flat.bytes, intra_s + inter.seconds)


def _small(nbytes: float, p: int, net: Priced) -> Comm:
    """An all-reduce of a few values: with a calibrated `small_alpha` (shared memory on one host,
    comm.small) it takes that long; the bytes are the same."""
    c = all_reduce(nbytes, p, net)
    if net.small_alpha is None or not net.shared_memory or p <= 1:
        return c
    return Comm(c.kind, c.group, c.bytes, net.small_alpha)


def t_global_bn(
    channels: int, p: int, net: Cluster | Priced, backward: bool = True
) -> dict[str, Comm]:
    """Global batch norm over p ranks (Liu et al.): forward all-reduce of [sum x, sum x^2, m] and
    backward all-reduce of [sum dy, sum dy*(x - mean)], both in float64 (8 bytes an element)."""
    net = as_priced(net, p)
    return {
        Term.BN_STATS: _small((2 * channels + 1) * 8, p, net),
        Term.BN_GRAD: _small(2 * channels * 8, p, net) if backward else Comm.zero("all_reduce", p),
    }


def t_band_sums(layer: CostLayer, s: Style, B: int, net: Cluster | Priced) -> dict[str, Comm]:
    """The sums over the Pr ranks holding an example's bands, of the layers riding along with
    `layer`: an instance or group norm's statistics per channel or group, as global batch norm's
    over B/Pc examples' worth of channels (runtime.parallel.batchnorm.BandStatistics; a group
    without examples sends none); a global pooling's sums per channel in float64, forward (a
    maximum: each rank's maximum, its count and where it first occurs, in a row per rank) and
    backward (runtime.parallel.domain.SpaceReduction); an instance norm's running statistics
    over the batch group, where Pc > 1."""
    priced = as_priced(net, s.pr * s.pc)
    net, batch = priced.group("model", s.pr, s.pc), priced.group("batch", s.pr, s.pc)
    out: dict[str, Comm] = {}
    n = B / s.pc  # a group's examples (their mean where groups differ: the bytes' mean)
    # a norm's sums per group: 2 N K + 1 numbers, none where a group has no example (B < P)
    groups = group_rows(int(B), s.pr, s.pc) if float(B).is_integer() else [n] * s.pc
    for norm in layer.spatial_norms:
        k, grad, tracked = norm.size, norm.grad, norm.tracked
        each = [t_global_bn(k * g, s.pr, net, backward=grad) for g in groups if g]
        for term in each[0] if each else ():
            c = max((x[term] for x in each), key=lambda c: c.seconds)  # the slowest group's
            mean = math.fsum(x[term].bytes for x in each) / s.pc
            _merge(out, {term: replace(c, bytes=mean)})
        if tracked and s.pc > 1:  # the running statistics' sums over the batch group
            _merge(out, {Term.BN_STATS: _small((2 * k + 1) * 8, s.pc, batch)})
    for p in layer.pools:
        sums = p.channels * math.prod(p.cells) * n * 8  # per example and channel: per cell
        back = _small(sums, s.pr, net) if p.grad else Comm.zero("all_reduce", s.pr)
        rows = 3 * s.pr if p.how in ("max", "first") else 1  # maximum, count, first index
        _merge(out, {Term.BN_STATS: _small(sums * rows, s.pr, net), Term.BN_GRAD: back})
    return out


def t_norms(layer: CostLayer, s: Style, net: Cluster | Priced) -> dict[str, Comm]:
    """The global batch norms riding along with `layer`, over the ranks that split the examples
    of its layout (the batch group: Pc ranks; a domain layout splits the image too: all P, but
    for a batch norm of a pooled value, whole on every rank of a model group: Pc)."""
    net = as_priced(net, s.pr * s.pc)
    banded = s.kind == "domain"
    out: dict[str, Comm] = {}
    for norm in layer.norms:
        over = banded and not norm.whole  # the model group holds other rows
        p = s.pr * s.pc if over else s.pc
        group = net.group("batch", 1, p) if over else net.group("batch", s.pr, s.pc)
        _merge(out, t_global_bn(norm.size, p, group, backward=norm.grad))
    return out


def _merge(into: dict[str, Comm], more: dict[str, Comm]) -> None:
    """`more`'s terms added to `into`'s (bytes and seconds of one term summed)."""
    for term, c in more.items():
        prev = into.get(term)
        into[term] = (
            c
            if prev is None
            else Comm(c.kind, c.group, prev.bytes + c.bytes, prev.seconds + c.seconds)
        )


def t_halo(
    layer: CostLayer,
    pr: int,
    pc: int,
    B: int,
    net: Cluster | Priced,
    e: float | Wire,
    backward: bool = False,
    first: bool = False,
    pw: int = 1,
) -> Comm:
    """The halo rows the domain style exchanges for `layer`, as the runtime sends them: for every
    height window of the layer (its convolution and the poolings riding along: CostLayer.windows),
    the rows each rank receives from the others (core.halo.RowMap.plan), x (B/Pc examples) x
    channels x width x bytes. Bytes: per rank, averaged over the Pr ranks (the first and last
    band have one neighbour; stride and dilation change the rows; a thin band is crossed). Time:
    the busiest rank's messages and bytes; one exchange (call) per window with rows to send.
    Backward the same rows carry gradients back, except into the input of a first layer
    (`first`: nothing is back-propagated there). On tiles (`pw` > 1 columns): `_tile_halo`."""
    net = as_priced(net, pr * pc)
    if pr <= 1:
        return Comm.zero("halo", pr)
    net = net.group("model", pr, pc)
    elem = Wire.of(e).halo
    names = [w.member for w in layer.windows]
    no_grad = names.index(layer.name) + 1 if first and layer.name in names else 0
    total = seconds = 0.0
    calls = 0
    for i, entry in enumerate(layer.windows):
        if backward and i < no_grad:
            continue
        if pw > 1:
            tiled = _tile_halo(entry, layer.cols[i], pr, pw, B / pc * elem, net)
            total, seconds, calls = total + tiled[0], seconds + tiled[1], calls + tiled[2]
            continue
        win = entry.row_map()
        row = B / pc * entry.channels * entry.across * elem
        sent, msgs = win.rows_sent(pr), win.messages(pr)
        if not any(sent):
            continue
        calls += 1
        total += sum(sent) / pr * row
        most = max(sent) * row
        if net.shm_paths and most <= SHM_MAX_BYTES:
            seconds += net.small_alpha + net.shm_beta * most  # through shared memory (one host)
        else:
            pairs = zip(msgs, sent, strict=True)
            seconds += max(net.alpha * m + net.beta * n * row for m, n in pairs)
    return Comm("halo", pr, total, seconds, (0, calls) if backward else (calls, 0))


def _tile_halo(rows: Span, cols: Span, pr: int, pw: int, n: float, net: Priced):
    """(bytes per rank averaged over the Pr ranks, seconds, calls) of one window's halo on
    (Pr / pw) x pw tiles, as the runtime sends it (runtime.parallel.domain.windows._Windowed): the halo
    columns over each row of tiles, a column being the tile's rows high, then the halo rows of
    the tiles widened by them (and by the padding's columns: the corners) over each column of
    tiles. `n`: bytes of one element of every example of a batch group. Seconds: the busiest
    rank's messages and bytes of each stage, point to point."""
    ph, c = pr // pw, rows.channels * (rows.across // cols.size_in)  # x a volume's width
    by_rows, by_cols = rows.row_map(), cols.row_map()
    tall = [b - a for a, b in by_rows.held(ph)]  # a tile's rows
    wide = [max(p.reads[1] - p.reads[0], 0) for p in by_cols.parts(pw)]  # its widened columns
    total = seconds = 0.0
    calls = 0
    stages = ((by_cols, pw, [[h] * pw for h in tall]), (by_rows, ph, [wide] * ph))
    for k, (win, parts, length) in enumerate(stages):
        sent, msgs = win.rows_sent(parts), win.messages(parts)
        if not any(sent):
            continue
        calls += 1
        # per tile (i, j): what it sends along its line, a row (column) `length[i][j]` long
        along = [[sent[j if k == 0 else i] * length[i][j] for j in range(pw)] for i in range(ph)]
        count = [[msgs[j if k == 0 else i] for j in range(pw)] for i in range(ph)]
        total += sum(map(sum, along)) / pr * c * n
        seconds += max(
            net.alpha * m + net.beta * v * c * n
            for row_m, row_v in zip(count, along, strict=True)
            for m, v in zip(row_m, row_v, strict=True)
        )
    return total, seconds, calls


def _halo_rows(layer: CostLayer, axis: int) -> int:
    if not layer.spatial or layer.kernel is None:
        raise ConfigError(
            f"layer {layer.name} is not a 2-d convolution: it cannot be domain-parallel"
        )
    return layer.kernel[axis] // 2


def largest_halo(layer: CostLayer, pr: int, pc: int, B: float, e: float | Wire) -> float:
    """The most bytes one rank sends in one forward exchange of `layer`'s windows on Pr bands
    (B/Pc examples): what a shared segment's slot must hold for it."""
    if pr <= 1:
        return 0.0
    row = B / pc * Wire.of(e).halo
    return max(
        (max(w.row_map().rows_sent(pr)) * row * w.channels * w.across for w in layer.windows),
        default=0.0,
    )


def t_halo_fwd(
    layer: CostLayer, pr: int, pc: int, B: int, net: Cluster | Priced, e: float | Wire
) -> Comm:
    """Eq. 9 as printed: alpha + beta*(B/Pc)*X_W*X_C*floor(k_h/2), the input rows a neighbour
    needs (for the paper's figures; `t_halo` is what the runtime sends)."""
    net = as_priced(net, pr * pc)
    return _eq9_halo(layer, layer.x_shape, 0, pr, pc, B, net, e)


def t_halo_bwd(
    layer: CostLayer, pr: int, pc: int, B: int, net: Cluster | Priced, e: float | Wire
) -> Comm:
    """Eq. 9 as printed: alpha + beta*(B/Pc)*Y_W*Y_C*floor(k_w/2), the output-gradient rows,
    backward (for the paper's figures; `t_halo` is what the runtime sends)."""
    net = as_priced(net, pr * pc)
    return _eq9_halo(layer, layer.y_shape, 1, pr, pc, B, net, e)


def _eq9_halo(
    layer: CostLayer, shape: tuple, axis: int, pr: int, pc: int, B: int, net: Cluster | Priced, e
) -> Comm:
    """alpha + beta * (B/Pc) * W * C * floor(k_axis / 2) of the activation `shape` (C, H, W)."""
    if pr <= 1:
        return Comm.zero("halo")
    c, _, w = shape
    return halo(B / pc * w * c * _halo_rows(layer, axis) * Wire.of(e).acts, net)


def fused(c: Comm, net: Cluster | Priced, bucket: float | None) -> Comm:
    """A weight-gradient all-reduce as the runtime sends it: fused with the other layers'
    gradients into buckets of `bucket` bytes (RuntimeOptions.bucket_mb; DDP's bucket_cap_mb
    alike), so a layer pays the latency in proportion to the share of a bucket it fills (at
    least a whole one's when it fills several). None: one message per layer, as Gholami et
    al.'s Eq. 4 counts it."""
    if bucket is None or c.bytes <= 0:
        return c
    latency = c.seconds - net.beta * c.bytes
    n = c.bytes * c.group / (2 * (c.group - 1))  # the gradient's bytes
    return Comm(c.kind, c.group, c.bytes, net.beta * c.bytes + latency * min(1.0, n / bucket))


def padded(member: tuple[tuple[int, int], ...], pr: int) -> int:
    """Elements of a member's parameters ((first dim, elements per index) each) as sharded
    states gather them: each first dim padded to a multiple of Pr (FSDP2's equal shards)."""
    return sum(-(-d0 // pr) * pr * rest for d0, rest in member)


def sharded_elements(layer: CostLayer, pr: int) -> int:
    """Elements of a layer's parameters as sharded states hold them whole (`padded`)."""
    return sum(padded(leaf, pr) for leaf in layer.shards)


def t_sharded(layer: CostLayer, s: Style, net: Cluster | Priced, e: float | Wire) -> dict:
    """Sharded states (runtime.parallel.sharded): per member with parameters, its parameters
    all-gathered over the Pr ranks before its forward and again before its backward, and their
    gradient sums reduce-scattered after it, each member's parameters one flat buffer of the
    tensors' own elements (never encoded); with Pc > 1 each shard then all-reduced over its batch
    group."""
    pr, pc = s.pr, s.pc
    net, m = as_priced(net, pr * pc), sum(1 for leaf in layer.shards if leaf)
    model, batch = net.group("model", pr, pc), net.group("batch", pr, pc)
    gather, scatter = Comm.zero("all_gather", pr), Comm.zero("reduce_scatter", pr)
    summed = Comm.zero("all_reduce", pc)
    for leaf in layer.shards:
        n = padded(leaf, pr) * Wire.of(e).halo
        g, r, a = (
            all_gather(n, pr, model),
            reduce_scatter(n, pr, model),
            all_reduce(n / pr, pc, batch),
        )
        gather = Comm(g.kind, pr, gather.bytes + 2 * g.bytes, gather.seconds + 2 * g.seconds)
        scatter = Comm(r.kind, pr, scatter.bytes + r.bytes, scatter.seconds + r.seconds)
        summed = Comm(a.kind, pc, summed.bytes + a.bytes, summed.seconds + a.seconds)
    terms = {
        Term.PARAM_ALLGATHER: replace(gather, calls=(m, m)),
        Term.DW_REDUCE_SCATTER: replace(scatter, calls=(0, m)),
    }
    if pc > 1:
        terms[Term.DW_ALLREDUCE] = replace(summed, calls=(0, m))
    return terms


def layer_comms(
    layer: CostLayer,
    first: bool,
    s: Style,
    B: int,
    net: Cluster | Priced,
    e: float | Wire | None = None,
    bn: str = "local",
    bucket: float | None = None,
    reducer: str = "process-group",
    shard: bool = False,
) -> dict[str, Comm]:
    """The communication terms of one layer under style `s` (first: nothing is back-propagated
    into its input, so no dX); with bn global or adaptive, its batch norms' all-reduces too;
    with a `bucket` size the weight-gradient all-reduce's latency fused (`fused`); `reducer`
    host: the gradient sums as the host reducer takes them (`t_host_reduce`); `shard`: a domain
    layer's states sharded over its model group (`t_sharded`)."""
    net = as_priced(net, s.pr * s.pc)
    e = net.word_bytes if e is None else e
    p = s.pr * s.pc
    first = first or not layer.input_grad
    if s.kind == "domain":
        terms = {
            Term.HALO_FWD: t_halo(layer, s.pr, s.pc, B, net, e, pw=s.pw),
            Term.HALO_BWD: t_halo(layer, s.pr, s.pc, B, net, e, True, first, s.pw),
        }
        if shard and s.pr > 1:
            terms.update(t_sharded(layer, s, net, e))
        else:
            terms[Term.DW_ALLREDUCE] = t_dw_allreduce(layer, p, 1, net, e, reducer, bucket)
    else:
        grouped = layer.groups > 1 and s.pr > 1
        dx = Term.DX_ALLGATHER if grouped else Term.DX_ALLREDUCE
        t_dx = t_dx_allgather if grouped else t_dx_allreduce
        terms = {
            Term.ALLGATHER: t_allgather(layer, s.pr, s.pc, B, net, e),
            dx: Comm.zero("all_gather" if grouped else "all_reduce", s.pr)
            if first
            else t_dx(layer, s.pr, s.pc, B, net, e),
            Term.DW_ALLREDUCE: t_dw_allreduce(layer, s.pc, s.pr, net, e, reducer, bucket),
        }
    if bn != "local":
        terms.update(t_norms(layer, s, net))
    if s.kind == "domain" and s.pr > 1:
        _merge(terms, t_band_sums(layer, s, B, net))
    return terms


def _one(c: Comm, forward: bool) -> tuple[int, int]:
    """(forward, backward) calls of one collective `c` sent in one pass (none if it sends nothing)."""
    return (0, 0) if c.bytes <= 0 else (1, 0) if forward else (0, 1)


def _both(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _calls(c: Comm) -> tuple[int, int]:
    return (0, 0) if c.bytes <= 0 or c.calls is None else c.calls


def redistribute(
    prev: Style | None,
    nxt: Style,
    d: int,
    B: int,
    net: Cluster | Priced,
    e: float | Wire | None = None,
) -> Comm | None:
    """Cost of moving the activation feeding `nxt` (d = d_{i-1} per sample) from the layout `prev`
    left it in, forward and backward together. None when the two layouts do not nest.

    Gholami Eq. 6 is the case batch -> model: an all-gather of B/Pc examples over the model group.
    Going the other way (to more batch groups) is a local slice forward and the same all-gather of
    dX backward. Into and out of a domain layout from the layout with the same Pc the extra step is
    a height slice (free) and a gather of the rows (of tiles: the same bytes); from pure batch
    with Pr*Pc = P into bands it is one all-to-all within the model group each way (into tiles
    through the replicated layout). The first layer reads its input in any layout.
    """
    net = as_priced(net, nxt.pr * nxt.pc)
    wire = Wire.of(net.word_bytes if e is None else e)
    e = wire.acts

    def gather(n: float, p: int, grp: Priced) -> Comm:
        c = on_host(all_gather(n, p, grp), grp, wire.acts_compressed, n / p)
        return plus(c, codec_s(n, p, wire, grads=False, reduce=False))

    if prev is None or prev.layout == nxt.layout:
        return Comm.zero("redistribute")
    p = nxt.pr * nxt.pc
    a, b = prev.layout, nxt.layout
    if a[0] == "rep" and b[0] == "rep":
        c1, c2 = a[1], b[1]
        lo, hi = min(c1, c2), max(c1, c2)
        if hi % lo:
            return None
        g = gather(B / lo * d * e, hi // lo, net.regroup(p, hi, lo))  # forward if c2 < c1
        return Comm(Term.REDISTRIBUTE, g.group, g.bytes, g.seconds, _one(g, c2 < c1))
    if a[0] == "rep" and b[0] == "dom":
        pr, pc = b[1], b[2]
        if a[1] == p and nxt.pw == 1:  # pure batch -> bands: all-to-all each way in the group
            x = all_to_all(B / p * d * e, pr, net.group("model", pr, pc))
            calls = (1, 1) if x.bytes > 0 else (0, 0)
            return Comm("redistribute", pr, 2 * x.bytes, 2 * x.seconds, calls)
        step = redistribute(prev, Style.model(pr, pc), d, B, net, e)
        if step is None:
            return None
        g = gather(B / pc * d * e, pr, net.group("model", pr, pc))  # backward: rows of dX
        calls = _both(_calls(step), _one(g, False))
        return Comm("redistribute", pr, step.bytes + g.bytes, step.seconds + g.seconds, calls)
    if a[0] == "dom" and b[0] == "rep":
        back = redistribute(nxt, prev, d, B, net, e)  # symmetric
        return None if back is None else replace(back, calls=_calls(back)[::-1])
    return _between_domains(prev, nxt, d, B, net, e)


def _between_domains(
    prev: Style, nxt: Style, d: int, B: int, net: Priced, e: float | Wire | None
) -> Comm | None:
    """Domain -> another domain layout: through the replicated layout of the first."""
    mid = Style.model(prev.pr, prev.pc)
    x = redistribute(prev, mid, d, B, net, e)
    y = redistribute(mid, nxt, d, B, net, e)
    if x is None or y is None:
        return None
    calls = _both(_calls(x), _calls(y))
    group, n, t = max(x.group, y.group), x.bytes + y.bytes, x.seconds + y.seconds
    return Comm("redistribute", group, n, t, calls)


# --- the equations, literally (sums of the terms above) -------------------------------------


def _total(comms: list[Comm]) -> float:
    return math.fsum(c.seconds for c in comms)


def eq3_model(
    layers: list[CostLayer], P: int, B: int, net: Cluster | Priced, e: float | None = None
) -> float:
    """Eq. 3, pure model parallelism on P processes."""
    net = as_priced(net, P)
    e = net.word_bytes if e is None else e
    return _total(
        [t_allgather(x, P, 1, B, net, e) for x in layers]
        + [t_dx_allreduce(x, P, 1, B, net, e) for x in layers[1:]]
    )


def eq4_batch(
    layers: list[CostLayer], P: int, net: Cluster | Priced, e: float | None = None
) -> float:
    """Eq. 4, pure batch parallelism: 2 * sum (alpha*ceil(log P) + beta*(P-1)/P*|W_i|)."""
    net = as_priced(net, P)
    e = net.word_bytes if e is None else e
    return _total([t_dw_allreduce(x, P, 1, net, e) for x in layers])


def eq5_volume_ratio(layer: CostLayer, B: int) -> float:
    """Eq. 5: batch/model communication volume of a conv layer, 2*kh*kw*X_C / (3*B*Y_H*Y_W).

    Derived from 2|W_i| / (3*B*d_i) with |W_i| = kh*kw*X_C*Y_C and d_{i-1} taken equal to d_i, as in
    the paper; >1 means model parallelism moves fewer bytes."""
    if not layer.spatial or layer.kernel is None:
        raise ConfigError(f"Eq. 5 is for conv layers; {layer.name} is {layer.kind}")
    kh, kw = layer.kernel
    xc = layer.x_shape[0]
    _, yh, yw = layer.y_shape
    return 2 * kh * kw * xc / (3 * B * yh * yw)


def eq6_redistribute(
    d: int, P: int, B: int, net: Cluster | Priced, e: float | None = None
) -> float:
    """Eq. 6: alpha*ceil(log P) + beta*B*(P-1)/P*d_i, redistribution from batch to model."""
    net = as_priced(net, P)
    e = net.word_bytes if e is None else e
    return all_gather(B * d * e, P, net).seconds


def eq7_domain(
    layers: list[CostLayer], P: int, B: int, net: Cluster | Priced, e: float | None = None
) -> float:
    """Eq. 7, pure domain parallelism: halo exchanges (whole batch B) + the weight all-reduce."""
    net = as_priced(net, P)
    e = net.word_bytes if e is None else e
    return _total(
        [t_halo_fwd(x, P, 1, B, net, e) for x in layers]
        + [t_halo_bwd(x, P, 1, B, net, e) for x in layers]
        + [t_dw_allreduce(x, P, 1, net, e) for x in layers]
    )


def eq8_integrated(
    layers: list[CostLayer], pr: int, pc: int, B: int, net: Cluster | Priced, e: float | None = None
) -> float:
    """Eq. 8, the 1.5D algorithm on a Pr x Pc grid for every layer."""
    net = as_priced(net, pr * pc)
    e = net.word_bytes if e is None else e
    return _total(
        [t_allgather(x, pr, pc, B, net, e) for x in layers]
        + [t_dx_allreduce(x, pr, pc, B, net, e) for x in layers[1:]]
        + [t_dw_allreduce(x, pc, pr, net, e) for x in layers]
    )


def eq9_integrated_domain(
    layers: list[CostLayer],
    pr: int,
    pc: int,
    B: int,
    net: Cluster | Priced,
    domain: set[int],
    e: float | None = None,
) -> float:
    """Eq. 9: layers whose index is in `domain` (L_D) split the image over Pr, the others (L_M)
    split the model; both split the batch over Pc."""
    net = as_priced(net, pr * pc)
    e = net.word_bytes if e is None else e
    lm = [(i, x) for i, x in enumerate(layers) if i not in domain]
    ld = [x for i, x in enumerate(layers) if i in domain]
    return _total(
        [t_allgather(x, pr, pc, B, net, e) for _, x in lm]
        + [t_dx_allreduce(x, pr, pc, B, net, e) for i, x in lm if i > 0]
        + [t_dw_allreduce(x, pc, pr, net, e) for _, x in lm]
        + [t_halo_fwd(x, pr, pc, B, net, e) for x in ld]
        + [t_halo_bwd(x, pr, pc, B, net, e) for x in ld]
        + [t_dw_allreduce(x, pr * pc, 1, net, e) for x in ld]
    )
