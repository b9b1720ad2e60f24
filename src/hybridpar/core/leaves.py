"""One leaf layer as the trace describes it (`LayerSpec`): its kind, shapes per sample, weights,
FLOPs, window and what its operation is; what core.layers folds into the equations' layers and
core.rules reads. Built from the module and the shapes one call showed (`leaf_spec`), what its
operation is and needs read off core.operations' table."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hybridpar.core.operations import pair
from hybridpar.core.ops import operation_of

__all__ = ["LayerSpec", "leaf_spec", "module_blocker"]


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
    op: str = ""  # what the module applies (core.operations' name; else its kind)
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
    # what an evaluation holds as this leaf starts and the most while it runs, per sample
    # (elements; core.live)
    live: tuple[float, float] = (0.0, 0.0)
    rows: tuple = ()  # how its output rows read its input rows, where not a sliding window:
    # ("ceil",), ("transposed", output padding), ("resample", (mode, align_corners, scale)),
    # ("spread", the same) from a whole input, ("global", how) (core.rows.global_pool)
    tracked: bool = False  # an instance norm's running statistics are tracked
    whole: bool = False  # its input is a global pooling's value (or computed from such alone):
    # whole on every rank that holds bands of the image, where it runs unchanged
    permuted: int = 0  # where a permute moved its input's rows (0: dim 2, as they come): a
    # channels-last layer norm or Linear, unchanged on a band
    shapes: tuple[tuple[int, int], ...] = ()  # per parameter of its own: (its first dim, the
    # elements of one index of it), what sharding by the first dim splits (FSDP2)

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
        return d_out * math.prod(pair(k, len(in_shape) - 1))
    if kind == "norm":
        return 4 * d_out
    if kind == "activation":
        return d_out
    return 0


def module_blocker(module: nn.Module, in_shape: tuple[int, ...]) -> str:
    """ "" when `module` runs on a band of rows (with halo rows where its window needs them), else
    why not, in a few words naming it (core.operations: what its operation needs)."""
    op = operation_of(module)
    if op is None or not op.bands:
        return f"{type(module).__name__} mixes rows"
    return op.blocker(module, in_shape) if op.blocker is not None else ""


def leaf_spec(
    name: str, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> LayerSpec:
    op = operation_of(module)
    kind = op.kind if op is not None else "other"
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    weights = weight.numel() if isinstance(weight, torch.Tensor) else 0
    biases = bias.numel() if isinstance(bias, torch.Tensor) else 0
    # parameters that are neither called weight nor bias still count (as weights)
    named = {id(p) for p in (weight, bias) if isinstance(p, torch.Tensor)}
    weights += sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in named)
    extra = op.geometry(module, in_shape, out_shape) if op and op.geometry else {}
    return LayerSpec(
        name=name,
        kind=kind,
        type=type(module).__name__,
        in_shape=in_shape,
        out_shape=out_shape,
        weights=weights,
        biases=biases,
        flops=_flops(module, kind, in_shape, out_shape),
        shapes=tuple((len(p), p[0].numel()) for p in module.parameters(recurse=False) if p.dim()),
        op=op.name if op is not None else kind,
        blocker=module_blocker(module, in_shape),
        **extra,
    )
