"""The model zoo by name, torch-free: each model's default input and classes, so that planning a zoo
model (`hybridpar plan --model alexnet`) reads its shapes without importing torch. The builders
are in hybridpar.core.models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridpar.core.config import meta
from hybridpar.core.errors import ConfigError

__all__ = [
    "MODELS",
    "ModelInfo",
    "file_label",
    "input_shape",
    "is_factory",
    "parse_input_shape",
    "shape_option",
    "size_option",
    "zoo_entry",
]


@dataclass(frozen=True)
class ModelInfo:
    input_size: int  # default spatial size
    in_channels: int
    num_classes: int
    summary: str
    dims: int = 2  # spatial dimensions: images (C, H, W) or volumes (C, D, H, W)


MODELS: dict[str, ModelInfo] = {
    "alexnet": ModelInfo(227, 3, 1000, "AlexNet, one tower, Caffe bvlc_alexnet shapes"),
    "alexnet-owt": ModelInfo(224, 3, 1000, "Krizhevsky's one-weird-trick net"),
    "vgg16": ModelInfo(224, 3, 1000, "VGG-16 (configuration D)"),
    "resnet20": ModelInfo(32, 3, 10, "CIFAR ResNet-20 with batch norm"),
    "digits-cnn": ModelInfo(8, 1, 10, "small CNN for the 8x8 digits"),
    "digits-wide": ModelInfo(8, 1, 10, "digits CNN with a 2048-wide FC head"),
    "mlp": ModelInfo(28, 1, 10, "Dettmers' 784-1024-1024-10 MLP"),
    "unet": ModelInfo(64, 1, 11, "U-Net for dense prediction (digits-seg's 11 classes a pixel)"),
    "unet-bilinear": ModelInfo(64, 1, 11, "the U-Net with bilinear upsampling"),
    "unet3d": ModelInfo(32, 1, 3, "3-D U-Net with instance norm for volumes", dims=3),
}


def zoo_entry(name: str) -> ModelInfo:
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name]


def input_shape(
    name: str, input_size: int | None = None, in_channels: int | None = None
) -> tuple[int, ...]:
    """Per-sample input shape (C, H, W) of a zoo model ((C, D, H, W) of a volume's)."""
    info = zoo_entry(name)
    s = input_size or info.input_size
    return (in_channels or info.in_channels, *(s,) * info.dims)


def is_factory(name: str) -> bool:
    """Whether `--model` names a user's factory, package.module:function, not a zoo model."""
    return ":" in name


def size_option(default: str) -> Any:
    """A configuration's --input-size field."""
    return meta(None, f"image side, e.g. 64 (default: {default})", positive=True)


def shape_option(note: str = "") -> Any:
    """A configuration's --input-shape field (parse_input_shape reads it)."""
    return meta(None, "one example's shape C,H,W for --model package.module:factory" + note)


def parse_input_shape(text: str | tuple | list, flag: str = "--input-shape") -> tuple[int, ...]:
    """'3,32,32' (or a sequence) -> (3, 32, 32): one example's shape, positive sizes."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        shape = tuple(int(str(p).strip()) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise ConfigError(
            f"{flag} must be positive sizes per example such as 3,32,32; got {text!r}"
        )
    return shape


def file_label(name: str) -> str:
    """A model name fit for a file name (a factory's `pkg.mod:fn` -> `pkg.mod.fn`)."""
    return name.replace(":", ".").replace("/", "_")
