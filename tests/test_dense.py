"""Dense prediction split by height (issue 61): segmentation nets run under the domain style end
to end, transposed convolutions, resamplings and ceil_mode poolings on bands with the halo rows
they read, the output left on its bands and the loss taken there, divided as torch's
reduction="mean" divides it on the whole batch.

The oracle: float64, 3 steps of SGD with momentum and weight decay, parameters at rtol 1e-7 and
the returned mean losses against one process; every convolution domain; bytes = prediction per
(layer, term). One spawn per P runs every cell."""

import contextlib
import functools
import itertools
import json
import re

import pytest
import torch
import torch.distributed as dist
from device_rules import DeviceRules
from dist_helpers import bytes_are_predicted, run_ranks
from nets import (
    AtrousPyramid,
    ChannelsLast,
    DilatedFCN,
    FeaturePyramid,
    FreeResamplings,
    Gated,
    PooledClassifier,
    PyramidPooling,
    ResidualEncoderDecoder,
    optimizer,
    train_reference,
)
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster, load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.halo import Pooled, Resample, Transposed, Window, bands, tile
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export, plan_for
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.losses import Dice
from hybridpar.runtime.parallel.trainer import HybridTrainer

STEPS, W = 3, 12
NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
CLASSES = 3

# name -> (builder of (height, width), loss)
NETS = {
    "unet-transposed": lambda s: UNet(s, CLASSES, width=4),
    "unet-bilinear": lambda s: UNet(s, CLASSES, width=4, up="bilinear"),
    "unet-bilinear-aligned": lambda s: UNet(s, CLASSES, width=4, up="bilinear", align_corners=True),
    "pyramid": lambda s: FeaturePyramid(s, CLASSES),
    "dilated": lambda s: DilatedFCN(CLASSES),
    "free-resamplings": lambda s: FreeResamplings(CLASSES),
    "unet-instance-prelu": lambda s: _tracked(_prelu(UNet(s, CLASSES, width=4, norm="instance"))),
    "residual-group-norm": lambda s: ResidualEncoderDecoder(CLASSES),
    "atrous-pyramid": lambda s: AtrousPyramid(CLASSES),
    "gated": lambda s: Gated(CLASSES),
    "pyramid-pooling": lambda s: PyramidPooling(CLASSES),
    "channels-last": lambda s: ChannelsLast(CLASSES),
    "unet3d-instance-prelu": lambda s: _prelu(UNet(s, CLASSES, width=2, norm="instance", dims=3)),
    "unet3d-trilinear": lambda s: UNet(s, CLASSES, width=2, up="bilinear", dims=3),
}


# the nets whose stand-ins (global poolings, statistics over bands, volumes, channels-last) also
# run under CUDA's device rules on the CPU (tests/device_rules.py), on 3 ranks
RULED = {"unet-instance-prelu", "gated", "pyramid-pooling", "unet3d-instance-prelu"}


def _prelu(model: nn.Module) -> nn.Module:
    """Every ReLU of `model` a PReLU (one slope)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.ReLU):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, nn.PReLU())
    return model


def _tracked(model: nn.Module) -> nn.Module:
    """Every instance norm of `model` one that tracks running statistics."""
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.InstanceNorm2d):
            parent, _, child = name.rpartition(".")
            new = nn.InstanceNorm2d(m.num_features, affine=True, track_running_stats=True)
            setattr(model.get_submodule(parent), child, new)
    return model


WEIGHT = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
LOSSES = {
    "ce": F.cross_entropy,
    "ce-weight-ignore": functools.partial(F.cross_entropy, weight=WEIGHT, ignore_index=1),
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "dice": Dice(ignore_index=2),
}


def _cells(P: int) -> list[tuple[str, int, int, str, int]]:
    """(net, height, B, loss, Pr): every net at an odd height (61, 97 or 29 rows), at B = 1 or 2
    (both for the transposed and the instance-norm U-Nets); the losses on the transposed U-Net;
    all domain(P x 1), and on 4 ranks the instance norm's running statistics on 2 x 2."""
    cells = []
    heights = (61, 97, 61, 61, 97, 61, 61, 29, 29, 29, 29, 29, 13, 13)
    for (name, h), b in itertools.product(zip(NETS, heights, strict=True), (1, 2)):
        if (b == 2) == (h == 61) or name in ("unet-transposed", "unet-instance-prelu"):
            cells.append((name, h, b, "ce", P))
    cells += [("unet-transposed", 40, 2, loss, P) for loss in LOSSES if loss != "ce"]
    return cells + ([("unet-instance-prelu", 61, 4, "ce", 2)] if P == 4 else [])


def _data(name: str, h: int, b: int, loss: str):
    g = torch.Generator().manual_seed(h + b)
    out = []
    for _ in range(STEPS):
        pixels = _size(name, h)
        x = torch.randn(b, 3, *pixels, generator=g, dtype=torch.float64)
        if loss in ("mse", "l1"):
            y = torch.randn(b, CLASSES, *pixels, generator=g, dtype=torch.float64)
        else:
            y = torch.randint(0, CLASSES, (b, *pixels), generator=g)
        out.append((x, y))
    return out


def _model(name: str, h: int):
    torch.manual_seed(0)
    return NETS[name](_size(name, h)).double()


def _size(name: str, h: int) -> tuple[int, ...]:
    """An image's (H, W), or a volume's (D, H, W): `h` the rows split over the ranks."""
    return (h, 6, 5) if name.startswith("unet3d") else (h, W)


