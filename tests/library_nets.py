"""Segmentation nets written the way library code writes them (issue 71), small and by hand: no
library is imported, the patterns are theirs.

- `NNUNetish`: nnU-Net's architecture as MONAI's DynUNet assembles it: an input block, strided
  encoder blocks and a bottleneck held in lists, and a recursive skip container that registers
  every encoder module a second time (`skip_layers.downsample` is `input_block`); instance norm.
  2-D or 3-D.
- `TiedDecoder`: a decoder convolution that reuses an encoder convolution's weight (one
  parameter in two modules) and a module reachable under two names.
- `SlicedEncoderUNet`: a U-Net decoder on an inverted-residual encoder (depthwise and pointwise
  convolutions, batch norm) whose stages are slices of its `features` Sequential, made in the
  forward (as segmentation libraries cut torchvision's MobileNetV2).
- `PSPNetish`: a pyramid-pooling head (the features pooled to 1, 2, 3 and 6 cells, each a 1x1
  convolution, batch norm and ReLU, upsampled bilinearly and joined) on a 3-stage residual
  encoder with batch norm.
- `DeepLabish`: a dilated residual encoder, an atrous pyramid with its image-pooling branch
  (pooled to 1 x 1, a 1x1 convolution, batch norm on the 1 x 1 map), read through a dict.
- `SizeReadHead`: a head that reads the input's size at the top of its forward, gates by a
  pooled scale and interpolates its output to that size at the end (torchvision's LR-ASPP);
  its backbone returns a dict.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CLASSES = 3


def _conv(dims: int):
    return nn.Conv3d if dims == 3 else nn.Conv2d


class _Block(nn.Module):
    """DynUNet's UnetBasicBlock: two convolutions, each with instance norm and leaky ReLU (the
    first strided), named conv1.conv, norm1, conv2.conv, norm2."""

    def __init__(self, cin: int, cout: int, stride: int, dims: int) -> None:
        super().__init__()
        conv, norm = _conv(dims), nn.InstanceNorm3d if dims == 3 else nn.InstanceNorm2d
        self.conv1 = nn.Sequential()
        self.conv1.add_module("conv", conv(cin, cout, 3, stride, 1, bias=False))
        self.norm1 = norm(cout, affine=True)
        self.conv2 = nn.Sequential()
        self.conv2.add_module("conv", conv(cout, cout, 3, 1, 1, bias=False))
        self.norm2 = norm(cout, affine=True)
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(x)))


class _Up(nn.Module):
    """DynUNet's UnetUpBlock: a transposed convolution, the skip joined, a block."""

    def __init__(self, cin: int, cout: int, dims: int) -> None:
        super().__init__()
        up = nn.ConvTranspose3d if dims == 3 else nn.ConvTranspose2d
        self.transp_conv = up(cin, cout, 2, 2, bias=False)
        self.conv_block = _Block(2 * cout, cout, 1, dims)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv_block(torch.cat([self.transp_conv(x), skip], 1))


class _Skip(nn.Module):
    """DynUNet's DynUNetSkipLayer: the encoder module, what lies below it, the decoder module."""

    def __init__(self, downsample: nn.Module, upsample: nn.Module, next_layer: nn.Module) -> None:
        super().__init__()
        self.downsample, self.upsample, self.next_layer = downsample, upsample, next_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.downsample(x)
        return self.upsample(self.next_layer(down), down)


