"""Which operations keep an image's rows apart, so that they run on a band of rows as they run on
the whole image: the condition for a segment to take the domain style, where each rank of a model
group holds a band of rows (Gholami et al. section 2.4). The trace (hybridpar.core.analysis)
asks for every leaf module and every torch function a model's `forward` calls, and records, per
segment, what is not row-local; `core.rules` refuses the domain style for such a segment and
names the operation.

Which modules do is core.operations' table (a convolution or pooling on the band and its halo,
a norm's statistics over the ranks, a global pooling summed over them). This file says it of
the torch functions a forward calls: element-wise functions, cat / chunk / split along batch or
channels and a pad of other dimensions keep rows apart (a constant or circular pad of the rows is
a layer of its own: core.operations' "pad"); a mean, sum or amax over height and
width or an adaptive pooling to 1 (or an average to k x l cells) pools globally (`global_pool`),
and anything on such a whole value alone runs unchanged on every rank. Everything else (flatten
or view of rows, indexing of rows, Softmax over space) ends a domain segment's claim.

A band may be permuted (a channels-last convnet's permute(0, 2, 3, 1)): the trace follows where
its rows went (`moved_rows`), and a layer norm or a Linear over the channels keeps them apart
there (`permuted_blocker`); anything else on a permuted band, or a permuted band at a segment's
cut or as the model's output, ends the claim.

Tiles (an image split by rows and columns, a volume by depth and height) need the columns kept
apart too: everything above does, except a pad of the columns in another mode and a permuted
band, whose columns the trace does not follow (`column_blocker`: blockers of tiles alone).

A whole value (a global pooling's) meets the bands only by broadcasting (x * s, x + s,
s.expand_as(x)) or an upsampling back to the image's size: each rank computes from it what its
band needs, so the gradient a rank sends back into it is its band's part, and the pooling's
backward sums the parts over the ranks.
"""

from __future__ import annotations

from torch import nn

from hybridpar.core.halo import TILED
from hybridpar.core.operations import by_name, pooling
from hybridpar.core.ops import operation_of

__all__ = [
    "DIMS_READ",
    "column_blocker",
    "function_blocker",
    "global_pool",
    "moved_rows",
    "permuted_blocker",
]

_ELEMENTWISE = {
    "abs",
    "add",
    "add_",
    "addcmul",
    "clamp",
    "clamp_",
    "clamp_min",
    "clone",
    "contiguous",
    "detach",
    "div",
    "div_",
    "double",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "elu",
    "exp",
    "float",
    "gelu",
    "half",
    "hardsigmoid",
    "hardswish",
    "hardtanh",
    "leaky_relu",
    "log",
    "maximum",
    "minimum",
    "mish",
    "mul",
    "mul_",
    "neg",
    "pow",
    "relu",
    "relu6",
    "relu_",
    "requires_grad_",
    "rsqrt",
    "sigmoid",
    "sigmoid_",
    "silu",
    "softplus",
    "sqrt",
    "square",
    "sub",
    "sub_",
    "tanh",
    "tanh_",
    "to",
    "true_divide",
    "type_as",
    "where",
    "__add__",
    "__iadd__",
    "__imul__",
    "__isub__",
    "__itruediv__",
    "__mul__",
    "__neg__",
    "__radd__",
    "__rmul__",
    "__rsub__",
    "__rtruediv__",
    "__sub__",
    "__truediv__",
}
_ALONG_DIM = {"cat", "concat", "concatenate", "stack", "chunk", "split", "narrow", "unbind"}
DIMS_READ = _ALONG_DIM | {"pad", "__getitem__", "flatten", "view", "reshape", "sum", "mean", "amax",
                          "softmax"}  # fmt: skip
"""functions that read an activation's dims as (N, C, H, W), not element by element: on a
band a permute changed, they would take another dim for the rows"""


def _dim(args: tuple, kwargs: dict, position: int) -> int | None:
    d = kwargs.get("dim", args[position] if len(args) > position else 0)
    return d if isinstance(d, int) else None


def _ndim(args: tuple) -> int:
    first = args[0] if args else None
    if isinstance(first, list | tuple) and first:
        first = first[0]
    return getattr(first, "ndim", 4)