def _reference(name: str, h: int, b: int, loss: str):
    m = _model(name, h)
    opt = optimizer(m.parameters())
    losses = []
    for x, y in _data(name, h, b, loss):
        opt.zero_grad()
        value = LOSSES[loss](m(x), y)  # reduction="mean": torch's own division
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    return m.state_dict(), losses


def _plan(name: str, h: int, b: int, P: int, pr: int | None = None, pw: int = 1, cycle=()):
    """Every convolution domain(Pr x P/Pr) (Pr = P unless given; on tiles of `pw` columns), or
    the layers' styles taken from `cycle` in turn, priced (float64), exported."""
    shape = (3, *_size(name, h))
    layers = cost_layers(analyze(_model(name, h), shape))
    styles = [Style.domain(pr or P, P // (pr or P), pw)] * len(layers)
    styles = [cycle[i % len(cycle)] for i in range(len(layers))] if cycle else styles
    plan = evaluate(layers, styles, PlanRequest(P, b, NET, elem_bytes=8))
    assert plan.feasible, plan.reason
    return export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape, model=name)


def _as_one_process(name, h, b, loss, P, pr, pw, ruled, label, cycle=()) -> HybridTrainer:
    """Train `name` on P ranks, every convolution domain(Pr x P/Pr) on tiles of `pw` columns
    (or the styles of `cycle` in turn; `ruled`: under CUDA's device rules, on the paths a GPU
    takes): the parameters and the mean losses one process's, the bytes the plan's; the
    trainer."""
    want, want_losses = _reference(name, h, b, loss)
    plan = _plan(name, h, b, P, pr, pw, cycle)
    shape = (3, *_size(name, h))
    model, data = _model(name, h), _data(name, h, b, loss)
    options = RuntimeOptions(shared_memory=False) if ruled else None
    with DeviceRules() if ruled else contextlib.nullcontext() as rules:
        t = HybridTrainer(model, plan, optimizer, LOSSES[loss], options, input_shape=shape)
        got = [t.step(x, y) for x, y in data]
    if ruled:
        rules.check()
    state = t.full_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-7, atol=1e-10, msg=f"{label}: {k}")
    torch.testing.assert_close(got, want_losses, rtol=1e-9, atol=0, msg=label)
    bytes_are_predicted(t.ledger, plan, label, STEPS)
    return t


def _train(P: int) -> int:
    for name, h, b, loss, pr in _cells(P):
        label = f"{name} H={h} B={b} {loss} P={P} Pr={pr}"
        ruled = P == 3 and name in RULED
        t = _as_one_process(name, h, b, loss, P, pr, 1, ruled, label)
        lo, hi = bands(h, P)[dist.get_rank()]
        rows = t.target.shape[-len(_size(name, h))]  # the height's, or a volume's depth
        assert pr < P or rows == hi - lo, f"{label}: the loss ran on {t.target.shape}"
    return len(_cells(P)) + _classify(P)


def _classify(P: int, pw: int = 1) -> int:
    """A classifier of 29-row images: its trunk on bands (domain(P x 1); on tiles of `pw`
    columns), the globally pooled features whole on every rank, its head in batch(P) or
    model(P x 1): as one process."""
    shape, b = (3, 29, W), 4
    g = torch.Generator().manual_seed(P)
    data = [(torch.randn(b, *shape, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (b,), generator=g)) for _ in range(STEPS)]  # fmt: skip
    for head in (Style.batch(P), Style.model(P, 1)):
        torch.manual_seed(0)
        layers = cost_layers(analyze(PooledClassifier(5).double(), shape))
        styles = [Style.domain(P, 1, pw) if x.kind == "conv" else head for x in layers]
        plan = evaluate(layers, styles, PlanRequest(P, b, NET, elem_bytes=8, choices=Choices()))
        assert plan.feasible, plan.reason
        plan = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape)
        torch.manual_seed(0)
        m = PooledClassifier(5).double()
        want = train_reference(m, data)
        torch.manual_seed(0)
        t = HybridTrainer(PooledClassifier(5).double(), plan, optimizer, input_shape=shape)
        for x, y in data:
            t.step(x, y)
        got, label = t.full_state_dict(), f"classifier, head {head}, P={P}, {pw} tile columns"
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{label}: {k}")
        bytes_are_predicted(t.ledger, plan, label, STEPS)
    return 2


@pytest.mark.parametrize("P", [2, 3, 4])
def test_segmentation_nets_split_by_height_train_as_one_process(P):
    """U-Nets (transposed convolutions; bilinear upsampling, align_corners False and True; instance
    norm with running statistics and PReLU; 3-D), a feature pyramid, a dilated net, a residual
    group-norm net, atrous and pyramid pooling, squeeze-and-excitation gates and channels-last
    blocks, all convolutions domain(P x 1), odd heights, B = 1 and 2, on the losses' own means;
    on 3 ranks the new stand-ins under CUDA's device rules."""
    assert run_ranks(_train, P, P, timeout_s=300)[0] == len(_cells(P)) + 2


# the nets on 2 x 2 tiles: the 2-d nets but the channels-last one (its permute hides the
# columns) and four whose stand-ins run on tiles elsewhere, to keep the suite's time (aligned
# corners and the free resamplings: bilinear's and nearest's taps; the bilinear U-Net on 1 x 2
# tiles; the dilated net in the moves' cell)
TILED = [n for n in NETS if not n.startswith("unet3d") and n not in (
    "channels-last", "unet-bilinear-aligned", "free-resamplings", "unet-bilinear", "dilated")]  # fmt: skip


