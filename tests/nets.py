"""Models and training helpers shared by the multi-process tests: the single-process SGD oracle
(DESIGN.md invariant 1) and the same steps through `parallelize`."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridpar.core.models import build_model
from hybridpar.core.optim import KrizhevskySGD
from hybridpar.planning.request import PlanRequest

STEPS, B, CLASSES = 4, 12, 5


class TVAlexNet(nn.Module):
    """Written like torchvision's AlexNet, small: `features`, `avgpool` and `classifier`
    sub-modules, in-place ReLUs, dropout modules, `torch.flatten` inside `forward`. Conv channels
    (5, 7) and FC widths (13, 7) that no Pr in {2, 3, 4} divides. Dropout has p = 0 here so that
    training is comparable with one process drawing torch's masks; tests/test_dropout.py
    trains with p > 0 against one process drawing counter-based masks."""

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


def variable_batch_step(h, y, rounds, head, head_opt, trunk_opt) -> None:
    """Krizhevsky 4.2 in one process, one iteration, from the trunk's output `h` on the whole
    batch: per round (a list of example indices) the head's mean loss over its examples, its
    backward and its own step; then the trunk's gradient, the rounds' each weighted by its share
    of the batch, and the trunk's step."""
    grad = torch.zeros_like(h)
    for ex in rounds:
        hj = h[ex].detach().requires_grad_()
        loss = F.cross_entropy(head(hj), y[ex], reduction="sum") / len(ex)
        head_opt.zero_grad()
        loss.backward()
        head_opt.step()
        grad[ex] = hj.grad * len(ex) / len(h)
    trunk_opt.zero_grad()
    h.backward(grad)
    trunk_opt.step()


def straight_and_resumed(t, rebuild, data, k: int, folder) -> tuple[dict, dict]:
    """Train the HybridTrainer `t` on `data`, checkpointing into `folder` after k steps; a fresh
    trainer from `rebuild()` loads that checkpoint and trains the remaining steps. Returns both
    full state dicts (the run straight through, the resumed one)."""
    for x, y in data[:k]:
        t.train_step(x, y)
    t.save(folder)
    for x, y in data[k:]:
        t.train_step(x, y)
    again = rebuild()
    again.load(folder)
    for x, y in data[k:]:
        again.train_step(x, y)
    return t.full_state_dict(), again.full_state_dict()


def assert_same_state(
    got: dict, want: dict, label: str, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    assert list(got) == list(want), f"{label}: state_dict keys differ"
    for k, v in want.items():
        torch.testing.assert_close(
            got[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{label}: {k}: {m}"
        )


def assert_calls(ledger, plan, steps: int, label: str) -> None:
    """Every rank's blocking calls per (layer, term) and step, as its ledger booked them, are the
    plan's predicted calls (planning.cost.sync.calls: the meetings the wait for the slowest rank
    is priced at). Collective: every rank calls it, and every rank asserts."""
    import torch.distributed as dist

    from hybridpar.runtime.parallel.trainer import BLOCKING_TERMS

    booked: dict = {}
    for e in ledger.entries:  # a call counts for every layer it carries
        for layer in e.layers if e.term in BLOCKING_TERMS else ():
            booked[(layer, str(e.term))] = booked.get((layer, str(e.term)), 0) + 1
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, booked)
    want = {(p.layer, p.term): p.calls for p in plan.predicted if p.calls}
    for rank, mine in enumerate(every):
        got = {k: n / steps for k, n in mine.items()}
        diff = {
            k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)
        }
        assert not diff, f"{label}, rank {rank}: calls per step (booked, predicted) {diff}"


