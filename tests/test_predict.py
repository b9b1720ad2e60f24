"""Inference across ranks (issue 74): `HybridTrainer.predict(x, out=...)` writes each rank's band,
tile or depth band of the outputs straight into their place of one memory-mapped file, and no
rank's largest tensor is more than its band and halo of the one process's largest.

The oracle: float64, every written value one process's whole-image inference at rtol 1e-9, the
class masks (argmax) equal exactly. One spawn per P runs every cell."""

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster, load_cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import UNet
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
CLASSES = 3


class Largest(TorchDispatchMode):
    """The most elements of any activation (a tensor of `dims` spatial dimensions and at most
    `b` examples; a weight has more rows) an operation returned while it was on."""

    def __init__(self, b: int, dims: int) -> None:
        super().__init__()
        self.numel, self.b, self.dims = 0, b, dims

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == self.dims + 2 and len(t) <= self.b:
                self.numel = max(self.numel, t.numel())
        return out


def _cells(P: int) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    """(label, image size, batch, Pr, tile columns): bands of an image and a volume's depth
    bands at every P, on 4 ranks 2 x 2 tiles too, and on 2 ranks two batch groups of bands."""
    cells = [("bands", (37, 12), 1, P, 1), ("depth bands", (13, 6, 5), 1, P, 1)]
    if P == 4:
        cells.append(("tiles", (29, 12), 1, 4, 2))
    if P == 2:
        cells.append(("batch groups", (21, 12), 2, 1, 1))
    return cells


