"""One leaf layer as the trace describes it (`LayerSpec`): its kind, shapes per sample, weights,
FLOPs, window and what its operation is; what core.layers folds into the equations' layers and
core.rules reads. Built from the module and the shapes one call showed (`leaf_spec`), a function
call's resampling read off its arguments (`resample_call`)."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hybridpar.core.rows import (
    ELEMENTWISE_ACTIVATIONS,
    RESAMPLED,
    module_blocker,
)

__all__ = ["LayerSpec", "layer_kind", "leaf_spec", "one_row", "resample_call"]


_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.modules.conv._ConvTransposeNd)
_POOL = tuple(  # MaxPool1d ... AdaptiveMaxPool3d
    getattr(nn, f"{kind}Pool{d}d")
    for kind in ("Max", "Avg", "AdaptiveAvg", "AdaptiveMax")
    for d in (1, 2, 3)
)
_NORM = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
)
_ACTIVATION = (*ELEMENTWISE_ACTIVATIONS, nn.Softmax, nn.LogSoftmax, nn.PReLU)


def layer_kind(module: nn.Module) -> str:
    """conv | linear | pool | norm | activation | other."""
    if isinstance(module, _CONV):
        return "conv"
    if isinstance(module, nn.Linear) or getattr(module, "hybridpar_kind", None) == "linear":
        return "linear"
    if isinstance(module, _POOL):
        return "pool"
    if isinstance(module, _NORM):
        return "norm"
    if isinstance(module, _ACTIVATION):
        return "activation"
    return "other"


def _pair(v: int | tuple[int, ...], n: int = 2) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, tuple | list) else (v,) * n


@dataclass(frozen=True)
class LayerSpec:
    """One leaf layer. Shapes are per sample (C, H, W) or (features,)."""

    name: str
    kind: str
    type: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    weights: int = 0
    biases: int = 0
    flops: int = 0
    kernel: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    padding: tuple[int, ...] | None = None
    dilation: tuple[int, ...] | None = None
    groups: int = 1
    padding_mode: str = "zeros"
    op: str = ""  # linear, conv1d, conv2d, conv3d, conv_transpose, or the kind: what the module is
    out_units: int = 0  # output features (linear) or output channels (conv): what a split splits
    calls: int = 1  # how often the module runs in one forward (weights shared between calls)
    blocker: str = ""  # why the module cannot run on a band of rows ("": it can; core.rows)
    blockers: tuple[str, ...] = ()  # every such reason in this call's segment, functions included
    segment: int = 0  # the segment (run of layers between clean cuts) this call belongs to
    entry: str | None = None  # set on a segment's first leaf: the module whose pre-hook starts it
    entry_elements: int = 0  # per example, of the activation entering the segment there
    entry_whole: bool = False  # set with entry: that activation is a global pooling's value,
    # whole on every rank of a domain layout before it (no rows to gather)
    head_in: str | None = None  # set with entry where the entry's parent is an nn.Sequential: its
    # name (a hand-off sent in rounds runs its later children too, runtime/parallel/rounds.py)
    input_grad: bool = True  # whether the input depends on parameters (so dX is needed)
    own: str = ""  # why a style cannot swap the layer's own operation ("": it can; core.ops)
    unsplit: str = ""  # why a model split of a conv or linear layer is not exact ("": it is)
    pinned: str = ""  # set on a segment's first leaf: why its batch groups may not change there
    loose: tuple[tuple[str, int], ...] = ()  # (name, elements) of parameters no layer holds (a
    # position embedding of the model's own) used in this leaf's segment next after it
    saved: float = 0.0  # what autograd keeps for backward in this leaf, per sample (elements)
    rows: tuple = ()  # how its output rows read its input rows, where not a sliding window:
    # ("ceil",), ("transposed", output padding), ("resample", (mode, align_corners, scale)),
    # ("spread", the same) from a whole input, ("global", how) (core.rows.global_pool)
    tracked: bool = False  # an instance norm's running statistics are tracked
    whole: bool = False  # its input is a global pooling's value (or computed from such alone):
    # whole on every rank that holds bands of the image, where it runs unchanged
    permuted: int = 0  # where a permute moved its input's rows (0: dim 2, as they come): a
    # channels-last layer norm or Linear, unchanged on a band

    @property
    def params(self) -> int:
        return self.weights + self.biases

    @property
    def d_in(self) -> int:
        return math.prod(self.in_shape)

    @property
    def d_out(self) -> int:
        return math.prod(self.out_shape)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(params=self.params, d_in=self.d_in, d_out=self.d_out)
        return d


def _flops(
    module: nn.Module, kind: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> int:
    d_out = math.prod(out_shape)
    if kind == "conv":
        transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
        channels = module.out_channels if transposed else module.in_channels
        per = (channels // module.groups) * math.prod(module.kernel_size)
        return 2 * (math.prod(in_shape) if transposed else d_out) * per
    if kind == "linear":
        rows = d_out // out_shape[-1]  # 1 for (features,) inputs; tokens for (T, features)
        return 2 * in_shape[-1] * out_shape[-1] * rows
    if kind == "pool":
        k = getattr(module, "kernel_size", None)
        if k is None:  # adaptive: each output reads about d_in / d_out inputs
            return math.prod(in_shape)
        return d_out * math.prod(_pair(k, len(in_shape) - 1))
    if kind == "norm":
        return 4 * d_out
    if kind == "activation":
        return d_out
    return 0


def _op(module: nn.Module, kind: str) -> str:
    """What the module is, as far as splitting it goes (a subclass counts as its base)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batch_norm"
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return "instance_norm"
    if isinstance(module, nn.GroupNorm):
        return "group_norm"
    for cls, op in (
        (nn.Conv2d, "conv2d"),
        (nn.Conv1d, "conv1d"),
        (nn.Conv3d, "conv3d"),
        (nn.modules.conv._ConvTransposeNd, "conv_transpose"),
        (nn.Linear, "linear"),
    ):
        if isinstance(module, cls):
            return op
    return "linear" if kind == "linear" else kind