def _tile_cells(P: int) -> list[tuple[str, int, int, str, int, int]]:
    """(net, height, B, loss, Pr, tile columns): on 4 ranks the 2-d nets (`TILED`) on 2 x 2
    tiles at B = 1, the transposed U-Net at B = 2 with Dice, the instance-norm U-Net (running
    statistics) on 1 x 2 tiles in 2 batch groups; on 2 ranks two nets split by columns alone
    (1 x 2 tiles)."""
    if P == 2:
        return [("unet-bilinear", 29, 1, "ce", 2, 2), ("atrous-pyramid", 29, 1, "ce", 2, 2)]
    cells = [(name, 29, 1, "ce", 4, 2) for name in TILED]
    cells += [("unet-transposed", 40, 2, "dice", 4, 2)]
    return [*cells, ("unet-instance-prelu", 29, 2, "ce", 2, 2)]


def _tiles(P: int) -> int:
    for name, h, b, loss, pr, pw in _tile_cells(P):
        label = f"{name} H={h} B={b} {loss} P={P} tiles {pr // pw}x{pw}x{P // pr}"
        ruled = name in ("unet-instance-prelu", "gated")
        t = _as_one_process(name, h, b, loss, P, pr, pw, ruled, label)
        (r0, r1), (c0, c1) = tile(_size(name, h), pr, pw, t.model.output_grid.r)
        assert tuple(t.target.shape[-2:]) == (r1 - r0, c1 - c0), f"{label}: {t.target.shape}"
    if P == 4:  # bands, tiles and batch in turn: every move between them
        cycle = (Style.domain(4, 1), Style.domain(4, 1, 2), Style.batch(4), Style.domain(2, 2, 2))
        _as_one_process("dilated", 29, 4, "ce", 4, 4, 2, False, "dilated, moves", cycle)
        # predict joins the tiles; a global maximum's ties across tiles
        t = HybridTrainer(_model("dilated", 16), _plan("dilated", 16, 2, 4, 4, 2), optimizer)
        x = torch.randn(2, 3, 16, W, dtype=torch.float64)
        want = _model("dilated", 16).eval()(x)
        torch.testing.assert_close(t.predict(x), want, rtol=1e-12, atol=1e-12)
        _ties(pw=2)
        _classify(P, pw=2)
    return len(_tile_cells(P))


@pytest.mark.parametrize("P", [2, 4])
def test_segmentation_nets_on_tiles_train_as_one_process(P):
    """The 2-d nets of the bands' test on 2 x 2 tiles (on 2 ranks two of them on 1 x 2: split by
    columns alone; on 4 one on 1 x 2 tiles in 2 batch groups), B = 1 and 2, the loss (and Dice)
    on the tiles' pixels, bytes = prediction per (layer, term); a net moving between bands, tiles and
    batch; predict joins the tiles; a classifier's trunk on tiles; two nets under CUDA's device
    rules."""
    assert run_ranks(_tiles, P, P, timeout_s=300)[0] == len(_tile_cells(P))


def _reads_exactly(fn, rowmap, h: int) -> None:
    """The rows torch's own gradient says each band of outputs reads lie in rowmap.reads."""
    x = torch.randn(1, 1, h, 3, dtype=torch.float64, requires_grad=True)
    y = fn(x)
    assert y.shape[2] == rowmap.h_out, rowmap
    for parts in (2, 3):
        for o0, o1 in bands(rowmap.h_out, parts):
            (g,) = torch.autograd.grad(y[:, :, o0:o1].sum(), x, retain_graph=True)
            rows = (g.abs().sum((0, 1, 3)) != 0).nonzero().flatten().tolist()
            lo, hi = rowmap.reads(o0, o1)
            assert not rows or (max(lo, 0) <= rows[0] and rows[-1] < min(hi, h)), (rowmap, o0)


def test_row_maps_name_the_rows_torch_reads():
    """Transposed convolutions (kernel, stride, padding, dilation, output padding), every
    interpolation mode with both align_corners and a scale or a size, poolings with ceil_mode:
    each band's outputs read only the rows its row map names."""
    for k, s, p, d, op, h in itertools.product(
        (1, 2, 3), (1, 2, 3), (0, 1), (1, 2), (0, 1), (5, 8)
    ):
        if p <= d * (k - 1) and op < max(s, d):
            w = torch.randn(1, 1, k, 1, dtype=torch.float64)
            fn = functools.partial(F.conv_transpose2d, weight=w, stride=(s, 1), padding=(p, 0),
                                   output_padding=(op, 0), dilation=(d, 1))  # fmt: skip
            _reads_exactly(fn, Transposed(k, s, p, d, h, op), h)
    modes = ("nearest", "nearest-exact", "bilinear", "bicubic")
    for mode, align, h, (size, scale) in itertools.product(
        modes, (False, True), (7, 12), ((None, 2.0), (None, 0.5), (None, 1.7), (9, None))
    ):
        if align and mode.startswith("nearest"):
            continue
        kw = {} if mode.startswith("nearest") else {"align_corners": align}
        fn = functools.partial(F.interpolate, size=(size, 3) if size else None,
                               scale_factor=(scale, 1.0) if scale else None, mode=mode, **kw)  # fmt: skip
        rows = fn(torch.zeros(1, 1, h, 3)).shape[2]
        _reads_exactly(fn, Resample(mode, kw.get("align_corners"), scale, h, rows), h)
    for k, s, p, h in itertools.product((2, 3), (2, 3), (0, 1), (7, 8, 13)):
        if p <= k // 2:
            fn = functools.partial(F.max_pool2d, kernel_size=(k, 1), stride=(s, 1), padding=(p, 0),
                                   ceil_mode=True)  # fmt: skip
            _reads_exactly(fn, Window(k, s, p, 1, h, ceil=True), h)


