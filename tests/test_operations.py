"""Teaching the domain style an operation (issue 72): the worked examples of docs/dense.md, each
a record in core/operations.py and at most a stand-in. A pixel shuffle and unshuffle (modules and
F.pixel_shuffle in a forward) and a layer norm over (C, H, W) train on bands and tiles exactly as
one process does: float64, 3 steps of SGD with momentum, rtol 1e-7, the ledger's bytes per
(layer, term) the plan's, on 2 and 3 ranks. Band heights that are not multiples of the unshuffle's
factor fetch the rows their outputs read as a halo (priced); what the table refuses is refused by
name. Operations along the channels (issue 75): a repeat over them, Dropout3d, and a module of no
state that pads them (MONAI's ChannelPad) keep rows apart and train on bands too."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import bytes_are_predicted, run_ranks
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import Style
from hybridpar.core.rules import why_not
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export, plan_for
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
STEPS, CLASSES = 3, 3


class Shuffled(nn.Module):
    """Down by PixelUnshuffle, up by PixelShuffle (modules), then an ESPCN-style sub-pixel head
    (a convolution to C r^2 channels and F.pixel_shuffle in the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.PixelUnshuffle(2)
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.sub = nn.Conv2d(4, 4 * CLASSES, 3, padding=1, stride=2)
        self.head = nn.Conv2d(CLASSES, CLASSES, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        y = y + self.up(F.relu(self.mid(self.down(y))))
        return self.head(F.pixel_shuffle(self.sub(y), 2))


class LayerNormed(nn.Module):
    """A layer norm over (C, H, W) between convolutions (each example's statistics over every
    pixel), its affine weight and bias random."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.LayerNorm((4, *shape))
        self.head = nn.Conv2d(4, CLASSES, 3, padding=1)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, x):
        return self.head(F.relu(self.norm(self.stem(x))))


class Periodic(nn.Module):
    """A latitude x longitude net: convolutions with padding_mode="circular" (a 3 x 5 one after a
    pooling), a CircularPad2d before an unpadded convolution, a constant pad of the rows (a crop
    back after it), a ZeroPad2d and an asymmetric circular F.pad before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")
        self.wrap = nn.CircularPad2d(1)
        self.mid = nn.Conv2d(4, 4, 3)
        self.pool = nn.MaxPool2d(2)
        self.deep = nn.Conv2d(4, 4, (3, 5), padding=(1, 2), padding_mode="circular")
        self.up = nn.Upsample(scale_factor=2)
        self.zero = nn.ZeroPad2d((0, 0, 1, 0))
        self.head = nn.Conv2d(4, CLASSES, 3)

    def forward(self, x):
        y = F.relu(self.mid(self.wrap(F.relu(self.stem(x)))))
        y = self.up(F.relu(self.deep(self.pool(y))))
        y = F.pad(F.pad(y, (0, 0, 2, 1), value=0.5), (0, 0, -1, -2))
        return self.head(F.pad(self.zero(y), (2, 0, 0, 1), mode="circular"))


# name -> (builder, per-example input, global batch); 10 rows: bands of 5 (or 4, 3, 3) rows of
# which the unshuffle's outputs read across the cut
NETS = {
    "shuffled": (Shuffled, (3, 10, 12), 2),
    "layernormed": (lambda: LayerNormed((10, 8)), (3, 10, 8), 2),
    "channelpad": (lambda: ChannelPadded(), (2, 10, 8), 2),
    "periodic": (Periodic, (3, 10, 8), 2),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return NETS[name][0]().double()


def _batches(shape: tuple[int, ...], b: int):
    """STEPS batches of b examples of `shape` and a class per pixel (voxel), float64."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(b, *shape, generator=g, dtype=torch.float64),
         torch.randint(0, CLASSES, (b, *shape[1:]), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip


def _data(name: str):
    return _batches(*NETS[name][1:])


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _one_process(model: nn.Module, data) -> dict:
    """The state dict after training `model` on `data` in one process."""
    opt = _optimizer(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _matches(t: HybridTrainer, plan, data, want: dict, tag: str) -> str:
    """(Inside the ranks.) `t` trained on `data` ends with one process's state `want`, at rtol
    1e-7, its ledger's bytes the plan's."""
    for x, y in data:
        t.step(x, y)
    got = t.full_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{tag}: {k}")
    bytes_are_predicted(t.ledger, plan, tag, STEPS)
    return tag


def _plans(name: str, P: int) -> dict:
    """Bands of P; on P = 2 tiles (1 x 2) too; and the planner's domain scenario."""
    _, shape, b = NETS[name]
    layers = cost_layers(analyze(_model(name), shape))
    out = {}
    for style in [Style.domain(P, 1)] + ([Style.domain(P, 1, 2)] if P == 2 else []):
        plan = evaluate(layers, [style] * len(layers), PlanRequest(P, b, NET, elem_bytes=8))
        assert plan.feasible, (name, style)
        out[str(style)] = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape,
                                 model=name)  # fmt: skip
    r = plan_for(_model(name), shape, P, b, NET, scenarios=["domain"], elem_bytes=8)
    out["scenario"] = r.export(r.scenario("domain"))
    return out


def _train(P: int) -> list[str]:
    done = []
    for name in NETS:
        want = _one_process(_model(name), _data(name))
        for label, plan in _plans(name, P).items():
            t = HybridTrainer(_model(name), plan, _optimizer, input_shape=NETS[name][1],
                              verify=False)  # fmt: skip
            done.append(_matches(t, plan, _data(name), want, f"{name} P={P} {label}"))
    return done


@pytest.mark.parametrize("P", [2, 3])
def test_pixel_shuffles_and_a_layer_norm_over_the_image_train_on_bands_as_one_process(P):
    done = run_ranks(_train, P, P, timeout_s=300)[0]
    assert len(done) == len(NETS) * (3 if P == 2 else 2), done


class PeriodicVolume(nn.Module):
    """A 3-d net periodic along its depth: a Conv3d with padding_mode="circular", and a circular
    F.pad of depth, height and width before an unpadded one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 4, 3, padding=1, padding_mode="circular")
        self.head = nn.Conv3d(4, CLASSES, 3)

    def forward(self, x):
        return self.head(F.pad(F.relu(self.stem(x)), (1, 1, 1, 1, 1, 1), mode="circular"))


def _wrapping(P: int) -> list[str]:
    from hybridpar.runtime.options import RuntimeOptions

    done = []
    cases = [
        ("periodic", Style.domain(P, 1, 2), True),
        ("periodic", Style.domain(P, 1), False),
        ("volume", Style.domain(P, 1), True),
        ("volume", Style.domain(P, 1, 2), False),
    ]
    for name, style, shm in cases:
        build, shape = (PeriodicVolume, (1, 8, 5, 4)) if name == "volume" else NETS[name][:2]
        data = _batches(shape, 2)
        torch.manual_seed(0)
        want = _one_process(build().double(), data)
        layers = cost_layers(analyze(build().double(), shape))
        plan = evaluate(layers, [style] * len(layers), PlanRequest(P, 2, NET, elem_bytes=8))
        plan = export(plan, procs=P, batch=2, choices=Choices(), input_shape=shape, model=name)
        torch.manual_seed(0)
        t = HybridTrainer(build().double(), plan, _optimizer, input_shape=shape, verify=False,
                          options=RuntimeOptions(shared_memory=shm))  # fmt: skip
        done.append(_matches(t, plan, data, want, f"{name} {style} shm={shm}"))
    return done


class HeightPadded(nn.Module):
    """A 3-d U-Net whose outputs are padded along the height in its forward (a volume tile's
    columns) before a last convolution along it."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        from hybridpar.core.models import UNet

        super().__init__()
        self.unet = UNet(shape[1:], CLASSES, in_channels=shape[0], width=4, dims=3)
        self.along = nn.Conv3d(CLASSES, CLASSES, (1, 3, 1))

    def forward(self, x):
        return self.along(F.pad(self.unet(x), (0, 0, 1, 1), value=0.25))


def _volume_tiles(P: int) -> list[str]:
    """A 3-d U-Net on tiles of depth x height (1 x 2 on 2 ranks, 2 x 2 on 4; the width whole),
    its outputs padded along the height: 3 steps as one process, bytes = prediction, and its
    evaluation's outputs, each rank writing its tile, one process's."""
    shape = (2, 8, 8, 5)
    build = lambda: HeightPadded(shape).double()  # noqa: E731
    data = _batches(shape, 2)
    torch.manual_seed(0)
    want = _one_process(build(), data)
    layers = cost_layers(analyze(build(), shape))
    style = Style.domain(P, 1, 2)
    plan = evaluate(layers, [style] * len(layers), PlanRequest(P, 2, NET, elem_bytes=8))
    plan = export(plan, procs=P, batch=2, choices=Choices(), input_shape=shape, model="unet3d")
    torch.manual_seed(0)
    t = HybridTrainer(build(), plan, _optimizer, input_shape=shape)
    tag = _matches(t, plan, data, want, f"{style}")
    trained = build()
    trained.load_state_dict(want)
    written = torch.zeros(2, CLASSES, *shape[1:], dtype=torch.float64)
    t.predict(data[0][0], out=written)
    written = written.clone()
    dist.all_reduce(written)  # each rank wrote its tile: their sum is the whole outputs
    torch.testing.assert_close(written, trained.eval()(data[0][0]), rtol=1e-7, atol=1e-10)
    return tag


@pytest.mark.parametrize("P", [2, 4])
def test_a_volume_trains_and_predicts_on_tiles_of_depth_and_height(P):
    """Issue 75 item 3, in part: volumes split into tiles of depth x height."""
    assert run_ranks(_volume_tiles, P, P, timeout_s=300)[0] == f"domain({P // 2}x2x1)"


def test_circular_padding_wraps_around_on_tiles_bands_and_depth_bands():
    """Issue 75 item 4 on 4 ranks (the 2 and 3 of `periodic` run above): the periodic net on
    2 x 2 tiles (the corners from across both edges), on 4 bands point to point (the first and
    last band send each other rows), and a volume periodic in depth on 4 depth bands and on 2 x 2
    tiles of depth x height."""
    done = run_ranks(_wrapping, 4, 4, timeout_s=300)[0]
    assert len(done) == 4, done


def test_the_unshuffle_reads_across_a_cut_that_is_not_a_multiple_of_its_factor():
    """10 rows over 2 ranks (5 and 5), unshuffled by 2 to 5 rows (3 and 2): the first rank's
    last output row reads input rows 4 and 5, the second rank's first: a halo row, priced (the
    bytes the test above holds to the ledger). Shuffled back, 5 rows (3 and 2) to 10 (5 and 5):
    the second rank's first output row comes from input row 2, the first rank's."""
    layers = {x.name: x for x in cost_layers(analyze(_model("shuffled"), (3, 10, 12)))}
    spans = {w.member: w for x in layers.values() for w in x.windows}
    down, up = spans["down"].row_map(), spans["up"].row_map()
    assert [p.reads for p in down.parts(2)] == [(0, 6), (6, 10)]
    assert down.rows_sent(2) == [0, 1] and up.rows_sent(2) == [1, 0]
    assert [p.reads for p in up.parts(2)] == [(0, 3), (2, 5)]
    assert spans[":pixel_shuffle.0"].row_map().h_out == 10


def test_what_the_table_refuses_on_bands_is_refused_by_name():
    """A layer norm over (H, W) alone takes statistics per channel across the rows: refused on
    bands; one over the width alone keeps rows apart (bands) but mixes a tile's columns."""

    class WidthNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.norm = nn.LayerNorm(shape)

        def forward(self, x):
            return self.norm(self.conv(x))

    shape = (8, 8)
    layer = cost_layers(analyze(WidthNorm(), (3, 8, 8)))[0]
    assert "LayerNorm over the rows" in why_not(layer, Style.domain(2, 1), 2)
    shape = (8,)
    layer = cost_layers(analyze(WidthNorm(), (3, 8, 8)))[0]
    assert why_not(layer, Style.domain(2, 1), 2) == ""
    assert "LayerNorm over the columns" in why_not(layer, Style.domain(2, 1, 2), 2)
    from hybridpar.core.rows import function_blocker

    x = torch.zeros(1, 2, 4, 4)
    assert function_blocker(torch.Tensor.repeat, (x, 1, 3, 1, 1), {}) == ""  # channels
    assert function_blocker(torch.Tensor.repeat, (x, [1, 1, 2, 1]), {}) == (
        "repeat along the rows or columns"
    )


class ChannelOps(nn.Module):
    """Operations along the channels, as V-Nets and MONAI's residual units write them: the
    input repeated over the channels (`x.repeat([1, 4, 1, 1, 1])`), and Dropout3d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 4, 3, padding=1)
        self.drop = nn.Dropout3d(0.5)
        self.head = nn.Conv3d(4, CLASSES, 1)

    def forward(self, x):
        y = self.conv(x) + x.repeat([1, 4, 1, 1, 1])
        return self.head(self.drop(F.relu(y)))


def _channel_ops(P: int) -> list[str]:
    from hybridpar.runtime.options import RuntimeOptions
    from hybridpar.runtime.parallel.dropout import counter_dropout

    shape, b = (1, 8, 6, 5), 2
    data = _batches(shape, b)
    torch.manual_seed(0)
    want = _one_process(counter_dropout(ChannelOps().double(), 3), data)
    layers = cost_layers(analyze(ChannelOps().double(), shape))
    assert all(not x.blockers for x in layers), [x.blockers for x in layers]
    style = Style.domain(P, 1)
    plan = evaluate(layers, [style] * len(layers), PlanRequest(P, b, NET, elem_bytes=8))
    plan = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape, model="c")
    torch.manual_seed(0)
    t = HybridTrainer(ChannelOps().double(), plan, _optimizer, input_shape=shape, verify=False,
                      options=RuntimeOptions(seed=3))  # fmt: skip
    return [_matches(t, plan, data, want, f"P={P}")]


@pytest.mark.parametrize("P", [2, 3])
def test_operations_along_the_channels_run_on_depth_bands(P):
    """A repeat over the channels and Dropout3d (counter-based masks, whole channels) keep the
    rows apart: a 3-d net with both trains on depth bands as one process does."""
    assert run_ranks(_channel_ops, P, P, timeout_s=300)[0] == [f"P={P}"]


class ChannelPad(nn.Module):
    """A parameter-free module that pads the channels, as MONAI's ChannelPad does (a residual
    unit's shortcut to more channels)."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.pad = [0, 0, 0, 0, 0, extra]

    def forward(self, x):
        return F.pad(x, self.pad)


class PaddedResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 5, 3, padding=1)
        self.shortcut = ChannelPad(3)
        self.rows = nn.ReflectionPad2d((0, 0, 1, 1))  # a module of no state that mixes rows
        self.head = nn.Conv2d(5, CLASSES, 3)

    def forward(self, x):
        return self.head(self.rows(F.relu(self.conv(x) + self.shortcut(x))))


class ChannelPadded(nn.Module):
    """A residual unit whose shortcut pads the input's channels (ChannelPad)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 5, 3, padding=1)
        self.shortcut = ChannelPad(3)
        self.head = nn.Conv2d(5, 3, 3, padding=1)

    def forward(self, x):
        return self.head(F.relu(self.conv(x) + self.shortcut(x)))


def test_a_module_of_no_state_is_judged_by_what_its_functions_do():
    """A leaf module hybridpar does not know and that holds nothing (MONAI's ChannelPad) keeps
    rows apart when every function its forward calls does; one that mixes rows (a reflection
    pad) is refused by its name as before (a ZeroPad2d is a window: core.operations' "pad")."""
    layers = cost_layers(analyze(PaddedResidual(), (2, 8, 6)))
    blockers = {b for x in layers for b in x.blockers}
    assert not any("ChannelPad" in b for b in blockers), blockers
    assert "ReflectionPad2d mixes rows" in blockers, blockers


class Volumes(nn.Module):
    """A 3-d net for the model style: Conv3d layers split by output channels (issue 75, item 2),
    a batch norm riding along, after a band of depth slices or by themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 6, 3, padding=1)
        self.norm = nn.BatchNorm3d(6)
        self.mid = nn.Conv3d(6, 6, 3, padding=1)
        self.head = nn.Conv3d(6, CLASSES, 1)

    def forward(self, x):
        return self.head(F.relu(self.mid(F.relu(self.norm(self.stem(x))))))


def _volumes(P: int) -> list[str]:
    shape, b = (1, 6, 5, 4), 2
    data = _batches(shape, b)
    torch.manual_seed(0)
    want = _one_process(Volumes().double(), data)
    layers = cost_layers(analyze(Volumes().double(), shape))
    done = []
    for first in (Style.model(P, 1), Style.domain(P, 1)):
        styles = [first] + [Style.model(P, 1)] * (len(layers) - 1)
        plan = evaluate(layers, styles, PlanRequest(P, b, NET, elem_bytes=8))
        assert plan.feasible, (first, plan)
        plan = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape, model="v")
        torch.manual_seed(0)
        t = HybridTrainer(Volumes().double(), plan, _optimizer, input_shape=shape, verify=False)
        done.append(_matches(t, plan, data, want, f"P={P} {first}"))
    return done


@pytest.mark.parametrize("P", [2, 3])
def test_conv3d_layers_split_by_output_channels(P):
    """Conv3d in the model style, by itself and after depth bands, trains as one process does
    (it was refused: "only Linear and Conv2d layers split over a model group")."""
    assert len(run_ranks(_volumes, P, P, timeout_s=300)[0]) == 2


class Upsampling(nn.Module):
    """Transposed convolutions split by output channels (issue 75, item 2): a 2-d one (5
    channels: an empty shard on 4 ranks... and uneven ones) after a stem, and a 3-d one."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv, up = (nn.Conv2d, nn.ConvTranspose2d) if dims == 2 else (nn.Conv3d, nn.ConvTranspose3d)
        self.stem = conv(1, 4, 3, padding=1)
        self.up = up(4, 5, 2, stride=2)
        self.smooth = up(5, 5, 3, padding=1)
        self.head = conv(5, CLASSES, 1)

    def forward(self, x):
        return self.head(F.relu(self.smooth(F.relu(self.up(F.relu(self.stem(x)))))))


def _upsampling(P: int, folder: str) -> list[str]:
    done = []
    for dims, shape in ((2, (1, 5, 4)), (3, (1, 4, 2, 2))):
        g = torch.Generator().manual_seed(1)  # the outputs twice the input's size
        data = [(torch.randn(2, *shape, generator=g, dtype=torch.float64),
                 torch.randint(0, CLASSES, (2, *[2 * d for d in shape[1:]]), generator=g))
                for _ in range(STEPS)]  # fmt: skip
        torch.manual_seed(0)
        want = _one_process(Upsampling(dims).double(), data)
        layers = cost_layers(analyze(Upsampling(dims).double(), shape))
        last = Style.model(P, 1) if P <= CLASSES else Style.domain(P, 1)  # 3 classes
        for first in (Style.model(P, 1), Style.domain(P, 1)):
            styles = [first] + [Style.model(P, 1)] * (len(layers) - 2) + [last]
            plan = evaluate(layers, styles, PlanRequest(P, 2, NET, elem_bytes=8))
            assert plan.feasible, (first, plan.reason)
            plan = export(plan, procs=P, batch=2, choices=Choices(), input_shape=shape, model="u")
            torch.manual_seed(0)
            t = HybridTrainer(Upsampling(dims).double(), plan, _optimizer, input_shape=shape,
                              verify=False)  # fmt: skip
            done.append(_matches(t, plan, data, want, f"{dims}-d P={P} {first}"))
        # its shards (Shard(1) of the weights) checkpointed and loaded onto bands (replicas)
        t.save(f"{folder}/{dims}")
        batch = evaluate(
            layers, [Style.domain(P, 1)] * len(layers), PlanRequest(P, 2, NET, elem_bytes=8)
        )
        batch = export(batch, procs=P, batch=2, choices=Choices(), input_shape=shape, model="u")
        other = HybridTrainer(Upsampling(dims).double(), batch, _optimizer, input_shape=shape,
                              verify=False)  # fmt: skip
        other.load(f"{folder}/{dims}")
        for k, v in t.full_state_dict().items():
            torch.testing.assert_close(other.full_state_dict()[k], v, rtol=0, atol=0, msg=k)
    return done


@pytest.mark.parametrize("P", [2, 3, 4])
def test_transposed_convolutions_split_by_output_channels(P, tmp_path):
    """ConvTranspose2d and ConvTranspose3d in the model style, by themselves and after bands,
    train as one process does (they were refused: "only Linear and Conv2d layers split over a
    model group"), bytes = prediction; their shards checkpoint and load onto bands."""
    assert len(run_ranks(_upsampling, P, P, str(tmp_path), timeout_s=300)[0]) == 4