def _model(size: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    return UNet(size, CLASSES, width=4, dims=len(size)).double()


def _trainer(size, b: int, P: int, pr: int, pw: int) -> HybridTrainer:
    shape = (3, *size)
    layers = cost_layers(analyze(_model(size), shape))
    style = Style.domain(pr, P // pr, pw) if pr > 1 else Style.batch(P)
    plan = evaluate(layers, [style] * len(layers), PlanRequest(P, b, NET, elem_bytes=8))
    assert plan.feasible, plan.reason
    plan = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    return HybridTrainer(_model(size), plan, opt, input_shape=shape, verify=False)


def _predict(P: int, folder: str) -> int:
    rank = dist.get_rank()
    for label, size, b, pr, pw in _cells(P):
        g = torch.Generator().manual_seed(len(size) + b)
        x = torch.randn(b, 3, *size, generator=g, dtype=torch.float64)
        whole = Largest(b, len(size))
        with whole, torch.no_grad():
            want = _model(size).eval()(x)
        t = _trainer(size, b, P, pr, pw)
        path = f"{folder}/{label.replace(' ', '-')}.npy"
        if rank == 0:
            np.lib.format.open_memmap(path, "w+", np.float64, tuple(want.shape))
        dist.barrier()
        out = np.lib.format.open_memmap(path, "r+")
        masks: list = []
        mine = Largest(b, len(size))
        with mine:
            assert t.predict(x, out=out) is None
        t.predict(x, out=lambda index, part, kept=masks: kept.append((index, part.argmax(1))))
        out.flush()
        dist.barrier()
        got = torch.from_numpy(np.load(path))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=label)
        for index, mask in masks:  # this rank's part of the class mask, exactly
            assert torch.equal(mask, want.argmax(1)[(index[0], *index[2:])]), label
        # no rank held more than its band (tile) and a halo of the largest whole tensor
        spans = [-(-size[0] // (pr // pw)), -(-size[1] // pw) if pw > 1 else size[1]]
        share = (spans[0] + 4) / size[0] * (spans[1] + 4 * (pw > 1)) / size[1] / (P // pr)
        assert mine.numel <= whole.numel * min(share, 1), (label, mine.numel, whole.numel)
    return len(_cells(P))


@pytest.mark.parametrize("P", [2, 3, 4])
def test_predict_writes_every_rank_s_band_into_one_file_as_one_process(P, tmp_path):
    """A U-Net on bands and tiles, a 3-d U-Net on depth bands, a batch split: the written
    outputs one process's whole-image inference (float64, rtol 1e-9), the class masks equal,
    every rank's largest tensor within its band and halo."""
    assert run_ranks(_predict, P, P, str(tmp_path), timeout_s=120)[0] == len(_cells(P))


def _weights(path, size=32) -> torch.nn.Module:
    """A U-Net of the zoo for 11 classes with random weights, saved as `train --save` does."""
    from hybridpar.core.models import build_any

    torch.manual_seed(1)
    model = build_any("unet", (1, size, size), 11)
    torch.save(model.state_dict(), path)
    return model.eval()


def test_predict_from_the_command_line_writes_one_process_s_masks(tmp_path, capfd):
    """`train --save` then `predict --weights` on 2 ranks (bands): every image's mask one
    process's argmax and its float64 probabilities one process's softmax; images of two sizes
    in one folder each get their own plan."""
    from PIL import Image

    from hybridpar.commands.cli import main

    weights = tmp_path / "w.pt"
    assert main(["train", "--model", "unet", "--data", "digits-seg:32:20", "--epochs", "1",
                 "--max-steps", "1", "--batch", "4", "--nproc", "2", "--preset", "batch",
                 "--save", str(weights), "--quiet", "--no-verify"]) == 0  # fmt: skip
    from hybridpar.core.models import build_any
    from hybridpar.runtime.train.data import digits_seg

    model = build_any("unet", (1, 32, 32), 11).double().eval()
    model.load_state_dict(torch.load(weights))
    out = tmp_path / "out"
    args = ["predict", "--model", "unet", "--weights", str(weights), "--nproc", "2",
            "--out", str(out), "--probabilities", "--dtype", "float64"]  # fmt: skip
    assert main([*args, "--data", "digits-seg:32:3"]) == 0
    x = torch.from_numpy(digits_seg("digits-seg:32:3", 0)[0]).double()
    with torch.no_grad():
        want = model(x)
    for i in range(3):
        mask = np.load(out / f"{i:05d}.mask.npy")
        assert mask.dtype == np.uint8 and np.array_equal(mask, want[i].argmax(0).numpy())
        probs = torch.from_numpy(np.load(out / f"{i:05d}.probabilities.npy"))
        torch.testing.assert_close(probs, want[i].softmax(0), rtol=1e-9, atol=1e-12)
    said = capfd.readouterr().out
    assert "3 images in" in said and "(32 x 32: domain(2x1), peak per rank predicted " in said
    # a folder of images of two sizes: a plan each, float16 probabilities by default
    folder = tmp_path / "images"
    folder.mkdir()
    g = np.random.default_rng(0)
    for name, (h, w) in (("a", (32, 32)), ("b", (48, 32))):
        Image.fromarray(g.integers(0, 255, (h, w), dtype=np.uint8)).save(folder / f"{name}.png")
    assert main([*args[:-2], "--data", str(folder)]) == 0
    for name, (h, w) in (("a", (32, 32)), ("b", (48, 32))):
        img = np.asarray(Image.open(folder / f"{name}.png"), dtype=np.float32) / 255
        one = build_any("unet", (1, h, w), 11).eval()
        one.load_state_dict(torch.load(weights))
        with torch.no_grad():
            want = one(torch.from_numpy(img)[None, None])[0]
        assert np.array_equal(np.load(out / f"{name}.mask.npy"), want.argmax(0).numpy()), name
        probs = np.load(out / f"{name}.probabilities.npy")
        assert probs.dtype == np.float16 and probs.shape == (11, h, w)
    assert re.search(
        r"\(32 x 32: domain\(2x1\), peak per rank predicted \S+ MiB, measured \S+ MiB; "
        r"48 x 32: domain\(2x1\)",
        capfd.readouterr().out,
    )


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_predicted_peak_is_what_torch_s_memtracker_measures(monkeypatch):
    """The planner's peak per rank (plan.memory_bytes) against the peak torch's MemTracker
    measures, for a training step and an inference of a U-Net at 128^2 and 256^2 and a 3-d
    U-Net at 32^3 on bands, P = 1, 2, 4 (benchmarks/peak_memory.py prints the table): within
    10 %."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from peak_memory import CELLS, measure

    for P in (1, 2, 4):
        for label, mode, want, got in run_ranks(measure, P, CELLS, timeout_s=300)[0]:
            assert want == pytest.approx(got, rel=0.10), (label, P, mode, want, got)


def _fitted(size: int, mode: str, limit: float, path: str) -> float:
    """The busiest rank's peak (MemTracker's) over `limit`, of the zoo U-Net at size x size, one
    image, a training step (its second) or an inference, under the plan `plan --fit` wrote."""
    from hybridpar.core.models import build_any
    from hybridpar.core.plan import ParallelPlan
    from hybridpar.runtime.parallel.api import parallelize
    from hybridpar.runtime.parallel.memory import peak_bytes
    from hybridpar.runtime.parallel.trainer import own_outputs

    P, shape = dist.get_world_size(), (1, size, size)
    plan = ParallelPlan.load(path)
    assert tuple(plan.input_shape) == shape, plan.input_shape
    x, y = torch.randn(1, *shape), torch.randint(0, 11, (1, size, size))
    if mode == "predict":
        engine = parallelize(build_any("unet", shape, 11), plan, input_shape=shape)
        got = peak_bytes(lambda: own_outputs(engine, x), engine)
    else:
        opt = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
        t = HybridTrainer(build_any("unet", shape, 11), plan, opt, input_shape=shape, verify=False)
        t.train_step(x, y)
        got = peak_bytes(lambda: t.train_step(x, y), t.model, t.optimizer)
    every = [None] * P
    dist.all_gather_object(every, got)
    return max(every) / limit


@pytest.mark.parametrize("mode, limit_mib", [("predict", 3.0), ("train", 8.0)])
def test_plan_fit_finds_the_largest_image_that_runs_under_the_limit(
    mode, limit_mib, tmp_path, capsys
):
    """`plan --fit` on 2 ranks: its size runs (on bands, MemTracker's peak within the model's 10
    % of the limit), and 10 % larger fits no plan under the limit."""
    import re

    from hybridpar.commands.cli import main
    from hybridpar.planning.search import make_plan

    net = tmp_path / "bytes.json"
    net.write_text('{"name": "bytes", "alpha": 1e-6, "beta": 1e-9, "flops": 1e12}')
    limit = limit_mib / 1024
    args = ["plan", "--model", "unet", "--input-size", "64", "--batch", "1", "--procs", "2",
            "--mode", mode, "--fit", "--memory-limit", str(limit), "--cluster", str(net),
            "--scenario", "domain", "--bytes-per-element", "4", "--out", tmp_path / "p.json"]  # fmt: skip
    assert main([str(a) for a in args]) == 0
    said = capsys.readouterr().out
    found = re.search(r"under \S+ GiB a rank: (\d+) x \1 \(peak ([\d.]+) GiB\); (\d+) x", said)
    assert found, said
    size, bigger = int(found[1]), int(found[3])
    assert size > 64 and bigger == size + 16, said
    ratio = run_ranks(_fitted, 2, size, mode, limit * 2**30, str(tmp_path / "p.json"))[0]
    assert ratio <= 1.10, (size, ratio)
    larger = make_plan("unet", 2, 1, load_cluster(str(net)), input_size=-(-size * 11 // 10),
                       scenarios=("domain",), mode=mode, memory_limit=limit * 2**30,
                       elem_bytes=4)  # fmt: skip
    assert not larger.scenario("domain").feasible, larger.scenario("domain")


def _priced(P: int) -> int:
    """Inference under plans made for it (mode predict): bands; and bands, batch and tiles in
    turn (every move between them): the bytes each rank sends equal the plan's per (layer,
    term), the outputs one process's."""
    from dist_helpers import bytes_are_predicted

    size, b, shape = (29, 12), 4, (3, 29, 12)
    layers = cost_layers(analyze(_model(size), shape))
    cycles = [(Style.domain(P, 1),)]
    if P == 4:
        cycles.append(
            (Style.domain(4, 1), Style.batch(4), Style.domain(4, 1, 2), Style.domain(2, 2))
        )
    x = torch.randn(b, *shape, generator=torch.Generator().manual_seed(P), dtype=torch.float64)
    with torch.no_grad():
        want = _model(size).eval()(x)
    for cycle in cycles:
        moves = [0]  # a style per segment, in turn (a segment's layers share one layout)
        for a, z in itertools.pairwise(layers):
            moves.append(moves[-1] + (z.segment is None or z.segment != a.segment))
        styles = [cycle[k % len(cycle)] for k in moves]
        request = PlanRequest(P, b, NET, elem_bytes=8, mode="predict")
        plan = evaluate(layers, styles, request)
        assert plan.feasible, plan.reason
        plan = export(plan, procs=P, batch=b, choices=Choices(), input_shape=shape)
        moved = sum(p.bytes for p in plan.predicted if p.term == "redistribute")
        assert (moved > 0) == (len(cycle) > 1), moved
        opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
        t = HybridTrainer(_model(size), plan, opt, input_shape=shape, verify=False)
        first = len(t.ledger.entries)
        got = t.predict(x)
        del t.ledger.entries[:first]  # the parameters' broadcast at the start
        label = f"predict P={P} {[s.label for s in cycle]}"
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=label)
        bytes_are_predicted(t.ledger, plan, label, 1, unpredicted=("metrics", "param_broadcast"))
    return len(cycles)


@pytest.mark.parametrize("P", [2, 4])
def test_an_inference_sends_the_bytes_its_plan_predicts(P):
    """A plan for inference prices the forward alone: its halos, and of a move its forward half;
    the bytes measured equal it per (layer, term)."""
    assert run_ranks(_priced, P, P, timeout_s=120)[0] == (2 if P == 4 else 1)


def test_predict_takes_a_plan_file_and_volumes(tmp_path, capfd):
    """`plan --mode predict --out` then `predict --plan`: the plan file's layout (1 x 2 tiles, by
    hand) runs; a folder of x.npy volumes on depth bands (the 3-d U-Net): masks one
    process's."""
    from hybridpar.commands.cli import main
    from hybridpar.core.models import build_any

    net = tmp_path / "bytes.json"
    net.write_text('{"name": "bytes", "alpha": 1e-6, "beta": 1e-9, "flops": 1e12}')
    cases = (("unet", (1, 32, 32), "1x2x1"), ("unet3d", (1, 16, 16, 16), None))
    for name, shape, tiles in cases:
        torch.manual_seed(2)
        model = build_any(name, shape, 3).eval()
        torch.save(model.state_dict(), tmp_path / f"{name}.pt")
        data = tmp_path / name
        data.mkdir()
        x = np.random.default_rng(0).standard_normal((2, *shape)).astype(np.float32)
        np.save(data / "x.npy", x)
        args = ["predict", "--model", name, "--weights", tmp_path / f"{name}.pt", "--data", data,
                "--nproc", "2", "--out", tmp_path / f"{name}-out"]  # fmt: skip
        if tiles:
            side = str(shape[-1])
            assert main(["plan", "--model", name, "--input-size", side, "--procs", "2",
                         "--batch", "1", "--mode", "predict", "--scenario", "domain",
                         "--cluster", str(net), "--out", str(tmp_path / "p.json")]) == 0  # fmt: skip
            plan = json.loads((tmp_path / "p.json").read_text())
            plan["styles"] = {k: "domain(1x2x1)" for k in plan["styles"]}  # columns, by hand
            plan.pop("predicted")
            (tmp_path / "p.json").write_text(json.dumps(plan))
            args += ["--plan", tmp_path / "p.json"]
        assert main([str(a) for a in args]) == 0
        with torch.no_grad():
            want = model(torch.from_numpy(x)).argmax(1).numpy()
        for i in range(2):
            got = np.load(tmp_path / f"{name}-out" / f"{i:05d}.mask.npy")
            assert np.array_equal(got, want[i]), (name, i)
        said = capfd.readouterr().out
        assert ("domain(1x2x1)" if tiles else "domain(2x1)") in said, said