def test_the_planner_splits_a_large_unet_by_height_end_to_end():
    """One 1024 x 1024 image on 4 ranks: no batch group can take it and the transposed
    convolutions split by no channels, so every layer is domain on all 4 ranks (2 x 2 tiles on
    the cluster file's prices: half the bytes of 4 bands' widest, in as many messages); the
    bilinear U-Net's model plans are priced and lose. A 3-D U-Net's 32^3 volume on 2 x 2 tiles
    of depth x height (as the images, for the same reason), and a classifier's trunk (its
    globally pooled features go to a head split by units)."""
    for up in ("transposed", "bilinear"):
        with torch.device("meta"):
            m = UNet(1024, 3, up=up)
        result = plan_for(m, (3, 1024, 1024), 4, 1, load_cluster("cori-knl"))
        styles = set(result.export().styles.values())
        assert styles == {Style.domain(4, 1, 2)}, (up, styles)
    # a classifier of one 1024 x 1024 image: its trunk on bands, its head split by units
    with torch.device("meta"):
        m = PooledClassifier(5, c=16)
    styles = plan_for(m, (3, 1024, 1024), 4, 1, load_cluster("cori-knl")).export().styles
    assert {s.kind for k, s in styles.items() if k.startswith("trunk")} == {"domain"}, styles
    assert {s.kind for k, s in styles.items() if k.startswith("head")} == {"model"}, styles
    # its pooled features were never bands: no plan cuts them into bands after a batch trunk
    layers = cost_layers(analyze(PooledClassifier(5).double(), (3, 29, W)))
    into = [Style.batch(2), Style.batch(2), Style.domain(2, 1), Style.model(2, 1)]
    refused = evaluate(layers, into, PlanRequest(2, 4, NET))
    assert "no redistribution from batch to domain(2x1) before head.0" in refused.reason
    # a 3-D U-Net over one 32^3 volume on 4 ranks: tiles of depth x height end to end
    with torch.device("meta"):
        m = UNet(32, 3, in_channels=1, norm="instance", dims=3)
    result = plan_for(m, (1, 32, 32, 32), 4, 1, load_cluster("cori-knl"))
    assert set(result.export().styles.values()) == {Style.domain(4, 1, 2)}


def test_a_memory_limit_under_every_model_plan_gets_bands_with_their_bytes():
    """The bilinear U-Net, one 1024 x 1024 image on 2 ranks: a limit between the domain plan's
    bytes per rank and the channel split's gets every layer on bands and the plan's predicted
    bytes under it; a limit under both is refused naming the largest layer."""
    with torch.device("meta"):
        m = UNet(1024, 3, up="bilinear")
    free = plan_for(m, (3, 1024, 1024), 2, 1, load_cluster("cori-knl"))
    split, bands_ = free.scenario("model"), free.scenario("domain")
    assert bands_.memory_bytes < split.memory_bytes, (bands_.memory_bytes, split.memory_bytes)
    limit = (bands_.memory_bytes + split.memory_bytes) / 2
    chosen = plan_for(m, (3, 1024, 1024), 2, 1, load_cluster("cori-knl"), memory_limit=limit)
    plan = chosen.export()
    assert set(plan.styles.values()) == {Style.domain(2, 1)}
    assert 0 < plan.memory_bytes <= limit
    assert not chosen.scenario("model").feasible
    tight = plan_for(m, (3, 1024, 1024), 2, 1, load_cluster("cori-knl"), memory_limit=2**20)
    with pytest.raises(ConfigError, match=r"over the limit of 1.0 MiB; the largest layer is \S+"):
        _ = tight.best


def test_a_wrong_target_is_refused_and_predict_joins_the_bands():
    """A target of another size: one line naming both shapes, before the loss runs. `predict`
    returns whole images on every rank, as one process computes them (evaluation mode), and
    the pixel accuracy and mean IoU summed over the ranks' bands are one process's. A global
    max pooling's ties across bands take torch's gradients: the first maximum all of it
    (adaptive max pooling), every maximum an equal share (amax)."""
    run_ranks(_wrong_target, 3, timeout_s=120)


