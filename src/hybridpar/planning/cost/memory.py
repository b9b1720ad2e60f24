"""What a rank holds for the backward pass of a layer under a style (torch-free): the planner's
memory model of activations, read beside the parameters, gradients and optimizer state it adds
(planning/search.py) and held to what a step counts (runtime/parallel/memory.py)."""

from __future__ import annotations

import math

from hybridpar.core.cluster import SHM_MIN_BYTES
from hybridpar.core.halo import Span
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style

__all__ = ["at_worst", "kept", "segment"]


def kept(layer: CostLayer, s: Style) -> float:
    """Elements per sample that autograd keeps for the backward pass of `layer` on the busiest
    rank under `s` (core.analysis._saved, traced whole): all of them under batch and model (a
    split layer reads and its riders write the gathered activation); on bands the busiest rank's
    share of each, and a convolution or pooling that reads rows beyond its band keeps its own
    copy of band, halo and padding."""
    if not layer.saved:  # described by hand: its output and that output's gradient
        return 2.0 * layer.d_out / (s.pr if s.kind == "domain" else 1)
    if s.kind != "domain":
        return math.fsum(v for _, v in layer.saved)
    windows = {
        w.member: (w, c) for w, c in zip(layer.windows, layer.cols or layer.windows, strict=True)
    }
    share, total = _share(layer, s), 0.0
    for name, v in layer.saved:
        w, c = windows.get(name, (None, None))
        if w is None or w.how not in ("", "ceil", "circular"):
            total += v * share
        else:
            pieces = name == layer.name and layer.op == "conv2d"
            total += max(_window_kept(w, v, s.pr, pieces, c if s.pw > 1 else None, s.pw))
    return total


def _share(layer: CostLayer, s: Style) -> float:
    """The busiest rank's part of a layer's activations per example under `s`: its band's (or
    tile's) rows and columns on a domain layout, all of them otherwise (a model split gathers
    them)."""
    if s.kind != "domain":
        return 1.0
    h = layer.y_shape[1] if len(layer.y_shape) in (3, 4) else 1
    wide = layer.y_shape[2] if s.pw > 1 and len(layer.y_shape) in (3, 4) else 1
    return -(-h // s.ph) / h * (-(-wide // s.pw) / wide)  # the largest band's (tile's)


def at_worst(layer: CostLayer, s: Style, predict: bool) -> float:
    """Elements per sample the busiest rank holds at the layer's worst moment beyond what it
    holds throughout (`kept`, the states): in training, the gradients in flight in its backward
    (of its input and its output); in evaluation, everything alive while it runs (core.live:
    its input and output, and what earlier layers hand on, a U-Net's skips); on bands also the
    band and halo a window reads joined."""
    share, (before, most) = _share(layer, s), layer.live
    # on bands a convolution reads its input band and halo joined in one tensor (backward: its
    # gradient), held with its input and output (in evaluation: with what was held as it began)
    joined = _joined(layer, s) if s.kind == "domain" else 0.0
    if not predict or not most:
        return (layer.d_in + layer.d_out) * share + joined
    return max(most * share, (before + layer.d_out) * share + joined)


def _joined(layer: CostLayer, s: Style) -> float:
    """Elements per sample of the largest input a window of the layer (its convolution, a
    pooling) reads on one rank: its band's (tile's) rows and those beyond it, halo and padding,
    joined into one tensor before it runs (runtime.parallel.domain.windows)."""
    most = 0.0
    for w, c in zip(layer.windows, layer.cols or layer.windows, strict=True):
        if w.how not in ("", "ceil", "circular"):
            continue
        rows = max(p.reads[1] - p.reads[0] for p in w.row_map().parts(s.ph))
        across = w.across
        if s.pw > 1:
            cols = c.row_map()
            across *= max(p.reads[1] - p.reads[0] for p in cols.parts(s.pw)) / cols.h_in
        most = max(most, rows * across * w.channels)
    return most


def segment(group: int, most: float) -> float:
    """Bytes a rank maps of a group's shared segment on one host (runtime.comm.small): 2
    parities x (the group's ranks + 1 sum) slots, each the largest call's bytes rounded up to a
    power of two and at least SHM_MIN_BYTES."""
    slot = max(SHM_MIN_BYTES, 1 << math.ceil(math.log2(most)) if most > 1 else 1)
    return 2 * (group + 1) * slot


def _window_kept(
    w: Span, v: float, pr: int, pieces: bool, cols: Span | None = None, pw: int = 1
) -> list[float]:
    """Per rank of Pr bands (tiles, of `pw` columns: `cols` the column map), what a convolution
    or pooling (CostLayer.windows entry `w`, `v` kept per sample whole) keeps on its band: its
    band's share of `v`, and what its output band reads beyond its band (halo and padding rows,
    on tiles columns too): a convolution keeps those alone (`pieces`,
    runtime.parallel.domain.windows._ConvOfPieces), a pooling a copy of band and beyond."""
    win, row, rest = w.row_map(), w.across, 1
    spans = [(row, row, row, row)]  # along a row: (own, read, both, whole); on bands all
    if cols is not None:
        rest = w.across // cols.size_in  # a volume's width, whole on a tile of depth x height
        by_cols = cols.row_map()
        spans = []
        for p in by_cols.parts(pw):
            (a, b), (lo, hi) = p.held, p.reads
            both = max(min(hi, b) - max(lo, a), 0)
            spans.append((b - a, max(hi - lo, 0), both, by_cols.h_in))
    out = []
    for p in win.parts(pr // pw):
        (a, b), (lo, hi) = p.held, p.reads
        rows = max(min(hi, b) - max(lo, a), 0)  # of its own band
        for mine, read, both, whole in spans:
            own = v * (b - a) / win.h_in * mine / whole
            if pieces:
                out.append(own + ((hi - lo) * read - rows * both) * w.channels * rest)
            else:
                kept = (hi - lo) * w.channels * read * rest
                out.append(own if (lo, hi, read) == (a, b, mine) else kept)
    return out