def one_row(dims: int) -> dict:
    """A resampling's window: one row to one row along each of `dims` dimensions."""
    return dict(kernel=(1,) * dims, stride=(1,) * dims, padding=(0,) * dims, dilation=(1,) * dims)


def _resampling(size, scale, mode: str, align, recompute) -> tuple:
    """(mode, align_corners, height scale, width scale) of an interpolation: the scales torch
    maps rows and columns by (None where it maps by the sizes: a size given, or the scale
    recomputed)."""
    scales = tuple(scale) if isinstance(scale, tuple | list) else (scale, scale)
    by_size = size is not None or scale is None or recompute
    h, w = (None, None) if by_size else (float(scales[0]), float(scales[min(1, len(scales) - 1)]))
    linear = mode in ("bilinear", "bicubic", "trilinear")
    return (mode, bool(align) if linear else None, h, w)


def resample_call(args: tuple, kwargs: dict) -> tuple[tuple, str]:
    """An F.interpolate call's (mode, align_corners, height scale), and why it cannot run on a
    band of rows ("": it can)."""
    a = inspect.signature(F.interpolate).bind(*args, **kwargs).arguments
    mode = a.get("mode", "nearest")
    if a["input"].dim() not in (4, 5):
        return (), f"interpolate of a {a['input'].dim()}-d tensor"
    if mode not in RESAMPLED or a.get("antialias"):
        return (), f"interpolate in mode {mode!r}{' with antialias' if a.get('antialias') else ''}"
    size, scale = a.get("size"), a.get("scale_factor")
    return _resampling(
        size, scale, mode, a.get("align_corners"), a.get("recompute_scale_factor")
    ), ""


def _conv_padding(module: nn.Module) -> tuple[int, ...] | None:
    """A convolution's padding per side; None for padding='same' (it may differ per side)."""
    if isinstance(module.padding, str):
        return (0,) * len(module.kernel_size) if module.padding == "valid" else None
    return tuple(module.padding)


def leaf_spec(
    name: str, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> LayerSpec:
    kind = layer_kind(module)
    dims = len(in_shape) - 1  # spatial dimensions
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    weights = weight.numel() if isinstance(weight, torch.Tensor) else 0
    biases = bias.numel() if isinstance(bias, torch.Tensor) else 0
    # parameters that are neither called weight nor bias still count (as weights)
    named = {id(p) for p in (weight, bias) if isinstance(p, torch.Tensor)}
    weights += sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in named)
    extra: dict = {}
    if kind == "conv":
        extra = dict(
            kernel=tuple(module.kernel_size),
            stride=tuple(module.stride),
            padding=_conv_padding(module),
            dilation=tuple(module.dilation),
            groups=module.groups,
            padding_mode=module.padding_mode,
            out_units=module.out_channels,
        )
    elif kind == "linear":
        extra = dict(out_units=out_shape[-1])
    elif kind == "pool" and getattr(module, "kernel_size", None) is not None:
        extra = dict(
            kernel=_pair(module.kernel_size, dims),
            stride=_pair(module.stride or module.kernel_size, dims),
            padding=_pair(getattr(module, "padding", 0), dims),
            dilation=_pair(getattr(module, "dilation", 1), dims),
            rows=("ceil",) if getattr(module, "ceil_mode", False) else (),
        )
    elif isinstance(module, nn.modules.instancenorm._InstanceNorm | nn.GroupNorm):
        extra = dict(groups=getattr(module, "num_groups", in_shape[0]))
        extra["tracked"] = bool(getattr(module, "track_running_stats", False))
    elif isinstance(module, nn.Upsample) and dims in (2, 3):
        m = module
        how = _resampling(m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor)
        extra = dict(**one_row(dims), rows=("resample", how))
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and dims in (2, 3):
        k, st, p, d = (extra[a][0] for a in ("kernel", "stride", "padding", "dilation"))
        reached = (in_shape[1] - 1) * st - 2 * p + d * (k - 1) + 1  # output_padding aside
        extra["rows"] = ("transposed", out_shape[1] - reached)
    return LayerSpec(
        name=name,
        kind=kind,
        type=type(module).__name__,
        in_shape=in_shape,
        out_shape=out_shape,
        weights=weights,
        biases=biases,
        flops=_flops(module, kind, in_shape, out_shape),
        op=_op(module, kind),
        blocker=module_blocker(module),
        **extra,
    )
