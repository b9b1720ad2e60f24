"""Models and training helpers shared by the multi-process tests: the single-process SGD oracle
(DESIGN.md invariant 1) and the same steps through `parallelize`."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridpar.planning.models import build_model
from hybridpar.runtime.train.optim import KrizhevskySGD

STEPS, B, CLASSES = 4, 12, 5


class TVAlexNet(nn.Module):
    """Written like torchvision's AlexNet, small: `features`, `avgpool` and `classifier`
    sub-modules, in-place ReLUs, dropout modules, `torch.flatten` inside `forward`. Conv channels
    (5, 7) and FC widths (13, 7) that no Pr in {2, 3, 4} divides. Dropout has p = 0 here so that
    training is comparable with one process; tests/test_dropout.py covers p > 0."""

    def __init__(self, num_classes: int = CLASSES, in_channels: int = 1, p: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 5, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(5, 7, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(
            nn.Dropout(p),
            nn.Linear(7 * 2 * 2, 13),
            nn.ReLU(inplace=True),
            nn.Dropout(p),
            nn.Linear(13, 7),
            nn.ReLU(inplace=True),
            nn.Linear(7, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def tv_alexnet() -> nn.Module:
    return TVAlexNet()


class zoo:
    """A builder of a zoo model for CLASSES classes, its dropout modules kept but at p = 0 so that
    training is comparable with one process (tests/test_dropout.py covers p > 0)."""

    def __init__(self, name: str, size: int | None = None, channels: int = 1) -> None:
        self.name, self.size, self.channels = name, size, channels

    def __call__(self) -> nn.Module:
        m = build_model(
            self.name, input_size=self.size, num_classes=CLASSES, in_channels=self.channels
        )
        for d in m.modules():
            if isinstance(d, nn.Dropout):
                d.p = 0.0
        return m


# name -> (builder, per-example input shape)
MAKERS = {
    "tv-alexnet": (tv_alexnet, (1, 8, 8)),
    "resnet20": (zoo("resnet20", 8), (1, 8, 8)),
    "digits-cnn": (zoo("digits-cnn", 8), (1, 8, 8)),
    "digits-wide": (zoo("digits-wide", 8), (1, 8, 8)),
    "mlp": (zoo("mlp", 4), (1, 4, 4)),
    "alexnet-owt": (zoo("alexnet-owt", 64, 3), (3, 64, 64)),
    "alexnet": (zoo("alexnet", 67, 3), (3, 67, 67)),
    "vgg16": (zoo("vgg16", 32, 3), (3, 32, 32)),
}


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MAKERS[name][0]()


def batches(shape: tuple[int, ...] = (1, 8, 8), steps: int = STEPS, b: int = B):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(b, *shape, generator=g), torch.randint(0, CLASSES, (b,), generator=g))
        for _ in range(steps)
    ]


def optimizer(params) -> KrizhevskySGD:
    return KrizhevskySGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def train_reference(model: nn.Module, data) -> dict[str, torch.Tensor]:
    """Single-process SGD on the whole global batches: the oracle."""
    opt = optimizer(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def train_parallel(hp, data) -> dict[str, torch.Tensor]:
    """The same steps through a HybridParallel: loss summed over this rank's output rows and
    divided by the global batch, so every gradient is a plain sum over ranks."""
    opt = optimizer(hp.parameters())
    for x, y in data:
        n = len(x)
        hp.set_batch(n)
        out = hp(x[hp.input_rows(n)])
        loss = F.cross_entropy(out, y[hp.output_rows(n)], reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        hp.finish_backward()
        opt.step()
    return hp.full_state_dict()


def assert_same_state(got: dict, want: dict, label: str) -> None:
    assert list(got) == list(want), f"{label}: state_dict keys differ"
    for k, v in want.items():
        torch.testing.assert_close(
            got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{label}: {k}: {m}"
        )


def preset(name: str, which: str, P: int, **choices) -> ParallelPlan:  # noqa: F821
    """The plan a preset names for one of MAKERS (priced on a fast test network), with the
    given choices (codec=..., bn=...: hybridpar.choices.Choices)."""
    from hybridpar.choices import Choices
    from hybridpar.planning.analysis import analyze
    from hybridpar.planning.cluster import Cluster
    from hybridpar.planning.layers import cost_layers
    from hybridpar.planning.presets import plan_preset

    builder, shape = MAKERS[name]
    with torch.device("meta"):
        layers = cost_layers(analyze(builder(), shape))
    net = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
    return plan_preset(
        which, layers, P, B, net, choices=Choices(**choices), model=name, input_shape=shape
    )


class Residual(nn.Module):
    """conv-BN-ReLU-conv-BN plus the block's input, ReLU: one segment (the shortcut keeps the
    input alive), as resnet's BasicBlock."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class DomainStack(nn.Module):
    """Every window the domain style handles, each weighted conv its own segment: a batch stem (so
    the domain layers' input gradients flow on), 5x5 pad 2, AlexNet's 11x11 stride 4 pad 2, 3x3
    dilation 2, a 1x1 (no halo at all), 3x3 with a 3x3 stride-2 max pool, 3x3 with a 5x5 average
    pool that counts only the image, a residual block with batch norm, then a head (1x1 conv,
    flatten, Linear). Heights 53 -> 12 -> 5: uneven bands on 2, 3 and 4 ranks; at Pr = 4 the
    5-row stage has one-row bands that the 5x5 pool's halo crosses (multi-hop)."""

    SHAPE = (2, 53, 15)

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 3, padding=1)
        self.wide = nn.Sequential(nn.Conv2d(3, 4, 5, padding=2), nn.ReLU())
        self.alex = nn.Sequential(nn.Conv2d(4, 4, 11, stride=4, padding=2), nn.ReLU())
        self.dilated = nn.Sequential(nn.Conv2d(4, 4, 3, padding=2, dilation=2), nn.ReLU())
        self.point = nn.Conv2d(4, 4, 1)
        self.pooled = nn.Sequential(nn.Conv2d(4, 3, 3, padding=1), nn.MaxPool2d(3, 2))
        self.avg = nn.Sequential(
            nn.Conv2d(3, 3, 3, padding=1), nn.AvgPool2d(5, 1, 2, count_include_pad=False)
        )
        self.block = Residual(3)
        self.head = nn.Conv2d(3, 2, 1)
        self.fc = nn.Linear(2 * 5, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dilated(self.alex(self.wide(self.stem(x))))
        x = self.block(self.avg(self.pooled(self.point(x))))
        return self.fc(torch.flatten(self.head(x), 1))


DOMAIN_LAYERS = ("wide.0", "alex.0", "dilated.0", "point", "pooled.0", "avg.0", "block")
