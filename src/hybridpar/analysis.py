"""nn.Module + input shape -> the ordered list of its layers, with the sizes the cost model needs.

The model runs once on the meta device (no memory, no arithmetic), with forward hooks on every leaf
module recording per-sample shapes. Shapes are per sample: the batch dimension is dropped.

FLOPs count one multiply-add as 2 and leave biases out, the convention of Krizhevsky's footnote 4
(a 4096x512 slice of a fully-connected layer is "4096 x 512 x 2 FLOPs per sample").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hybridpar.errors import ConfigError

__all__ = ["LayerSpec", "analyze", "layer_kind"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_POOL = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)
_NORM = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
)
_ACTIVATION = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softmax,
    nn.LogSoftmax,
    nn.Hardtanh,
    nn.Mish,
    nn.PReLU,
)


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


def _pair(v: int | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, tuple | list) else (v, v)


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
    groups: int = 1
    out_units: int = (
        0  # output features (linear) or output channels (conv): what model parallelism splits
    )

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
        per_output = (module.in_channels // module.groups) * math.prod(module.kernel_size)
        return 2 * d_out * per_output
    if kind == "linear":
        rows = d_out // out_shape[-1]  # 1 for (features,) inputs; tokens for (T, features)
        return 2 * in_shape[-1] * out_shape[-1] * rows
    if kind == "pool":
        k = getattr(module, "kernel_size", None)
        if k is None:  # adaptive: each output reads about d_in / d_out inputs
            return math.prod(in_shape)
        return d_out * math.prod(_pair(k))
    if kind == "norm":
        return 4 * d_out
    if kind == "activation":
        return d_out
    return 0


def _spec(
    name: str, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> LayerSpec:
    kind = layer_kind(module)
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
            padding=tuple(module.padding) if not isinstance(module.padding, str) else None,
            groups=module.groups,
            out_units=module.out_channels,
        )
    elif kind == "linear":
        extra = dict(out_units=out_shape[-1])
    elif kind == "pool" and getattr(module, "kernel_size", None) is not None:
        extra = dict(
            kernel=_pair(module.kernel_size),
            stride=_pair(module.stride or module.kernel_size),
            padding=_pair(getattr(module, "padding", 0)),
        )
    return LayerSpec(
        name=name,
        kind=kind,
        type=type(module).__name__,
        in_shape=in_shape,
        out_shape=out_shape,
        weights=weights,
        biases=biases,
        flops=_flops(module, kind, in_shape, out_shape),
        **extra,
    )


def analyze(model: nn.Module, input_shape: tuple[int, ...] | list[int]) -> list[LayerSpec]:
    """Ordered leaf layers of `model` for one input of `input_shape` (per sample, no batch dim).

    Runs the forward pass on meta tensors, so a 100-million-parameter model costs nothing; a model
    already on the meta device is used as is. Modules called twice appear twice.
    """
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or any(s <= 0 for s in input_shape):
        raise ConfigError(
            f"input shape {input_shape} must be positive sizes per sample, e.g. 3,224,224"
        )
    records: list[LayerSpec] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        if (
            not args
            or not isinstance(args[0], torch.Tensor)
            or not isinstance(output, torch.Tensor)
        ):
            return
        in_shape = tuple(args[0].shape[1:])
        out_shape = tuple(output.shape[1:])
        records.append(_spec(names[module], module, in_shape, out_shape))

    leaves = [m for m in model.modules() if next(m.children(), None) is None and m is not model]
    if not leaves:
        leaves = [model]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        x = torch.empty((2, *input_shape), device="meta")
        state = {
            k: torch.empty_like(v, device="meta")
            for k, v in [*model.named_parameters(), *model.named_buffers()]
        }
        with torch.no_grad():
            try:
                torch.func.functional_call(model, state, (x,))
            except RuntimeError as exc:
                raise ConfigError(
                    f"cannot run {type(model).__name__} on input shape {input_shape}: "
                    f"{str(exc).splitlines()[0]}"
                ) from exc
    finally:
        for h in handles:
            h.remove()
    return records
