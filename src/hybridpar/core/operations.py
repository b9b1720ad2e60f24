"""The one table of operations: per operation a layer applies (a convolution, a pooling, a
normalisation, a resampling, a pixel shuffle), the module classes that apply it, its torch
functions, what kind of layer it is, which styles a weighted layer of it takes, how its output
rows read its input rows on a band (its geometry, for core.halo's row maps), why a module of it
cannot run on a band, and the domain style's stand-in for it. The trace (core.leaves,
core.analysis), the rules, the cost model and the styles all read this table; teaching the domain
style an operation is a record here and a stand-in (docs/dense.md, "Teaching the domain style a
new operation").

Torch-free to import (the planner never imports torch): classes and functions are named, and
resolved by core.ops where torch runs; a record's functions read a module's attributes.

| bands         | how the domain style runs it on a band of rows (or a tile)                    |
| ------------- | ----------------------------------------------------------------------------- |
| "window"      | on the band and the halo rows its window reads (core.halo.Window, Pad)        |
| "transposed"  | on the input rows whose taps land in the band (core.halo.Transposed)          |
| "resample"    | on the source rows of torch's own weights (core.halo.Resample)                |
| "stats"       | each example's statistics over the ranks holding its bands                    |
| "global"      | summed (or maxed) over the ranks holding the bands: the value whole on each   |
| "unchanged"   | as it is (row by row, or over the channels)                                   |
| ""            | not at all: it mixes rows                                                     |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "OPERATIONS",
    "RESAMPLED",
    "Operation",
    "by_name",
    "of_function",
    "one_row",
    "pair",
    "pooling",
]

RESAMPLED = ("nearest", "nearest-exact", "bilinear", "bicubic", "trilinear")
"""the interpolation modes a band of rows runs (core.halo.Resample)"""


@dataclass(frozen=True)
class Operation:
    """One operation a layer applies, as every part of hybridpar sees it."""

    name: str  # its torch.nn.functional name: the one vocabulary (LayerSpec.op, CostLayer.op)
    kind: str  # conv | linear | pool | norm | activation | other
    modules: tuple[str, ...] = ()  # torch.nn classes (a dotted path below torch.nn) applying it
    funcs: tuple[str, ...] = ()  # its torch.nn.functional functions (default: its name)
    through: tuple[str, ...] = ()  # functions its modules may apply to their input first
    swap: bool = True  # a style may stand in for it in a module's forward (core.ops.call)
    styles: tuple[str, ...] = ("batch",)  # what a weighted layer of it may take
    bands: str = ""  # how it runs on a band (the table above)
    blocker: Callable | None = None  # (module, in_shape) -> why it cannot run on a band ("":
    # it can)
    geometry: Callable | None = None  # (module, in_shape, out_shape) -> LayerSpec fields
    call: Callable | None = None  # a call in a forward, (func, args, kwargs, in, out) ->
    # (LayerSpec fields, why it cannot run on a band): such a call is a layer of its own (a site)
    stand_in: str = ""  # the domain style's stand-in (runtime/parallel/domain/windows.STAND_INS)

    @property
    def functions(self) -> tuple[str, ...]:
        return self.funcs or (self.name,)


def pair(v, n: int = 2) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, tuple | list) else (v,) * n


def one_row(dims: int) -> dict:
    """A window of one row to one row along each of `dims` dimensions."""
    return dict(kernel=(1,) * dims, stride=(1,) * dims, padding=(0,) * dims, dilation=(1,) * dims)


def _conv(m, x: tuple, y: tuple) -> dict:
    if isinstance(m.padding, str):  # None for 'same' (it may differ per side)
        padding = (0,) * len(m.kernel_size) if m.padding == "valid" else None
    else:
        padding = tuple(m.padding)
    return dict(kernel=tuple(m.kernel_size), stride=tuple(m.stride), padding=padding,
                dilation=tuple(m.dilation), groups=m.groups, padding_mode=m.padding_mode,
                out_units=m.out_channels)  # fmt: skip


def _transposed(m, x: tuple, y: tuple) -> dict:
    out = _conv(m, x, y)
    if len(x) in (3, 4):  # the rows no tap reaches at the bottom (output_padding)
        k, st, p, d = (out[a][0] for a in ("kernel", "stride", "padding", "dilation"))
        out["rows"] = ("transposed", y[1] - ((x[1] - 1) * st - 2 * p + d * (k - 1) + 1))
    return out


def _padded(m, x: tuple) -> str:
    name = type(m).__name__
    if isinstance(m.padding, str) and m.padding != "valid":
        return f"{name} with padding='{m.padding}'"
    ok = ("zeros", "circular")  # a circular padding wraps around: core.halo.RowMap.wrap
    return f"{name} with padding_mode='{m.padding_mode}'" if m.padding_mode not in ok else ""


def _pool(m, x: tuple, y: tuple) -> dict:
    dims = len(x) - 1
    return dict(kernel=pair(m.kernel_size, dims), stride=pair(m.stride or m.kernel_size, dims),
                padding=pair(m.padding, dims), dilation=pair(getattr(m, "dilation", 1), dims),
                rows=("ceil",) if m.ceil_mode else ())  # fmt: skip


def _indices(m, x: tuple) -> str:
    return f"{type(m).__name__} with return_indices" if getattr(m, "return_indices", False) else ""


def _resampling(size, scale, mode: str, align, recompute) -> tuple:
    """(mode, align_corners, height scale, width scale) of an interpolation: the scales torch
    maps rows and columns by (None where it maps by the sizes: a size given, or the scale
    recomputed)."""
    scales = tuple(scale) if isinstance(scale, tuple | list) else (scale, scale)
    by_size = size is not None or scale is None or recompute
    h, w = (None, None) if by_size else (float(scales[0]), float(scales[min(1, len(scales) - 1)]))
    linear = mode in ("bilinear", "bicubic", "trilinear")
    return (mode, bool(align) if linear else None, h, w)


def _upsample(m, x: tuple, y: tuple) -> dict:
    if len(x) not in (3, 4):
        return {}
    how = _resampling(m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor)
    return dict(**one_row(len(x) - 1), rows=("resample", how))


def _interpolate_call(func, args: tuple, kwargs: dict, x: tuple, y: tuple) -> tuple[dict, str]:
    import inspect

    a = inspect.signature(func).bind(*args, **kwargs).arguments
    mode, n = a.get("mode", "nearest"), len(x) + 1
    if n not in (4, 5):
        return one_row(n - 2), f"interpolate of a {n}-d tensor"
    if mode not in RESAMPLED or a.get("antialias"):
        anti = " with antialias" if a.get("antialias") else ""
        return one_row(n - 2), f"interpolate in mode {mode!r}{anti}"
    how = _resampling(a.get("size"), a.get("scale_factor"), mode, a.get("align_corners"),
                      a.get("recompute_scale_factor"))  # fmt: skip
    return dict(**one_row(n - 2), rows=("resample", how)), ""


def _statistics(m, x: tuple, y: tuple) -> dict:
    groups = getattr(m, "num_groups", 1 if hasattr(m, "normalized_shape") else x[0])
    return dict(groups=groups, tracked=bool(getattr(m, "track_running_stats", False)))


def _images(m, x: tuple) -> str:
    """A norm of images or volumes; of 1-d sequences there are no rows to split."""
    return "" if len(x) in (3, 4) else f"{type(m).__name__} mixes rows"


def _batch_norm(m, x: tuple) -> str:
    """BatchNorm2d and 3d (subclasses too) on bands: statistics over every rank; not the others
    (a SyncBatchNorm takes its own group)."""
    from torch import nn

    ok = isinstance(m, nn.BatchNorm2d | nn.BatchNorm3d)
    return "" if ok else f"{type(m).__name__} mixes rows"


def _layer_norm(m, x: tuple) -> str:
    """A layer norm over (C, H, W) takes each example's statistics over its bands' ranks; over
    fewer dims (the width alone) it is refused on bands (a channels-last one on a permuted
    band: core.rows.permuted_blocker)."""
    n = len(m.normalized_shape)
    return "" if n == len(x) else f"{type(m).__name__} over its last {n} dims mixes rows"


def _ones(size) -> bool:
    return size == 1 or (isinstance(size, tuple | list) and set(size) == {1})


def _cells(size) -> bool:
    """An adaptive average pooling of an image to k x l cells (PSPNet's pyramid: 1, 2, 3, 6)."""
    sizes = tuple(size) if isinstance(size, tuple | list) else (size, size)
    return len(sizes) == 2 and all(isinstance(s, int) and s >= 1 for s in sizes)


def pooling(op: Operation, size, indices: bool) -> str:
    """How an adaptive pooling `op` to `size` reduces an image's (volume's) channels: "avg" or
    "first" (the first maximum takes the gradient) to one value each, "avg" to k x l cells
    (AdaptiveAvgPool2d((k, l))); "" when it does not (other sizes, indices returned)."""
    avg = "avg" in op.name
    if op.name == "adaptive_avg_pool2d" and _cells(size):
        return "avg"
    return ("avg" if avg else "" if indices else "first") if _ones(size) else ""


def _global(op_name: str) -> Callable:
    def blocker(m, x: tuple) -> str:
        how = pooling(_BY_NAME[op_name], m.output_size, getattr(m, "return_indices", False))
        return "" if how else f"{type(m).__name__} mixes rows"

    return blocker


def _softmax(m, x: tuple) -> str:
    name = type(m).__name__
    return "" if m.dim in (1, -3) else f"{name} over dim {m.dim}"


def _upsample_mode(m, x: tuple) -> str:
    return "" if m.mode in RESAMPLED else f"{type(m).__name__} in mode {m.mode!r}"


def _shuffle_images(m, x: tuple) -> str:
    return "" if len(x) == 3 else f"{type(m).__name__} of a {len(x) + 1}-d tensor"


def _shuffle(r: int, up: bool, dims: int) -> dict:
    """A pixel shuffle by `r` (`up`) maps output row o to input row o // r, as a transposed
    window of r taps at stride r does; its inverse reads input rows r*o .. r*o + r - 1, a window
    of r at stride r."""
    return dict(kernel=(r,) * dims, stride=(r,) * dims, padding=(0,) * dims,
                dilation=(1,) * dims, rows=("transposed", 0) if up else ())  # fmt: skip


def _shuffle_module(m, x: tuple, y: tuple) -> dict:
    up = hasattr(m, "upscale_factor")
    return _shuffle(m.upscale_factor if up else m.downscale_factor, up, len(x) - 1)


def _shuffle_call(func, args: tuple, kwargs: dict, x: tuple, y: tuple) -> tuple[dict, str]:
    r = args[1] if len(args) > 1 else next(iter(kwargs.values()))
    return _shuffle(int(r), func.__name__ == "pixel_shuffle", len(x) - 1), ""


def _pad_fields(pad: tuple, mode: str, dims: int) -> tuple[dict, str]:
    """A pad (F.pad's `pad`, last dim first) of `dims` spatial dims as a window of one row whose
    padding is its rows before (core.halo.Pad), and why it cannot run on a band ("": it can)."""
    pairs = [tuple(pad[2 * i : 2 * i + 2]) if 2 * i < len(pad) else (0, 0) for i in range(dims)]
    pairs = pairs[::-1]  # the rows first
    why = "" if mode in ("constant", "circular") else f"pad in mode {mode!r} of the rows"
    if mode == "circular" and min(pad) < 0:
        why = "circular pad by a negative amount"
    rows = ("pad", (tuple(b for _, b in pairs), mode == "circular"))
    return dict(one_row(dims), padding=tuple(t for t, _ in pairs), rows=rows), why


def _pad_call(func, args: tuple, kwargs: dict, x: tuple, y: tuple) -> tuple[dict | None, str]:
    """F.pad in a forward of the rows (the height; a volume's depth) or of a tile's columns (the
    width; a volume's height): a layer of its own; None where it pads neither (it keeps the rows
    apart: core.rows.function_blocker), or the columns only in a mode a window does not take
    (core.rows.column_blocker refuses it on tiles)."""
    pad = tuple(args[1] if len(args) > 1 else kwargs["pad"])
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    fields, why = _pad_fields(pad, mode, len(x) - 1)
    tops, (bottoms, _) = fields["padding"], fields["rows"][1]
    cols = tops[1] or bottoms[1]  # a tile's columns (an image's width, a volume's height)
    if not (tops[0] or bottoms[0]) and not (cols and not why):
        return None, ""
    return fields, why


def _pad_module(m, x: tuple) -> tuple[dict, str]:
    """A ConstantPad or CircularPad module's `_pad_fields`."""
    from torch import nn

    circular = isinstance(m, nn.modules.padding._CircularPadNd)
    return _pad_fields(m.padding, "circular" if circular else "constant", len(x) - 1)


def _conv_record(name: str, dims: str, styles: tuple, transposed: bool = False) -> Operation:
    cls = f"Conv{'Transpose' if transposed else ''}{dims}d"
    if dims == "1":
        return Operation(name, "conv", (cls,), swap=False, geometry=_conv)
    return Operation(name, "conv", (cls,), through=() if transposed else ("pad",), styles=styles,
                     bands="transposed" if transposed else "window", blocker=_padded,
                     geometry=_transposed if transposed else _conv,
                     stand_in="transposed" if transposed else "conv")  # fmt: skip


def _pool_record(kind: str, dims: str) -> Operation:
    name = f"{kind.lower()}_pool{dims}d"
    cls = f"{kind}Pool{dims}d"
    if dims == "1":
        return Operation(name, "pool", (cls,), swap=False, geometry=_pool)
    return Operation(name, "pool", (cls,), bands="window", blocker=_indices, geometry=_pool,
                     stand_in="pool")  # fmt: skip


def _adaptive_record(kind: str, dims: str) -> Operation:
    name = f"adaptive_{kind.lower()}_pool{dims}d"
    cls = f"Adaptive{kind}Pool{dims}d"
    if dims == "1":
        return Operation(name, "pool", (cls,), swap=False)
    return Operation(name, "pool", (cls,), bands="global", blocker=_global(name), call=_no_layer)


def _no_layer(*args) -> tuple[dict, str]:  # a global pooling's site: core.rows.global_pool's
    return {}, ""


# fmt: off
_ELEMENTWISE = ("ReLU", "ReLU6", "LeakyReLU", "ELU", "GELU", "SiLU", "Tanh", "Sigmoid",
                "Hardtanh", "Mish")
OPERATIONS: tuple[Operation, ...] = (
    _conv_record("conv2d", "2", ("batch", "model", "domain")),
    _conv_record("conv3d", "3", ("batch", "model", "domain")),
    _conv_record("conv1d", "1", ("batch",)),
    _conv_record("conv_transpose2d", "2", ("batch", "model", "domain"), transposed=True),
    _conv_record("conv_transpose3d", "3", ("batch", "model", "domain"), transposed=True),
    _conv_record("conv_transpose1d", "1", ("batch",), transposed=True),
    Operation("linear", "linear", ("Linear",), styles=("batch", "model"),
              geometry=lambda m, x, y: dict(out_units=y[-1])),
    Operation("batch_norm", "norm", ("modules.batchnorm._BatchNorm",), bands="unchanged",
              blocker=_batch_norm),
    Operation("instance_norm", "norm", ("modules.instancenorm._InstanceNorm",), bands="stats",
              blocker=_images, geometry=_statistics, stand_in="stats"),
    Operation("group_norm", "norm", ("GroupNorm",), bands="stats", geometry=_statistics,
              stand_in="stats"),
    Operation("layer_norm", "norm", ("LayerNorm",), bands="stats", blocker=_layer_norm,
              geometry=_statistics, stand_in="stats"),
    Operation("local_response_norm", "norm", ("LocalResponseNorm",), swap=False,
              bands="unchanged"),
    *(_pool_record(k, d) for k in ("Max", "Avg") for d in "231"),
    *(_adaptive_record(k, d) for k in ("Avg", "Max") for d in "231"),
    Operation("interpolate", "other", ("Upsample",), bands="resample", blocker=_upsample_mode,
              geometry=_upsample, call=_interpolate_call, stand_in="resample"),
    Operation("pixel_shuffle", "other", ("PixelShuffle",), bands="transposed",
              blocker=_shuffle_images, geometry=_shuffle_module, call=_shuffle_call,
              stand_in="shuffle"),
    Operation("pixel_unshuffle", "other", ("PixelUnshuffle",), bands="window",
              blocker=_shuffle_images, geometry=_shuffle_module, call=_shuffle_call,
              stand_in="shuffle"),
    Operation("pad", "other", ("modules.padding._ConstantPadNd", "modules.padding._CircularPadNd"),
              bands="window", blocker=lambda m, x: _pad_module(m, x)[1],
              geometry=lambda m, x, y: _pad_module(m, x)[0], call=_pad_call,
              stand_in="pad"),
    Operation("softmax", "activation", ("Softmax", "LogSoftmax"), swap=False, bands="unchanged",
              blocker=_softmax),
    Operation("elementwise", "activation", _ELEMENTWISE, swap=False, bands="unchanged"),
    Operation("prelu", "activation", ("PReLU",), swap=False, bands="unchanged"),
    Operation("identity", "other", ("Hardswish", "Hardsigmoid", "Dropout", "Dropout1d",
                                    "Dropout2d", "Dropout3d", "Identity"), swap=False,
              bands="unchanged"),
)
# fmt: on
"""every operation hybridpar knows, in the order a module's class is matched (subclasses count)"""

_BY_NAME = {op.name: op for op in OPERATIONS}


def by_name(name: str) -> Operation | None:
    """The operation of that name (LayerSpec.op, CostLayer.op); None for others."""
    return _BY_NAME.get(name)


def of_function(name: str) -> Operation | None:
    """The operation whose calls of the torch.nn.functional function `name` in a forward are
    layers of their own (a resampling, a pixel shuffle, a global pooling); None for others."""
    return next((op for op in OPERATIONS if op.call and name in op.functions), None)
