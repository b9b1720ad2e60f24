"""Inference across ranks (issue 74): `HybridTrainer.predict(x, out=...)` writes each rank's band,
tile or depth band of the outputs straight into their place of one memory-mapped file, and no
rank's largest tensor is more than its band and halo of the one process's largest.

The oracle: float64, every written value one process's whole-image inference at rtol 1e-9, the
class masks (argmax) equal exactly. One spawn per P runs every cell."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
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