def _ties(pw: int = 1) -> None:
    """On bands (on tiles of `pw` columns)."""
    import datetime

    from hybridpar.runtime.comm.group import Group
    from hybridpar.runtime.parallel.domain import SpaceReduction

    group = Group(dist.group.WORLD, datetime.timedelta(seconds=60))
    gen = torch.Generator().manual_seed(0)  # the same on every rank
    x = torch.randn(2, 3, 1, 4, generator=gen, dtype=torch.float64).expand(2, 3, 7, 4).clone()
    x[0, 1, 5] = 5.0  # one maximum in the third band, ties in every row of the others
    x[1, 2, 2:, 0] = x[1, 2, 0].max()  # ties in the left tiles below the first row's
    g = torch.randn(2, 3, 1, 1, generator=gen, dtype=torch.float64)
    box = tile((7, 4), dist.get_world_size(), pw, dist.get_rank())
    (lo, hi), (c0, c1) = box if pw > 1 else (box, (0, 4))
    for how, torch_max in (
        ("first", lambda t: F.adaptive_max_pool2d(t, 1)),
        ("max", lambda t: t.amax((2, 3), keepdim=True)),
    ):
        whole = x.clone().requires_grad_()
        (torch_max(whole) * g).sum().backward()
        band = x[:, :, lo:hi, c0:c1].clone().requires_grad_()
        pool = Pooled("m", how, 3, 7, True, (1, 1), 4)
        y = SpaceReduction(pool, True, group, None, "m", pw)(band)
        torch.testing.assert_close(y, torch_max(x), rtol=0, atol=0)
        (y * g * (dist.get_rank() == 0)).sum().backward()  # the ranks' parts of the gradient
        mine = whole.grad[:, :, lo:hi, c0:c1]
        torch.testing.assert_close(band.grad, mine, rtol=1e-15, atol=0)


def _wrong_target():
    _ties()
    t = HybridTrainer(_model("dilated", 16), _plan("dilated", 16, 2, 3), optimizer)
    x = torch.randn(2, 3, 16, W, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"targets .* \(2, 15, 12\) .* outputs"):
        t.step(x, torch.zeros(2, 15, W, dtype=torch.long))
    want = _model("dilated", 16).eval()(x)
    torch.testing.assert_close(t.predict(x), want, rtol=1e-12, atol=1e-12)
    # pixel accuracy and mean IoU from the ranks' summed counts: one process's on whole images
    from hybridpar.runtime.parallel.losses import mean_iou, overlaps

    y = torch.randint(0, CLASSES, (2, 16, W))
    correct, counted, sums = t.evaluate(x, y, 2, CLASSES)
    every = torch.tensor([correct, counted, *sums.flatten().tolist()], dtype=torch.float64)
    dist.all_reduce(every)
    assert every[0] == (want.argmax(1) == y).sum() and every[1] == y.numel()
    whole = mean_iou(overlaps(want, y, CLASSES, F.cross_entropy), CLASSES)
    assert mean_iou(every[2:], CLASSES) == pytest.approx(whole, rel=1e-12)


def _memory(P: int) -> list[tuple[str, float, float]]:
    """(plan, predicted, counted) bytes on this rank's busiest... every rank's, for the U-Net
    under its domain plan and, at B = P, its batch plan, and the 3-D U-Net's volume split by
    depth: float32, momentum."""
    out = []
    h = 64
    for label, b, style, dims in (
        ("domain", 1, Style.domain(P, 1), 2),
        ("batch", P, Style.batch(P), 2),
        ("domain-3d", 1, Style.domain(P, 1), 3),
        *([("tiles", 1, Style.domain(P, 1, 2), 2)] if P == 4 else []),
    ):
        size = (h, W) if dims == 2 else (16, 12, 10)
        shape = (3, *size)

        norm = "batch" if dims == 2 else "instance"
        build = functools.partial(UNet, size, CLASSES, width=4, dims=dims, norm=norm)

        with torch.device("meta"):
            layers = cost_layers(analyze(build(), shape))
        request = PlanRequest(P, b, NET, elem_bytes=4)
        plan = evaluate(layers, [style] * len(layers), request)
        exported = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape)
        torch.manual_seed(0)
        t = HybridTrainer(build(), exported, optimizer, input_shape=shape)
        x, y = torch.randn(b, *shape), torch.randint(0, CLASSES, (b, *size))
        t.train_step(x, y)
        t.train_step(x, y, count=True)
        every = [None] * P
        dist.all_gather_object(every, sum(t.counted.values()))
        out.append((label, plan.held_bytes, max(every), t.counted))
    return out


@pytest.mark.parametrize("P", [2, 4])
def test_predicted_memory_is_what_a_rank_counts(P):
    """The planner's bytes per rank (parameters, gradients, momentum, what autograd keeps for
    backward: band, halo and padding rows on bands) within 10 % of the busiest rank's count in a
    real step, for images split by height (on 4 ranks also into 2 x 2 tiles) and a volume split
    by depth."""
    for label, predicted, counted, parts in run_ranks(_memory, P, P, timeout_s=120)[0]:
        assert predicted == pytest.approx(counted, rel=0.10), (label, predicted, counted, parts)