def function_blocker(func: object, args: tuple, kwargs: dict | None) -> str:
    """ "" when the torch function `func` called with (args, kwargs) keeps rows apart."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", str(func))
    if name in _ELEMENTWISE:
        return ""
    if name in _ALONG_DIM:
        d = _dim(args, kwargs, 2 if name in ("chunk", "split") else 1)
        if d is not None and d % _ndim(args) in (0, 1):
            return ""
        return f"{name} along dim {d}"
    if name == "repeat" and len(args) > 1:  # copies along batch or channels keep rows apart
        times = args[1] if len(args) == 2 and isinstance(args[1], tuple | list) else args[1:]
        if all(t == 1 for t in tuple(times)[2:]):
            return ""
        return "repeat along the rows or columns"
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if all(i == slice(None) for i in index[2:]) and Ellipsis not in index:
            return ""
        return "indexing of rows or columns"
    if name == "pad" and len(args) > 1:
        pad = tuple(args[1])  # (left, right, top, bottom, front, back): last dimension first
        at = 2 * (_ndim(args) - 3)  # the rows': dim 2 (the height, or a volume's depth)
        if len(pad) <= at or pad[at : at + 2] == (0, 0):
            return ""  # other dimensions only
        return "pad of the rows"
    return f"{name} mixes rows"


def column_blocker(func: object, args: tuple) -> str:
    """Why a function that keeps rows apart mixes a tile's columns (an image's width, a volume's
    height), ending a claim on tiles only (core.halo.TILED); "" when it does not."""
    name = getattr(func, "__name__", "")
    at = 2 * (_ndim(args) - 4)  # the columns' pair (an image's width, a volume's height)
    if name == "pad" and len(args) > 1 and tuple(args[1])[at : at + 2] not in ((0, 0), ()):
        return f"{TILED}pad of the columns"
    if name in ("permute", "transpose", "swapaxes", "swapdims"):
        return f"{TILED}{name} of a band"  # its columns are not followed
    return ""


def moved_rows(func: object, args: tuple, kwargs: dict | None, at: int) -> int | None:
    """Where a permute or a transpose of a band puts its rows (dim `at` before; a channels-last
    convnet's permute(0, 2, 3, 1) puts them at 1): no row mixes with another; None for other
    functions."""
    name = getattr(func, "__name__", "")
    x = args[0] if args else None
    n = getattr(x, "ndim", 0)
    if name == "permute":
        dims = (kwargs or {}).get("dims", args[1] if len(args) == 2 else args[1:])
        dims = [d % n for d in (dims if isinstance(dims, tuple | list) else (dims,))]
        return dims.index(at) if sorted(dims) == list(range(n)) else None
    if name in ("transpose", "swapaxes", "swapdims") and len(args) == 3:
        a, b = args[1] % n, args[2] % n
        return b if at == a else a if at == b else at
    return None


def permuted_blocker(module: nn.Module, at: int, ndim: int) -> str:
    """ "" when `module` keeps rows apart on a band whose rows are at dim `at` of `ndim` (a
    channels-last convnet's layer norm and Linear layers over the channels), else why not."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm):
        inside = at < ndim - len(module.normalized_shape)
        return "" if inside else f"{name} over the rows"
    if isinstance(module, nn.Linear):
        return "" if at != ndim - 1 else f"{name} over the rows"
    if (
        isinstance(module, nn.Dropout | nn.Identity)
        or getattr(operation_of(module), "name", "") == "elementwise"
    ):
        return ""
    return f"{name} on a permuted band"


_POOLED = {"mean": "avg", "sum": "sum", "amax": "max"}


def global_pool(func: object, args: tuple, kwargs: dict | None) -> str:
    """How the torch function call `func(*args, **kwargs)` reduces each channel of an image (or a
    volume) over its height and width (and depth) to one value: "avg" (a mean, an adaptive
    average pooling to 1), "sum", "max" (amax: ties share the gradient) or "first" (an adaptive
    max pooling to 1: the first maximum takes it); "" when it does not."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    x = args[0] if args else kwargs.get("input")
    n = getattr(x, "ndim", 0)
    if n not in (4, 5):
        return ""
    if name.startswith(("adaptive_avg_pool", "adaptive_max_pool")) and name.endswith(f"{n - 2}d"):
        size = args[1] if len(args) > 1 else kwargs.get("output_size")
        if kwargs.get("return_indices") or (len(args) > 2 and args[2]):
            return ""
        return pooling(by_name(name), size, False)
    if name not in _POOLED or kwargs.get("dtype") is not None:
        return ""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(dim, tuple | list) or sorted(d % n for d in dim) != list(range(2, n)):
        return ""
    return _POOLED[name]
