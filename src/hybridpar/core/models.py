"""Model zoo. `parallelize` takes any module tree; the zoo mixes flat nn.Sequentials (the shapes
of the papers' tables) with real module trees (resnet20: stages of BasicBlocks, `torch.flatten` in
`forward`).

| name        | what                                                                              |
| ----------- | --------------------------------------------------------------------------------- |
| alexnet     | one tower with Caffe bvlc_alexnet shapes (227x227x3, 96-256-384-384-256, LRN)     |
| alexnet-owt | Krizhevsky's "one weird trick" one-tower net: 64-192-384-384-256 filters, 224 in  |
| vgg16       | VGG configuration D                                                                |
| resnet20    | CIFAR-style ResNet-20 with batch norm (He et al. 2016, section 4.2), a module tree |
| digits-cnn  | small CNN with a 3-layer FC head for scikit-learn's 8x8 digits                     |
| digits-wide | the digits CNN with a 2048-wide FC head: the FC weights dominate, as in AlexNet   |
| mlp         | Dettmers' MNIST network 784-1024-1024-10                                           |
| unet        | a 3-level U-Net (transposed convolutions up; unet-bilinear: bilinear upsampling)   |
| unet3d      | the U-Net over volumes (Conv3d, instance norm), split by depth                     |
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from hybridpar.core.errors import ConfigError
from hybridpar.core.zoo import MODELS, input_shape, is_factory, zoo_entry

__all__ = [
    "BUILDERS",
    "MODELS",
    "BasicBlock",
    "ResNet20",
    "UNet",
    "build_any",
    "build_model",
    "build_user_model",
    "input_shape",
]


def _conv_out(size: int, kernel: int, stride: int = 1, pad: int = 0) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _pool_out(size: int) -> int:  # 3x3 / stride 2 max-pool, as in both AlexNets
    return _conv_out(size, 3, 2)


def alexnet(input_size: int = 227, num_classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """Single-tower AlexNet with the shapes of Caffe's bvlc_alexnet (groups removed)."""
    s = _pool_out(_conv_out(input_size, 11, 4))  # conv1 + pool1
    s = _pool_out(s)  # conv2 keeps the size (pad 2), pool2
    s = _pool_out(s)  # conv3-5 keep it (pad 1), pool5
    if s < 1:
        raise ConfigError(f"alexnet needs an input of at least 67 pixels, got {input_size}")
    return nn.Sequential(
        nn.Conv2d(in_channels, 96, 11, stride=4), nn.ReLU(inplace=True),
        nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75), nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, padding=2), nn.ReLU(inplace=True),
        nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75), nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Flatten(),
        nn.Linear(256 * s * s, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, num_classes),
    )  # fmt: skip


def alexnet_owt(
    input_size: int = 224, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5
) -> nn.Sequential:
    """Krizhevsky (2014), footnote 1: 64, 192, 384, 384, 256 filters; FC head 4096-4096-classes.

    At small inputs (e.g. 64x64 for CPU benchmarks) the trunk shrinks but the head stays 4096 wide.
    """
    s = _pool_out(_conv_out(input_size, 11, 4, 2))
    s = _pool_out(s)
    s = _pool_out(s)
    if s < 1:
        raise ConfigError(f"alexnet-owt needs an input of at least 63 pixels, got {input_size}")
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Flatten(),
        nn.Dropout(dropout), nn.Linear(256 * s * s, 4096), nn.ReLU(inplace=True),
        nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )  # fmt: skip


