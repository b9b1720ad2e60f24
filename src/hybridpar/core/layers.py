"""A model's weighted layers as both halves see them: the planner prices them, the runtime applies
a style to each. Torch-free: a `CostLayer` is a frozen record, built from the trace of the model
(hybridpar.core.analysis) by `cost_layers`, cached on disk for the zoo and carried from the
parent to the ranks.

Only layers with weights (conv, linear) are layers i = 1..L of Gholami et al.'s equations. Pooling,
activation, norm and reshape layers ride along with the weighted layer before them, or with the one
after them when a segment boundary lies in between: a layer rides with the weighted layer whose
layout it runs in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from hybridpar.core.errors import ConfigError
from hybridpar.core.halo import Pooled, Span
from hybridpar.core.operations import by_name

if TYPE_CHECKING:
    from hybridpar.core.leaves import LayerSpec

__all__ = ["CostLayer", "Norm", "Unswapped", "cost_layers"]


@dataclass(frozen=True)
class Norm:
    """A normalisation riding along with a layer."""

    size: int  # a batch norm's channels; an instance or group norm's statistics per example
    grad: bool  # its input needs a gradient (dX)
    whole: bool = False  # a batch norm of a pooled value, which every rank of a domain layout
    # holds whole: its statistics are the batch group's alone
    tracked: bool = False  # an instance norm's running statistics


@dataclass(frozen=True)
class Unswapped:
    """A member whose own operation a style cannot swap (core.ops), and why."""

    member: str
    op: str
    why: str


@dataclass(frozen=True)
class CostLayer:
    """A weighted layer as the equations see it."""

    name: str
    kind: str  # conv | linear
    params: int  # |W_i|, weights + biases
    d_in: int  # d_{i-1}
    d_out: int  # d_i, before pooling
    x_shape: tuple[int, ...]  # (C, H, W) or (features,)
    y_shape: tuple[int, ...]
    kernel: tuple[int, ...] | None
    out_units: int  # what model parallelism splits: output channels or features
    flops: int  # forward FLOPs per sample, this layer and the unweighted ones riding along
    members: tuple[str, ...] = field(default=())  # leaf layers folded into this one
    # parameters of the unweighted layers riding along (batch norm): part of `params`, but they act
    # on the gathered output, so a model-parallel layout replicates them instead of splitting them
    extra_params: int = 0
    segment: int | None = None  # layers of one segment share one layout (None: its own)
    entry: str | None = None  # first layer of a segment: the module where its layout is set
    entry_elements: int = 0  # per example, of the activation redistributed there
    entry_whole: bool = False  # that activation is whole on every rank of a domain layout (a
    # global pooling's value): out of it no rows are gathered
    head_in: str | None = None  # the nn.Sequential holding the entry (core.handoff.head)
    input_grad: bool = True  # False for the first layer: nothing is back-propagated into the input
    norms: tuple[Norm, ...] = ()  # batch norms riding along
    # instance and group norms riding along: on bands their statistics are all-reduced over the
    # ranks holding an example's bands, the running ones over the batch group
    spatial_norms: tuple[Norm, ...] = ()
    op: str = ""  # what the weighted module is (core.operations): linear, conv2d, conv3d, ...
    groups: int = 1  # a convolution's groups
    padding_mode: str = "zeros"
    calls: int = 1  # how often the weighted module runs in one forward
    # what in this layer's segment does not run on a band of rows (core.rows): the domain
    # style needs it empty (on bands: those not starting with core.halo.TILED)
    blockers: tuple[str, ...] = ()
    # how the leaves of this layer that read other rows (the convolution, poolings and
    # resamplings riding along) read them along the height, in forward order; the domain
    # style's halos follow from them (core.halo.Span.row_map)
    windows: tuple[Span, ...] = ()
    cols: tuple[Span, ...] = ()  # the same along the width of 2-d images, for tiles
    # why the weighted module cannot be split by output units (core.ops.why_not_split), and the
    # members whose own operation a style cannot swap (core.ops)
    unsplit: str = ""
    own: tuple[Unswapped, ...] = ()
    pinned: str = ""  # on a segment's first layer: why its batch groups may not change there
    loose: tuple[str, ...] = ()  # parameters no module of the layer holds, priced with it
    # per member, what autograd keeps for backward per sample (elements; core.analysis._saved)
    saved: tuple[tuple[str, float], ...] = ()
    # what an evaluation holds as the weighted module starts, and the most while any member
    # runs, per sample (elements; core.live)
    live: tuple[float, float] = (0.0, 0.0)
    pools: tuple[Pooled, ...] = ()  # global poolings riding along (core.halo.Pooled)
    shards: tuple[tuple[tuple[int, int], ...], ...] = ()  # per member with parameters, their
    # (first dim, elements per index of it): what sharded states gather and scatter (FSDP2)
    # members (the weighted module included) that run unchanged on every rank of a domain
    # layout: on a global pooling's value (whole there), or over the channels of a band a
    # permute made channels-last (its rows kept apart)
    unchanged: tuple[str, ...] = ()
    out: int = 0  # elements per example of what the layer's last member outputs (of the last
    # layer: the model's output, what a loss on the joined outputs gathers)

    def __post_init__(self) -> None:
        if not self.op:  # a layer described by hand: what its kind and input say
            ops = {1: "conv1d", 2: "conv1d", 3: "conv2d", 4: "conv3d"}
            op = "linear" if self.kind == "linear" else ops.get(len(self.x_shape), self.kind)
            object.__setattr__(self, "op", op if self.kind in ("conv", "linear") else self.kind)

    @property
    def spatial(self) -> bool:
        return self.kind == "conv" and len(self.x_shape) == 3

    @staticmethod
    def from_dict(d: dict) -> CostLayer:
        """The layer `dataclasses.asdict` (JSON) gave."""

        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, list) else v

        records = {"windows": Span, "cols": Span, "pools": Pooled, "norms": Norm}
        records.update(spatial_norms=Norm, own=Unswapped)
        out = {k: tup(v) for k, v in d.items()}
        for k, cls in records.items():
            out[k] = tuple(cls(**{a: tup(b) for a, b in r.items()}) for r in d.get(k, ()))
        return CostLayer(**out)


# fields a leaf and a layer share that the layer takes from its segment's first leaf, and those
# it folds from every member (`_ride`) or names otherwise
_FROM_FIRST = {"entry", "entry_elements", "entry_whole", "head_in", "pinned"}
_FOLDED = {"loose", "saved", "own", "unsplit"}


def _layer(s: LayerSpec, first: LayerSpec) -> CostLayer:
    """The weighted leaf `s` as a layer of the equations: every field the two records share
    from it (the segment's entry from its first leaf, `first`), its loose parameters priced
    with it, its shapes and why a split is not exact."""
    shared = {f.name for f in fields(CostLayer)} & {f.name for f in fields(s)} - _FOLDED
    loose = sum(n for _, n in s.loose)
    return CostLayer(
        **{k: getattr(first if k in _FROM_FIRST else s, k) for k in shared},
        params=s.params + loose,
        extra_params=loose,
        loose=tuple(k for k, _ in s.loose),
        d_in=s.d_in,
        d_out=s.d_out,
        x_shape=s.in_shape,
        y_shape=s.out_shape,
        unsplit=s.own or s.unsplit,
        out=s.d_out,
    )


def cost_layers(specs: list[LayerSpec]) -> list[CostLayer]:
    """Fold the leaf layers into the weighted layers of the equations: an unweighted leaf rides
    along with the weighted layer before it in its segment, or else with the next one."""
    out: list[CostLayer] = []
    pending: list[LayerSpec] = []
    for s in specs:
        if s.kind in ("conv", "linear") and s.params > 0:
            layer = _layer(s, pending[0] if pending else s)
            for x in pending:
                layer = _ride(layer, x)
            out.append(_ride(layer, s, weighted=True))
            pending = []
        elif out and out[-1].segment == s.segment and not pending:
            out[-1] = _ride(out[-1], s)
        else:
            pending.append(s)
    if not out:
        raise ConfigError("the model has no conv or linear layer with weights: nothing to plan")
    for s in pending:  # after the last weighted layer
        out[-1] = _ride(out[-1], s)
    return out


def _window(s: LayerSpec, axis: int = 0) -> tuple[Span, ...]:
    """How a 2-d (3-d) convolution, pooling or resampling leaf reads rows, as CostLayer.windows
    holds it; `axis` 1: its columns (a volume's height: CostLayer.cols)."""
    dims = len(s.in_shape) - 1
    if s.kernel is None or len(s.kernel) != dims or dims not in (2, 3) or s.padding is None:
        return ()
    if s.whole:  # unchanged on every rank
        return ()
    c, shape = s.in_shape[0], s.in_shape[1:]
    h = shape[axis]
    w = math.prod(shape) // h  # the elements of one row (column; a volume's depth slice)
    d = s.dilation[axis] if s.dilation else 1
    how, extra = (s.rows[0], s.rows[1] if len(s.rows) > 1 else None) if s.rows else ("", None)
    k, st, p = s.kernel[axis], s.stride[axis], s.padding[axis]
    h_out = s.out_shape[1 + axis]
    if how == "transposed" and axis:  # the columns no tap reaches (the output padding)
        extra = h_out - ((h - 1) * st - 2 * p + d * (k - 1) + 1)
    elif how in ("resample", "spread") and axis:
        extra = (*extra[:2], extra[3])  # the width's scale
    elif how == "pad":
        extra = (extra[0][axis], extra[1])  # the rows after, circular
    if s.padding_mode == "circular":
        how = "circular"
    return (Span(s.name, k, st, p, d, h, h_out, c, w, how, extra),)


def _ride(layer: CostLayer, s: LayerSpec, weighted: bool = False) -> CostLayer:
    """`s` folded into `layer` (members in forward order); the weighted layer itself adds its
    name (and its height window)."""
    own = (*layer.own, Unswapped(s.name, s.op, s.own)) if s.own else layer.own
    saved = (*layer.saved, (s.name, s.saved))
    unchanged = (*layer.unchanged, s.name) if s.whole or s.permuted else layer.unchanged
    if weighted:
        members, windows = (*layer.members, s.name), (*layer.windows, *_window(s))
        cols = (*layer.cols, *_window(s, 1))
        fields = {"members": members, "windows": windows, "cols": cols, "own": own, "saved": saved}
        fields["shards"] = (*layer.shards, s.shapes) if s.shapes else layer.shards
        fields["live"] = (s.live[0], max(layer.live[1], s.live[1]))
        return CostLayer(**{**layer.__dict__, **fields, "unchanged": unchanged})
    norms, spatial, pools = layer.norms, layer.spatial_norms, layer.pools
    if s.op == "batch_norm":
        norms = (*norms, Norm(s.in_shape[0], s.input_grad, whole=s.whole))
    stats = getattr(by_name(s.op), "bands", "") == "stats"  # instance, group, layer norms
    if stats and not s.whole and not s.permuted:
        spatial = (*spatial, Norm(s.groups, s.input_grad, tracked=s.tracked))
    if s.op == "global_pool":
        rest = math.prod(s.in_shape[2:])
        pool = Pooled(s.name, s.rows[1], *s.in_shape[:2], s.input_grad, s.out_shape[1:], rest)
        pools = (*pools, pool)
    loose = sum(n for _, n in s.loose)
    return CostLayer(
        **{
            **layer.__dict__,
            "flops": layer.flops + s.flops,
            "params": layer.params + s.params + loose,
            "members": (*layer.members, s.name),
            "extra_params": layer.extra_params + s.params + loose,
            "loose": (*layer.loose, *(k for k, _ in s.loose)),
            "norms": norms,
            "spatial_norms": spatial,
            "windows": (*layer.windows, *_window(s)),
            "cols": (*layer.cols, *_window(s, 1)),
            "own": own,
            "saved": saved,
            "live": (layer.live[0], max(layer.live[1], s.live[1])),
            "pools": pools,
            "unchanged": unchanged,
            "out": s.d_out,
            "shards": (*layer.shards, s.shapes) if s.shapes else layer.shards,
        }
    )
