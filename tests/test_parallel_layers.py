"""ModelParallelLinear and the hybrid wrapper against single-process references, 2 and 4 gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn

from hybridpar.comm.collectives import even_split
from hybridpar.comm.grid import ProcessGrid
from hybridpar.comm.ledger import Ledger
from hybridpar.parallel.linear import ModelParallelLinear


def _mpl_worker(pr, pc, d_in, d_out):
    grid = ProcessGrid(pr, pc)
    torch.manual_seed(0)
    full = nn.Linear(d_in, d_out)
    x = torch.randn(8, d_in)
    rows = even_split(8, pc)  # this rank's batch group owns a block of the 8 examples
    lo = sum(rows[: grid.c])
    xb = x[lo : lo + rows[grid.c]].clone().requires_grad_(True)
    ledger = Ledger()
    m = ModelParallelLinear.from_linear(full, grid.model_group, ledger, "fc")
    y = m(xb)
    (y.square().sum() / 8).backward()
    for p in m.parameters():
        dist.all_reduce(p.grad, group=grid.batch_group)
    # reference, one process, the whole batch
    xr = x.clone().requires_grad_(True)
    yr = full(xr)
    (yr.square().sum() / 8).backward()
    s = slice(m.start, m.start + m.sizes[m.r])
    return {
        "y": torch.allclose(y, yr[lo : lo + rows[grid.c]], rtol=1e-5, atol=1e-6),
        "dx": torch.allclose(xb.grad, xr.grad[lo : lo + rows[grid.c]], rtol=1e-5, atol=1e-6),
        "dw": torch.allclose(m.weight.grad, full.weight.grad[s], rtol=1e-5, atol=1e-6),
        "db": torch.allclose(m.bias.grad, full.bias.grad[s], rtol=1e-5, atol=1e-6),
        "full": torch.equal(m.full()[0], full.weight.detach()),
        "kinds": sorted({e.term for e in ledger.entries}),
    }


@pytest.mark.parametrize("pr,pc", [(2, 1), (1, 2), (4, 1), (2, 2)])
def test_model_parallel_linear_matches_nn_linear(pr, pc):
    for r in run_ranks(_mpl_worker, pr * pc, pr, pc, 6, 7):  # 7 outputs: uneven shards
        assert r["y"] and r["dx"] and r["dw"] and r["db"] and r["full"], r
        assert r["kinds"] == ([] if pr == 1 else ["allgather", "dx_allreduce"])
