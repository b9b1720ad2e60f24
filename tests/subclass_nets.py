"""Layers written the way timm writes them: subclasses of torch's layers whose own `forward` does
more than the base class's (issue 59), and nets built from them, small (3 x 8 x 8 inputs, channel
counts no Pr in {2, 3, 4} always divides). Written here from the behaviour timm documents, with no
test dependency on timm."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CLASSES = 5
SHAPE = (3, 8, 8)


class BatchNormAct2d(nn.BatchNorm2d):
    """Batch norm, then dropout and an activation, both children run by its own forward (timm's
    BatchNormAct2d): the batch norm of the input is written out with F.batch_norm."""

    def __init__(self, c: int, act: type[nn.Module] = nn.ReLU, drop: float = 0.0) -> None:
        super().__init__(c)
        self.drop = nn.Dropout(drop)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            bn_training,
            factor,
            self.eps,
        )
        return self.act(self.drop(x))


class ScaledStdConv2d(nn.Conv2d):
    """A convolution of its standardised weight (timm's ScaledStdConv2d): per output channel, the
    weight's mean and variance taken by F.batch_norm over (1, out, in * k * k), scaled by a
    learnable `gain` and a constant."""

    def __init__(
        self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, eps: float = 1e-6
    ) -> None:
        super().__init__(cin, cout, k, stride, (k - 1) // 2, groups=groups)
        self.gain = nn.Parameter(torch.ones(cout, 1, 1, 1))
        self.scale = self.weight[0].numel() ** -0.5
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class GainLinear(nn.Linear):
    """A linear layer whose rows are scaled by a learnable gain of their own."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(cin, cout)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.gain[:, None], self.bias)


class BNActResidual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), BatchNormAct2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = BatchNormAct2d(c, act=nn.Identity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(self.bn1(self.conv1(x)))))


class BNActNet(nn.Module):
    """A stem, a residual block and a transition of conv + BatchNormAct2d (SiLU, dropout p = 0),
    pooled into a linear head (timm's MobileViT and dual-path nets are built from these)."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), BatchNormAct2d(6, nn.SiLU))
        self.block = BNActResidual(6)
        self.down = nn.Sequential(nn.Conv2d(6, 7, 3, 2, 1), BatchNormAct2d(7, drop=0.0))
        self.head = nn.Linear(7 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.down(self.block(self.stem(x))), 1))


class StdConvNet(nn.Module):
    """Weight-standardised convolutions with a gain (one depthwise), plain batch norm, and a
    linear head whose rows carry a gain: an NF-ResNet-like trunk."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = ScaledStdConv2d(3, 6, 3)
        self.conv1 = ScaledStdConv2d(6, 6, 3, groups=6)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = ScaledStdConv2d(6, 7, 3, stride=2)
        self.fc = GainLinear(7 * 4 * 4, 11)
        self.out = nn.Linear(11, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.stem(x))
        x = self.conv2(torch.relu(self.bn(self.conv1(x))))
        return self.out(torch.relu(self.fc(torch.flatten(x, 1))))


class BatchReadNet(nn.Module):
    """A forward that reads the batch size at its top and uses it after its stem: a learned
    position added, as a ViT adds it, to the embedding of each of the b images read there. The
    embedding is wide, so a planner splits it by model and hands the stem's examples off to it."""

    def __init__(self, num_classes: int = CLASSES, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.embed = nn.Linear(6 * 4 * 4, width)
        self.pos = nn.Parameter(torch.linspace(-0.5, 0.5, width))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        x = self.embed(torch.flatten(self.stem(x), 1))
        return self.head(x + self.pos.expand(b, -1))


NETS = {"bn-act": BNActNet, "std-conv": StdConvNet, "batch-read": BatchReadNet}