def preset(name: str, which: str, P: int, **choices) -> ParallelPlan:  # noqa: F821
    """The plan a preset names for one of MAKERS (priced on a fast test network), with the
    given choices (codec=..., bn=...: hybridpar.core.choices.Choices)."""
    from hybridpar.core.analysis import analyze
    from hybridpar.core.choices import Choices
    from hybridpar.core.cluster import Cluster
    from hybridpar.core.layers import cost_layers
    from hybridpar.planning.presets import plan_preset

    builder, shape = MAKERS[name]
    with torch.device("meta"):
        layers = cost_layers(analyze(builder(), shape))
    net = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
    return plan_preset(
        which,
        layers,
        PlanRequest(P, B, net, choices=Choices(**choices), model=name, input_shape=shape),
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


# --- model families written the way torchvision writes them (sub-modules, functional ops inside
# forward), small: 3 x 8 x 8 inputs, channel counts no Pr in {2, 3, 4} always divides. Their random
# layers (Dropout, stochastic depth) take p as an argument: 0 where a test compares with one
# process drawing torch's own masks, > 0 where the counter-based dropout draws them.


def _conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act=nn.ReLU6):
    """Conv2d-BN-activation, torchvision's Conv2dNormActivation."""
    layers = [
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project, the input added when the
    shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers = [_conv_bn(cin, hidden, 1)] if expand != 1 else []
        layers += [
            _conv_bn(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2ish(nn.Module):
    def __init__(self, num_classes: int = CLASSES, p: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn(3, 6, stride=1),
            InvertedResidual(6, 5, 1, 1),
            InvertedResidual(5, 7, 2, 3),
            InvertedResidual(7, 7, 1, 3),
            _conv_bn(7, 10, 1),
        )
        self.classifier = nn.Sequential(nn.Dropout(p), nn.Linear(10, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c, h, w = x.size()
    x = x.view(n, groups, c // groups, h, w)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(n, -1, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit: stride 1 splits the channels in two and transforms one half; stride 2
    transforms both copies; the halves are concatenated and shuffled."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = cout // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
                nn.BatchNorm2d(cin),
                nn.Conv2d(cin, half, 1, bias=False),
                nn.BatchNorm2d(half),
                nn.ReLU(inplace=True),
            )
        else:
            self.branch1 = nn.Sequential()
        into = cin if stride > 1 else half
        self.branch2 = nn.Sequential(
            nn.Conv2d(into, half, 1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(inplace=True),
            nn.Conv2d(half, half, 3, stride, 1, groups=half, bias=False),
            nn.BatchNorm2d(half),
            nn.Conv2d(half, half, 1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2ish(nn.Module):
    def __init__(self, num_classes: int = CLASSES, p: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.Conv2d(3, 6, 3, 1, 1, bias=False), nn.BatchNorm2d(6), nn.ReLU(inplace=True)
        )
        self.stage2 = nn.Sequential(ShuffleUnit(6, 10, 2), ShuffleUnit(10, 10, 1))
        self.conv5 = nn.Sequential(
            nn.Conv2d(10, 14, 1, bias=False), nn.BatchNorm2d(14), nn.ReLU(inplace=True)
        )
        self.fc = nn.Linear(14, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv5(self.stage2(self.conv1(x)))
        return self.fc(x.mean([2, 3]))


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth, mode "row": each example's branch kept with probability
    1 - p (scaled by 1 / (1 - p)) in training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty([x.shape[0]] + [1] * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class SqueezeExcitation(nn.Module):
    """x * sigmoid(fc2(silu(fc1(avgpool(x))))), the fcs as 1x1 convolutions (torchvision)."""

    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(s))))


class MBConv(nn.Module):
    """EfficientNet's block: 1x1 expand, depthwise, squeeze-and-excitation, 1x1 project, the input
    added through stochastic depth when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, sd: float) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.block = nn.Sequential(
            _conv_bn(cin, hidden, 1, act=nn.SiLU),
            _conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.SiLU),
            SqueezeExcitation(hidden, max(4, cin // 2)),
            _conv_bn(hidden, cout, 1, act=None),
        )
        self.stochastic_depth = StochasticDepth(sd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + self.stochastic_depth(out) if self.use_res else out


class EfficientNetish(nn.Module):
    def __init__(self, num_classes: int = CLASSES, p: float = 0.0, sd: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn(3, 6, act=nn.SiLU),
            MBConv(6, 5, 1, 2, sd),
            MBConv(5, 5, 1, 3, sd),
            MBConv(5, 7, 2, 3, sd),
            _conv_bn(7, 11, 1, act=nn.SiLU),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p, inplace=True), nn.Linear(11, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class InceptionBlock(nn.Module):
    """Four branches (1x1; 1x1-3x3; 1x1-5x5; 3x3 max pool-1x1) joined by torch.cat."""

    def __init__(self, cin: int, c1: int, c3: int, c5: int, cp: int) -> None:
        super().__init__()
        self.branch1 = _conv_bn(cin, c1, 1, act=nn.ReLU)
        self.branch2 = nn.Sequential(_conv_bn(cin, 5, 1, act=nn.ReLU), _conv_bn(5, c3, 3))
        self.branch3 = nn.Sequential(_conv_bn(cin, 4, 1, act=nn.ReLU), _conv_bn(4, c5, 5))
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, 1, 1, ceil_mode=True), _conv_bn(cin, cp, 1, act=nn.ReLU)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)]
        return torch.cat(outs, 1)


class Inceptionish(nn.Module):
    def __init__(self, num_classes: int = CLASSES, p: float = 0.0) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 6, act=nn.ReLU)
        self.a = InceptionBlock(6, 5, 7, 4, 5)
        self.pool = nn.MaxPool2d(2)
        self.b = InceptionBlock(21, 4, 5, 7, 4)
        self.dropout = nn.Dropout(p)
        self.fc = nn.Linear(20, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.pool(self.a(self.stem(x))))
        x = F.adaptive_avg_pool2d(x, (1, 1))
        return self.fc(self.dropout(torch.flatten(x, 1)))


class DenseLayer(nn.Module):
    """BN-ReLU-1x1-BN-ReLU-3x3 on the concatenation of every earlier feature map."""

    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(2 * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(inputs, 1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, cin: int, growth: int) -> None:
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}", DenseLayer(cin + i * growth, growth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNetish(nn.Module):
    def __init__(self, num_classes: int = CLASSES, p: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False),
            nn.BatchNorm2d(6),
            nn.ReLU(inplace=True),
            DenseBlock(3, 6, 4),
            nn.BatchNorm2d(18),
            nn.ReLU(inplace=True),
            nn.Conv2d(18, 7, 1, bias=False),
            nn.AvgPool2d(2),
            DenseBlock(2, 7, 5),
            nn.BatchNorm2d(17),
        )
        self.classifier = nn.Linear(17, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.features(x), inplace=True)
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


FAMILIES = {
    "mobilenetv2": MobileNetV2ish,
    "shufflenetv2": ShuffleNetV2ish,
    "efficientnet": EfficientNetish,
    "inception": Inceptionish,
    "densenet": DenseNetish,
}
for _name, _cls in FAMILIES.items():
    MAKERS[_name] = (_cls, (3, 8, 8))


class FeaturePyramid(nn.Module):
    """A feature pyramid (Lin et al. 2017), small: a bottom-up path of strided 3x3 convolutions,
    1x1 laterals, a top-down path that upsamples each level to the size of the one below it
    (nearest) and adds the lateral, a 3x3 smoothing and a 1x1 head on the finest level."""

    def __init__(self, size: tuple[int, int], classes: int = 3, c: int = 4) -> None:
        super().__init__()
        h, w = size
        sizes = [(h, w), ((h + 1) // 2, (w + 1) // 2)]
        self.c1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1), nn.ReLU())
        self.c3 = nn.Sequential(nn.Conv2d(2 * c, 4 * c, 3, 2, 1), nn.ReLU())
        self.lat = nn.ModuleList(nn.Conv2d(k * c, c, 1) for k in (1, 2, 4))
        self.up = nn.ModuleList(nn.Upsample(s, mode="nearest") for s in sizes)
        self.smooth = nn.Conv2d(c, c, 3, padding=1)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f1 = self.c1(x)
        f2 = self.c2(f1)
        f3 = self.c3(f2)
        p3 = self.lat[2](f3)
        p2 = self.lat[1](f2) + self.up[1](p3)
        p1 = self.lat[0](f1) + self.up[0](p2)
        return self.head(F.relu(self.smooth(p1)))


class DilatedFCN(nn.Module):
    """A fully convolutional net of dilated 3x3 convolutions (dilation 1, 2, 4, 2), batch norm
    and a 1x1 head: the context grows without pooling, the output has the input's size."""

    def __init__(self, classes: int = 3, c: int = 6) -> None:
        super().__init__()
        layers, cin = [], 3
        for d in (1, 2, 4, 2):
            layers += [nn.Conv2d(cin, c, 3, padding=d, dilation=d, bias=False), nn.BatchNorm2d(c)]
            layers.append(nn.ReLU())
            cin = c
        self.body = nn.Sequential(*layers)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class FreeResamplings(nn.Module):
    """An encoder-decoder written as torchvision's segmentation heads are: `F.interpolate` in the
    modules' own forward, to the skip tensor's size (`size=skip.shape[-2:]`, bilinear) and at
    the end back to the input's size (`size=x.shape[-2:]`), by a scale in between (nearest)."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1), nn.ReLU())
        self.deep = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, 2, 1), nn.ReLU())
        self.merge = nn.Conv2d(3 * c, c, 3, padding=1)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        low = self.deep(self.down(skip))
        low = F.interpolate(low, scale_factor=2.0, mode="nearest")
        low = F.interpolate(low, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        y = self.head(F.relu(self.merge(torch.cat([skip, low], 1))))
        y = F.interpolate(y, scale_factor=0.5, mode="bilinear", align_corners=True)
        return F.interpolate(y, size=x.shape[-2:], mode="bicubic", align_corners=False)


class _ImagePooling(nn.Sequential):
    """torchvision's ASPPPooling: the image pooled to one value per channel, a 1x1 convolution,
    and back to the input's size (bilinear) in its own forward."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        for m in self:
            x = m(x)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class AtrousPyramid(nn.Module):
    """A small DeepLabv3 (Chen et al. 2017): a strided stem, an atrous spatial pyramid (a 1x1
    convolution, 3x3 ones at dilation 2 and 3, and the image-pooling branch) joined along the
    channels, a 1x1 projection and head, and a bilinear upsampling to the input's size."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2 * c, 3, 2, 1), nn.ReLU()
        )
        self.branches = nn.ModuleList(
            [
                nn.Sequential(nn.Conv2d(2 * c, c, 1), nn.ReLU()),
                nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=2, dilation=2), nn.ReLU()),
                nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=3, dilation=3), nn.ReLU()),
                _ImagePooling(2 * c, c),
            ]
        )
        self.project = nn.Sequential(nn.Conv2d(4 * c, c, 1), nn.ReLU())
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        y = self.head(self.project(torch.cat([b(f) for b in self.branches], 1)))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


class _GateConv(nn.Module):
    """Squeeze-and-excitation with AdaptiveAvgPool2d(1) and 1x1 convolutions (torchvision's)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2, self.act = nn.Conv2d(c, 2, 1), nn.Conv2d(2, c, 1), nn.PReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(self.act(self.fc1(self.pool(x)))))


class _GateLinear(nn.Module):
    """Squeeze-and-excitation as Hu et al. wrote it: a mean over height and width, Linear layers,
    a view to (b, c, 1, 1) and expand_as."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, 2), nn.Linear(2, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        y = torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3))))))
        return x * y.view(b, c, 1, 1).expand_as(x)


class _GateMax(nn.Module):
    """A gate from the maxima: AdaptiveMaxPool2d(1) (the first maximum takes the gradient) and
    amax (ties share it)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.pool, self.fc = nn.AdaptiveMaxPool2d(1), nn.Conv2d(2 * c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = torch.cat([self.pool(x), x.amax((-1, -2), keepdim=True)], 1)
        return x + torch.sigmoid(self.fc(both))


class Gated(nn.Module):
    """An encoder-decoder with PReLU and squeeze-and-excitation gates in three spellings; the
    max gate runs after a nearest upsampling, whose repeated rows make ties that cross bands."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.PReLU(c), _GateConv(c))
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1), nn.PReLU(), _GateLinear(2 * c))
        self.gate = _GateMax(2 * c)
        self.head = nn.Conv2d(3 * c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        d = F.interpolate(self.down(s), size=s.shape[-2:], mode="nearest")
        return self.head(torch.cat([s, self.gate(d)], 1))


class _ResidualUnit(nn.Module):
    """Two 3x3 convolutions with group norm and PReLU, the input added through a strided 1x1
    convolution."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(2, cout), nn.PReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(2, cout),
        )  # fmt: skip
        self.skip = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResidualEncoderDecoder(nn.Module):
    """Residual units down (group norm, strided 1x1 shortcuts), a bilinear upsampling to the skip
    tensor's size, and a head on their join."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.enc1, self.enc2 = _ResidualUnit(3, c, 1), _ResidualUnit(c, 2 * c, 2)
        self.dec = _ResidualUnit(3 * c, c, 1)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.enc1(x)
        d = F.interpolate(self.enc2(s), size=s.shape[-2:], mode="bilinear", align_corners=False)
        return self.head(self.dec(torch.cat([s, d], 1)))


class PyramidPooling(nn.Module):
    """PSPNet's pyramid pooling (Zhao et al. 2017), small: the features averaged to 1 x 1, 2 x 2
    and 3 x 3 cells, each through a 1x1 convolution and bilinear back to the features' size,
    joined with them along the channels, and a 3x3 convolution to the classes."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.levels = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(s), nn.Conv2d(c, 2, 1), nn.ReLU()) for s in (1, 2, 3)
        )
        self.head = nn.Conv2d(c + 6, classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        size = f.shape[-2:]
        up = [F.interpolate(p(f), size, mode="bilinear", align_corners=False) for p in self.levels]
        return self.head(torch.cat([f, *up], 1))


class _NextBlock(nn.Module):
    """ConvNeXt's block (Liu et al. 2022): a 7x7 depthwise convolution, then channels-last (a
    permute) a layer norm, a Linear to 4 C, GELU, a Linear back and a per-channel scale, permuted
    back and added to the input."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.up, self.down = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.gamma * self.down(F.gelu(self.up(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ChannelsLast(nn.Module):
    """A small ConvNeXt-style dense predictor: a stem, two channels-last blocks, a 1x1 head."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(_NextBlock(c), _NextBlock(c))
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class PooledClassifier(nn.Module):
    """A classifier of large images: a strided convolution trunk with batch norm, global average
    pooling, a Linear head on the pooled features."""

    def __init__(self, classes: int = 3, c: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Linear(2 * c, 8), nn.ReLU(), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))