class NNUNetish(nn.Module):
    def __init__(self, dims: int = 2, filters=(4, 6, 8), cin: int = 3) -> None:
        super().__init__()
        f0, f1, f2 = filters
        self.input_block = _Block(cin, f0, 1, dims)
        self.downsamples = nn.ModuleList([_Block(f0, f1, 2, dims)])
        self.bottleneck = _Block(f1, f2, 2, dims)
        self.upsamples = nn.ModuleList([_Up(f2, f1, dims), _Up(f1, f0, dims)])
        self.output_block = _conv(dims)(f0, CLASSES, 1)
        # every encoder module a second time, under skip_layers
        inner = _Skip(self.downsamples[0], self.upsamples[0], self.bottleneck)
        self.skip_layers = _Skip(self.input_block, self.upsamples[1], inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_block(self.skip_layers(x))


class TiedDecoder(nn.Module):
    """An encoder convolution whose weight the decoder's convolution shares, a dropout and a
    convolution registered under a second name (`again`)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.enc = nn.Conv2d(c, c, 3, padding=1)
        self.dec = nn.Conv2d(c, c, 3, padding=1)
        self.dec.weight = self.enc.weight  # tied: one parameter, two modules
        self.drop = nn.Dropout2d(0.0)
        self.again = self.drop
        self.head = nn.Conv2d(c, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = F.relu(self.stem(x))
        e = F.relu(self.enc(f))
        return self.head(self.again(F.relu(self.dec(e)) + f))


def _cbr(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, dilation: int = 1):
    pad = dilation * (k - 1) // 2
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, pad, dilation, groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class _InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project, the input added when kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            _cbr(cin, hidden, 1),
            _cbr(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class SlicedEncoderUNet(nn.Module):
    STAGES = ((0, 2), (2, 4), (4, 6))

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _cbr(3, 4, stride=1),
            _InvertedResidual(4, 4, 1, 2),
            _InvertedResidual(4, 6, 2, 2),
            _InvertedResidual(6, 6, 1, 2),
            _InvertedResidual(6, 8, 2, 2),
            _cbr(8, 8, 1),
        )
        self.up1 = nn.Sequential(_cbr(8 + 6, 6), _cbr(6, 6))
        self.up2 = nn.Sequential(_cbr(6 + 4, 4), _cbr(4, 4))
        self.head = nn.Conv2d(4, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for a, b in self.STAGES:  # a new Sequential each forward, of the same modules
            x = self.features[a:b](x)
            skips.append(x)
        for up, skip in zip((self.up1, self.up2), skips[-2::-1], strict=True):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = up(torch.cat([x, skip], 1))
        return self.head(x)


class _Basic(nn.Module):
    """ResNet's basic block, dilated where asked; a strided 1x1 shortcut with batch norm."""

    def __init__(self, cin: int, cout: int, stride: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, dilation, dilation, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, dilation, dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class PSPNetish(nn.Module):
    BINS = (1, 2, 3, 6)

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.layer1 = _Basic(c, c)
        self.layer2 = _Basic(c, 2 * c, 2)
        self.layer3 = _Basic(2 * c, 2 * c, 2)
        self.stages = nn.ModuleList(
            nn.Sequential(
                nn.AdaptiveAvgPool2d(b),
                nn.Conv2d(2 * c, c, 1, bias=False),
                nn.BatchNorm2d(c),
                nn.ReLU(),
            )
            for b in self.BINS
        )
        self.bottleneck = nn.Sequential(
            nn.Conv2d(2 * c + 4 * c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.head = nn.Conv2d(c, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        f = self.layer3(self.layer2(self.layer1(self.stem(x))))
        h, w = f.shape[-2:]
        pyramid = [f] + [
            F.interpolate(s(f), (h, w), mode="bilinear", align_corners=False) for s in self.stages
        ]
        y = self.head(self.bottleneck(torch.cat(pyramid, 1)))
        return F.interpolate(y, size, mode="bilinear", align_corners=False)


class _ASPPPooling(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(cin, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        for m in self:
            x = m(x)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class _Backbone(nn.Module):
    """A dilated residual encoder returning its output in a dict (IntermediateLayerGetter's)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.layer1 = _Basic(c, 2 * c, 1)
        self.layer2 = _Basic(2 * c, 2 * c, 1, dilation=2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.layer2(self.layer1(self.stem(x)))}


class DeepLabish(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.backbone = _Backbone(c)
        self.aspp = nn.ModuleList(
            [
                nn.Sequential(nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()),
                _cbr(2 * c, c, 3, dilation=2),
                _cbr(2 * c, c, 3, dilation=3),
                _ASPPPooling(2 * c, c),
            ]
        )
        self.project = nn.Sequential(
            nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        self.classifier = nn.Conv2d(c, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_shape = x.shape[-2:]  # read at the top, as torchvision's segmentation models do
        f = self.backbone(x)["out"]
        y = self.classifier(self.project(torch.cat([b(f) for b in self.aspp], 1)))
        return F.interpolate(y, size=input_shape, mode="bilinear", align_corners=False)


class _Features(nn.Module):
    """A backbone of two levels returned by name: low (stride 2) and high (stride 4)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.low = nn.Sequential(_cbr(3, c, 3, 2), _cbr(c, c, 3))
        self.high = nn.Sequential(_cbr(c, 2 * c, 3, 2), _cbr(2 * c, 2 * c, 3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        low = self.low(x)
        return {"low": low, "high": self.high(low)}


class SizeReadHead(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.backbone = _Features(c)
        self.cbr = nn.Sequential(nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.scale = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(2 * c, c, 1), nn.Sigmoid())
        self.low_classifier = nn.Conv2d(c, CLASSES, 1)
        self.high_classifier = nn.Conv2d(c, CLASSES, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        size = input.shape[-2:]
        features = self.backbone(input)
        low, high = features["low"], features["high"]
        x = self.cbr(high) * self.scale(high)
        x = F.interpolate(x, size=low.shape[-2:], mode="bilinear", align_corners=False)
        out = self.low_classifier(low) + self.high_classifier(x)
        return F.interpolate(out, size=size, mode="bilinear", align_corners=False)