def vgg16(input_size: int = 224, num_classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """VGG-16 (Simonyan & Zisserman, configuration D), without batch norm."""
    if input_size < 32 or input_size % 32:
        raise ConfigError(f"vgg16 needs an input size that is a multiple of 32, got {input_size}")
    layers: list[nn.Module] = []
    c = in_channels
    for v in (
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
            c = v
    s = input_size // 32
    layers += [
        nn.Flatten(),
        nn.Linear(512 * s * s, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, num_classes),
    ]  # fmt: skip
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block; option A shortcut (strided identity, zero-padded channels) as in CIFAR ResNets."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU(inplace=True)
        self.stride, self.pad = stride, c_out - c_in

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = nn.functional.pad(
                shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2)
            )
        return self.relu2(out + shortcut)


class ResNet20(nn.Module):
    """ResNet-20 for CIFAR-sized inputs (3 stages x 3 blocks, 16-32-64 channels), laid out like
    torchvision's ResNets: a stem, `layer1..3`, `avgpool`, `fc`, and `torch.flatten` in forward."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        c, stages = 16, []
        for stage, width in enumerate((16, 32, 64)):
            blocks = []
            for block in range(3):
                blocks.append(BasicBlock(c, width, 2 if stage > 0 and block == 0 else 1))
                c = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class UNet(nn.Module):
    """A U-Net (Ronneberger et al. 2015) for dense prediction: `levels` encoder levels of two
    3x3 conv-BN-ReLU each, 2x2 max-pooling down (ceil_mode, so odd heights keep every row),
    a 3x3 stride-2 transposed convolution up (`up="transposed"`, its output padding fitted to
    the skip tensor's size) or a bilinear upsampling to the skip tensor's size and a 3x3
    convolution (`up="bilinear"`), skip connections joined by `torch.cat`, a 1x1 convolution to
    the classes. Built for one input size (the upsamplings' sizes follow it). With `dims=3` the
    same over volumes (Cicek et al. 2016's 3-D U-Net: Conv3d, MaxPool3d, ConvTranspose3d or
    trilinear upsampling), `input_size` (D, H, W) or one side."""

    def __init__(
        self,
        input_size: int | tuple[int, ...] = 64,
        num_classes: int = 3,
        in_channels: int = 3,
        width: int = 8,
        levels: int = 3,
        up: str = "transposed",
        align_corners: bool = False,
        norm: str = "batch",
        dims: int = 2,
    ) -> None:
        super().__init__()
        conv, transposed, pool = _LAYERS[dims][:3]
        sizes = [
            tuple(input_size) if isinstance(input_size, tuple | list) else (input_size,) * dims
        ]
        for _ in range(levels - 1):
            sizes.append(tuple(-(-s // 2) for s in sizes[-1]))
        widths = [width * 2**i for i in range(levels)]
        self.down = nn.ModuleList()
        c = in_channels
        for i, cw in enumerate(widths):
            down = [pool(2, ceil_mode=True)] if i else []
            self.down.append(nn.Sequential(*down, *_double_conv(c, cw, norm, dims)))
            c = cw
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        mode = "trilinear" if dims == 3 else "bilinear"
        for i in reversed(range(levels - 1)):
            skip, low, cl = sizes[i], sizes[i + 1], widths[i + 1]
            if up == "transposed":
                pad = tuple(s - (2 * t - 1) for s, t in zip(skip, low, strict=True))  # 2t - 1 (+1)
                self.up.append(transposed(cl, widths[i], 3, 2, 1, output_padding=pad))
            else:
                resize = nn.Upsample(skip, mode=mode, align_corners=align_corners)
                self.up.append(nn.Sequential(resize, conv(cl, widths[i], 3, padding=1)))
            self.merge.append(nn.Sequential(*_double_conv(2 * widths[i], widths[i], norm, dims)))
        self.head = conv(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for level in self.down:
            x = level(x)
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1]), strict=True):
            x = merge(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


# spatial dimensions -> convolution, transposed convolution, max pooling, batch and instance norm
_LAYERS = {
    2: (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.BatchNorm2d, nn.InstanceNorm2d),
    3: (nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.BatchNorm3d, nn.InstanceNorm3d),
}


def _double_conv(c_in: int, c_out: int, norm: str = "batch", dims: int = 2) -> list[nn.Module]:
    """Two 3x3 conv-norm-ReLU: batch norm, instance norm (affine) or group norm (4 groups)."""
    conv, _, _, batch, instance = _LAYERS[dims]

    def normed(c: int) -> nn.Module:
        if norm == "instance":
            return instance(c, affine=True)
        return nn.GroupNorm(4, c) if norm == "group" else batch(c)

    return [
        conv(c_in, c_out, 3, padding=1, bias=False), normed(c_out), nn.ReLU(),
        conv(c_out, c_out, 3, padding=1, bias=False), normed(c_out), nn.ReLU(),
    ]  # fmt: skip


def resnet20(input_size: int = 32, num_classes: int = 10, in_channels: int = 3) -> ResNet20:
    if input_size < 4:
        raise ConfigError(f"resnet20 needs an input of at least 4 pixels, got {input_size}")
    return ResNet20(num_classes, in_channels)


def digits_cnn(input_size: int = 8, num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """Two 3x3 convs and a 3-layer FC head, for scikit-learn's 8x8 digits."""
    return _digits("digits-cnn", input_size, num_classes, in_channels, (256, 128), ())


def digits_wide(input_size: int = 8, num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """digits-cnn's convolutions with a 2048-wide FC head (6.3 M of its 6.3 M parameters): pure
    batch parallelism all-reduces 25 MB of gradients a step, a model split of the head moves a few
    hundred KB of activations, so the planner picks a hybrid plan even on one machine."""
    return _digits("digits-wide", input_size, num_classes, in_channels, (2048, 2048), (0.25,))


def _digits(name, input_size, num_classes, in_channels, widths, dropout) -> nn.Sequential:
    """The digits nets: two 3x3 convs and a pool, then FC layers of `widths` with ReLU (and a
    dropout of `dropout` after the first), then the classifier."""
    if input_size < 2 or input_size % 2:
        raise ConfigError(f"{name} needs an even input size, got {input_size}")
    s = input_size // 2
    (a, b), drop = widths, [nn.Dropout(p) for p in dropout]
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * s * s, a), nn.ReLU(), *drop,
        nn.Linear(a, b), nn.ReLU(),
        nn.Linear(b, num_classes),
    )  # fmt: skip


def mlp(input_size: int = 28, num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """Dettmers (2016): 784-1024-1024-10 with ReLU (dropout left out: it is a training choice)."""
    d = in_channels * input_size * input_size
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, num_classes),
    )  # fmt: skip


BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "alexnet": alexnet,
    "alexnet-owt": alexnet_owt,
    "vgg16": vgg16,
    "resnet20": resnet20,
    "digits-cnn": digits_cnn,
    "digits-wide": digits_wide,
    "mlp": mlp,
    "unet": lambda input_size, num_classes, in_channels: UNet(input_size, num_classes, in_channels),
    "unet-bilinear": lambda input_size, num_classes, in_channels: UNet(
        input_size, num_classes, in_channels, up="bilinear"
    ),
    "unet3d": lambda input_size, num_classes, in_channels: UNet(
        input_size, num_classes, in_channels, norm="instance", dims=3
    ),
}
assert set(BUILDERS) == set(MODELS), "every zoo entry has a builder"