@pytest.mark.parametrize(
    "data, why",
    [
        (
            "bad.npz",
            r"y \(N, H, W\) a class per pixel of x \(N, C, H, W\).*; got x \(8, 1, 16, 16\)",
        ),
        ("digits-seg:8", r"digits-seg:SIZE .* SIZE >= 16 pixels"),
        ("digits-seg:32:1", r"at least 2 images"),
        ("pairs", r"image b.png has no mask in masks/ \(1 images have none\)"),
    ],
)
def test_dense_data_that_cannot_train_is_refused_in_one_line(tmp_path, capsys, data, why):
    """Masks that are not the images' size and malformed digits-seg specs: exit 2, one line,
    before any rank starts."""

    import numpy as np
    from PIL import Image

    from hybridpar.commands import cli

    x = np.zeros((8, 1, 16, 16), np.float32)
    np.savez(tmp_path / "bad.npz", x=x, y=np.zeros((8, 15, 16), np.int64))
    for d, names in (("images", "abc"), ("masks", "ac")):  # b's mask is missing
        (tmp_path / "pairs" / d).mkdir(parents=True)
        for n in names:
            Image.fromarray(np.zeros((16, 16), np.uint8), "L").save(
                tmp_path / "pairs" / d / f"{n}.png"
            )
    spec = str(tmp_path / data) if data in ("bad.npz", "pairs") else data
    code = cli.main(["train", "--model", "unet", "--data", spec, "--nproc", "2", "--batch", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.search(why, err[0]), err


def test_a_rank_reads_its_band_of_memory_mapped_images(tmp_path):
    """A folder of x.npy and y.npy is memory-mapped: a rank of a domain(2x1) plan reads its
    band of rows of each image of the step (and of its masks) and nothing else, of a plan on
    1 x 2 tiles its columns, and trains as one process on the arrays does."""
    import numpy as np

    g = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", g.standard_normal((10, 3, 37, W)))
    np.save(tmp_path / "y.npy", g.integers(0, CLASSES, (10, 37, W)))
    assert run_ranks(_mapped_step, 2, str(tmp_path), timeout_s=120)[0]


def _mapped_step(folder: str) -> bool:
    import numpy as np

    from hybridpar.runtime.train.data import load_data

    data = load_data(folder)
    idx = torch.tensor([3, 0, 5])
    data.x_train.dtype = torch.float64  # the arrays' own (the CLI reads float32)
    t = HybridTrainer(_model("dilated", 37), _plan("dilated", 37, 3, 2), optimizer)
    t.train_step(data.x_train[idx], data.y_train[idx])
    lo, hi = bands(37, 2)[dist.get_rank()]
    assert data.bytes_read == 3 * 3 * (hi - lo) * W * 8, data.bytes_read
    banded = t.full_state_dict()
    # split by columns (1 x 2 tiles): a rank reads its columns of every row, and nothing else
    before = data.bytes_read
    t = HybridTrainer(_model("dilated", 37), _plan("dilated", 37, 3, 2, 2, 2), optimizer)
    t.train_step(data.x_train[idx], data.y_train[idx])
    _, (c0, c1) = tile((37, W), 2, 2, dist.get_rank())
    assert data.bytes_read - before == 3 * 3 * 37 * (c1 - c0) * 8, data.bytes_read - before
    tiled = t.full_state_dict()
    x = torch.as_tensor(np.load(f"{folder}/x.npy")[data.x_train.index[idx.numpy()]])
    y = torch.as_tensor(np.load(f"{folder}/y.npy")[data.x_train.index[idx.numpy()]])
    m = _model("dilated", 37)
    opt = optimizer(m.parameters())
    F.cross_entropy(m(x), y).backward()
    opt.step()
    for k, v in m.state_dict().items():
        torch.testing.assert_close(banded[k], v, rtol=1e-7, atol=1e-10, msg=k)
        torch.testing.assert_close(tiled[k], v, rtol=1e-7, atol=1e-10, msg=f"tiles: {k}")
    # with class weights and an ignored class the divisor needs the labels: the ranks' bands'
    # counts are summed, and equal torch's over the whole masks
    loss = LOSSES["ce-weight-ignore"]
    t = HybridTrainer(_model("dilated", 37), _plan("dilated", 37, 3, 2), optimizer, loss)
    t.train_step(data.x_train[idx], data.y_train[idx])
    want = loss.keywords["weight"][y[y != 1]].sum()
    torch.testing.assert_close(t.divisor, want, rtol=1e-12, atol=0)
    return True


def test_an_image_and_mask_folder_is_read_by_bands(tmp_path):
    """images/ and masks/ of the same file names: a band of rows of some examples is those rows
    of those files (the images scaled to 0..1, the masks' values the classes)."""
    import numpy as np
    from PIL import Image

    from hybridpar.runtime.train.data import load_data, signature

    g = np.random.default_rng(1)
    pixels, classes = g.integers(0, 256, (5, 20, 12)), g.integers(0, 4, (5, 20, 12))
    for d, arrays in (("images", pixels), ("masks", classes)):
        (tmp_path / d).mkdir()
        for i, a in enumerate(arrays):
            Image.fromarray(a.astype(np.uint8), "L").save(tmp_path / d / f"{i}.png")
    assert signature(str(tmp_path), (), 0) == ((1, 20, 12), 4, (20, 12))
    data = load_data(str(tmp_path))
    pick = data.x_train.index[[2, 0]]
    x = data.x_train[torch.tensor([2, 0])].take_rows(slice(0, 2), (5, 9))
    y = data.y_train[torch.tensor([2, 0])].take_rows(slice(0, 2), (5, 9))
    torch.testing.assert_close(x, torch.as_tensor(pixels[pick, None, 5:9] / 255.0).float())
    assert torch.equal(y, torch.as_tensor(classes[pick, 5:9]))


class _Supervised(nn.Module):
    """Deep supervision: a second head's output returned beside the main one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3, padding=1)
        self.head, self.aux = nn.Conv2d(4, 3, 1), nn.Conv2d(4, 3, 1)

    def forward(self, x):
        f = self.body(x)
        return self.head(f), self.aux(f)


class _Transposed(nn.Module):
    """A convolution on the image transposed (its rows become columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        return self.b(self.a(x).transpose(2, 3)).transpose(2, 3)


class _PooledLast(nn.Module):
    """A mean over dims 2 and 3 of a channels-last band: the width and the channels, not a
    global pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 1)

    def forward(self, x):
        y = self.a(x).permute(0, 2, 3, 1)
        return self.b((y + y.mean((2, 3), keepdim=True)).permute(0, 3, 1, 2))


@pytest.mark.parametrize(
    "net, why",
    [
        (lambda: _Supervised(), "the model's output"),
        (
            # over (H, W): per channel across the rows (one over (C, H, W) runs on bands since
            # issue 72: tests/test_operations.py)
            lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.LayerNorm([14, 6])),
            "LayerNorm over the rows",
        ),
        (lambda: _Transposed(), "a permuted band leaves the segment"),
        (lambda: _PooledLast(), "mean of a permuted band"),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveMaxPool2d(2)), "AdaptiveMaxPool2d"),
    ],
)
def test_what_bands_cannot_run_is_refused_by_name(net, why):
    """Deep supervision's second output, a layer norm over the rows, a convolution on a
    transposed band, a global pooling of a permuted band, an adaptive max pooling to more than
    one value: domain is refused for the first convolution, naming the reason."""
    from hybridpar.core.rules import why_not

    first = cost_layers(analyze(net().double(), (3, 16, 8)))[0]
    said = why_not(first, Style.domain(2, 1), 2)
    assert why in said and said.endswith("give it batch or model"), said


class _PadColumns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return F.pad(self.conv(x), (1, 1, 0, 0), mode="reflect")  # constant, circular: a window


@pytest.mark.parametrize(
    "net, shape, why",
    [
        (lambda: ChannelsLast(CLASSES), (3, 16, 8), "permute of a band); give it batch or model "
         "or bands of rows (domain(RxC))"),
        (lambda: _PadColumns(), (3, 16, 8), "pad of the columns); give it batch or model or bands"),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, stride=2)), (3, 16, 5), "splits 2 columns over "
         "W=4 ranks; the largest W that works is 2, or give images about 2x as wide"),
    ],
)  # fmt: skip
def test_what_tiles_cannot_run_is_refused_by_name(net, shape, why):
    """A permuted band and a pad of the columns (both run on bands), tiles narrower than a rank
    each: 2 x 2 (1 x 4) tiles are refused for the first convolution they reach, naming why
    (volumes split into tiles of depth x height: tests/test_operations.py)."""
    from hybridpar.core.rules import why_not

    layers = cost_layers(analyze(net().double(), shape))
    style = Style.domain(4, 1, 4 if "W=4" in why else 2)
    said = next((w for x in layers if (w := why_not(x, style, 1))), "")
    assert why in said, said
    if "bands" in why:  # what mixes columns alone runs on bands
        assert not any(why_not(x, Style.domain(2, 1), 1) for x in layers)


def test_a_volume_trains_split_by_depth_from_the_command_line(tmp_path, capsys):
    """`hybridpar train --model unet3d` on memory-mapped volumes (N, 1, D, H, W) with a class per
    voxel: the domain preset splits them by depth, each rank reads its depth slices of each
    volume only (printed), and the bytes it sends are the prediction."""
    import numpy as np

    from hybridpar.commands import cli

    g = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", g.standard_normal((6, 1, 10, 8, 8)).astype(np.float32))
    np.save(tmp_path / "y.npy", g.integers(0, 3, (6, 10, 8, 8)))
    # priced where bytes cost (the model split of its first convolution, since Conv3d takes
    # one, sends more than its halo): the domain preset bands the input
    net = tmp_path / "bytes.json"
    net.write_text(json.dumps({"name": "bytes", "alpha": 1e-6, "beta": 1e-8, "flops": 1e12}))
    argv = ["train", "--model", "unet3d", "--data", str(tmp_path), "--nproc", "2", "--batch", "2"]
    argv += ["--preset", "domain", "--epochs", "1", "--save", str(tmp_path / "w.pt")]
    argv += ["--cluster", str(net)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    whole = 10 * 8 * 8 * 4 / 2**10  # KiB of one volume; a rank reads 5 of its 10 depth slices
    assert f"{whole / 2:.1f} KiB an example of its {whole:.1f} KiB" in out, out
    rows = re.findall(r"^ {30}(\w+) +(\d+) +(\d+)$", out, re.M)
    assert {"halo_fwd", "halo_bwd", "bn_stats"} <= {t for t, _, _ in rows}, out
    assert all(m == p for _, m, p in rows), rows


def _unet_1024(up: str = "transposed"):
    with torch.device("meta"):
        return UNet(1024, 3, up=up)


def test_the_planner_picks_tiles_where_bytes_cost_and_bands_where_messages_do(tmp_path):
    """The U-Net on one 1024 x 1024 image on 16 ranks: 4 x 4 tiles send about half the halo
    bytes of 16 bands in twice the messages (columns, then rows). On a cluster file with a high
    per-byte cost the planner picks tiles, on one with a high per-message cost bands; between
    them the plans' predicted halo seconds cross where alpha / beta is the bytes saved over the
    messages added, which the test prints and checks lies between the two files."""
    shape, m = (3, 1024, 1024), _unet_1024()
    layers = cost_layers(analyze(m, shape))
    bands_, tiles = Style.domain(16, 1), Style.tiles(16, 1)
    assert tiles == Style.domain(16, 1, 4)

    def halo(style: Style, net: Cluster) -> tuple[float, float]:
        plan = evaluate(layers, [style] * len(layers), PlanRequest(16, 1, net))
        assert plan.feasible, plan.reason
        terms = [c for x in plan.layers for t, c in x.terms.items() if t.startswith("halo")]
        return sum(c.bytes for c in terms), sum(c.seconds for c in terms)

    flops = 1e12
    (b_bytes, _), (t_bytes, _) = (halo(s, NET) for s in (bands_, tiles))
    assert t_bytes < 0.6 * b_bytes, (t_bytes, b_bytes)  # about half the bytes
    # the busiest rank's messages: 2 a band (up, down), 4 a tile (left, right, then up, down)
    one = Cluster("one", alpha=1.0, beta=1e-30, flops=flops)
    b_msgs, t_msgs = (halo(s, one)[1] for s in (bands_, tiles))
    assert 1.5 * b_msgs < t_msgs <= 2 * b_msgs, (t_msgs, b_msgs)
    # where the halo seconds cross: alpha * (t_msgs - b_msgs) = beta * (b busiest - t busiest)
    byte = Cluster("byte", alpha=0.0, beta=1.0, flops=flops)
    b_most, t_most = (halo(s, byte)[1] for s in (bands_, tiles))
    crossover = (b_most - t_most) / (t_msgs - b_msgs)  # alpha / beta, in bytes
    print(f"tiles {tiles} vs bands {bands_}: halo bytes per rank {t_bytes:.3g} vs {b_bytes:.3g}, "
          f"busiest rank's messages {t_msgs:.0f} vs {b_msgs:.0f}; crossover alpha/beta = "
          f"{crossover:.3g} bytes")  # fmt: skip
    chosen = {}
    for name, alpha, beta in (("bytes", 1e-6, 1e-8), ("messages", 1e-2, 1e-12)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": name, "alpha": alpha, "beta": beta, "flops": flops}))
        net = load_cluster(str(path))
        assert (alpha / beta > crossover) == (name == "messages"), (name, crossover)
        styles = set(plan_for(m, shape, 16, 1, net).export().styles.values())
        chosen[name] = {s for s in styles if s.kind == "domain"}
    assert chosen["bytes"] == {tiles}, chosen
    assert chosen["messages"] == {bands_}, chosen


def test_tiles_plan_and_train_from_the_command_line(tmp_path, capsys):
    """`hybridpar plan --scenario domain` on a cluster file where bytes cost writes a plan of
    2 x 2 tiles; `hybridpar train --plan` runs it on memory-mapped images, each rank reading its
    tile of each image only (printed), the bytes it sends the plan's."""
    import numpy as np

    from hybridpar.commands import cli

    g = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", g.standard_normal((4, 1, 32, 32)).astype(np.float32))
    y = g.integers(0, 11, (4, 32, 32))  # the zoo U-Net's 11 classes (digits-seg's)
    y[0, 0, 0] = 10
    np.save(tmp_path / "y.npy", y)
    net = tmp_path / "bytes.json"
    net.write_text(json.dumps({"name": "bytes", "alpha": 1e-6, "beta": 1e-8, "flops": 1e12}))
    plan = tmp_path / "tiles.json"
    argv = ["plan", "--model", "unet", "--input-size", "32", "--procs", "4", "--batch", "1"]
    argv += ["--scenario", "domain", "--cluster", str(net), "--out", str(plan)]
    assert cli.main(argv) == 0
    assert set(json.loads(plan.read_text())["styles"].values()) == {"domain(2x2x1)"}
    capsys.readouterr()
    argv = ["train", "--model", "unet", "--data", str(tmp_path), "--nproc", "4", "--batch", "1"]
    argv += ["--plan", str(plan), "--epochs", "1", "--save", str(tmp_path / "w.pt")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    whole = 32 * 32 * 4 / 2**10  # KiB of one image; a rank reads its 16 x 16 tile
    assert f"{whole / 4:.1f} KiB an example of its {whole:.1f} KiB" in out, out
    rows = re.findall(r"^ {30}(\w+) +(\d+) +(\d+)$", out, re.M)
    assert {"halo_fwd", "halo_bwd", "bn_stats"} <= {t for t, _, _ in rows}, out
    assert all(m == p for _, m, p in rows), rows


def test_tiles_fit_where_bands_do_not():
    """A wide image (32 x 1024) through the U-Net on 16 ranks: at a quarter of the resolution it
    has 8 rows, too few for 16 bands, so bands are refused naming the rows; 4 x 4 tiles (2 rows
    and 64 columns a tile there) take every layer, and the planner's domain plan is on them."""
    from hybridpar.core.rules import why_not

    shape = (3, 32, 1024)
    with torch.device("meta"):
        m = UNet((32, 1024), 3)
    layers = cost_layers(analyze(m, shape))
    said = next(w for x in layers if (w := why_not(x, Style.domain(16, 1), 1)))
    assert "splits 8 rows over Pr=16 ranks; the largest Pr that works is 8" in said, said
    assert not any(why_not(x, Style.domain(16, 1, 4), 1) for x in layers)
    result = plan_for(m, shape, 16, 1, load_cluster("cori-knl"))
    plan = result.scenario("domain")
    assert plan.feasible, plan.reason
    styles = {x.style for x in plan.layers if x.style.kind == "domain"}
    assert styles == {Style.domain(16, 1, 4)}, styles