def build_model(
    name: str,
    *,
    input_size: int | None = None,
    num_classes: int | None = None,
    in_channels: int | None = None,
) -> nn.Module:
    """Build a zoo model. Wrap in `with torch.device("meta"):` to get shapes without memory."""
    info = zoo_entry(name)
    return BUILDERS[name](
        input_size=input_size or info.input_size,
        num_classes=num_classes or info.num_classes,
        in_channels=in_channels or info.in_channels,
    )


def user_factory(spec: str, flag: str = "--model") -> Callable:
    """The function `package.module:factory` names (the working directory importable, as torchrun
    and uvicorn make it); a one-line ConfigError for what cannot be imported or called."""

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r}: write package.module:factory, e.g. mynets:small_cnn")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # spawned ranks inherit sys.path
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error ends in one line
        raise ConfigError(
            f"{flag} {spec!r}: cannot import {module_name} ({type(e).__name__}: {e}); "
            "run from the folder that holds it or put it on PYTHONPATH"
        ) from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{flag} {spec!r}: {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{flag} {spec!r}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def build_user_model(spec: str, num_classes: int | None = None) -> nn.Module:
    """Call the user's factory (with num_classes= when it takes that argument and the data gives
    the classes); the result must be an nn.Module."""

    fn = user_factory(spec)
    kwargs = {}
    if num_classes is not None:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "num_classes" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs["num_classes"] = num_classes
    try:
        model = fn(**kwargs)
    except Exception as e:
        raise ConfigError(
            f"--model {spec!r}: calling it failed ({type(e).__name__}: {e}); it must build the "
            "model without arguments (or with num_classes=)"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_any(name: str, shape: tuple[int, ...], num_classes: int | None) -> nn.Module:
    """A zoo model for one example's `shape` and the classes, or the user's factory's model."""
    if is_factory(name):
        return build_user_model(name, num_classes)
    return build_model(
        name,
        input_size={3: shape[-1], 4: tuple(shape[1:])}.get(len(shape)),
        num_classes=num_classes,
        in_channels=shape[0],
    )
