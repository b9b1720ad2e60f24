"""The parallel layers and redistributions against single-process references on 2, 3 and 4 gloo
ranks, and dropout masks shared by the replicas of a model group."""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import TVAlexNet, batches
from torch import nn

from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.runtime.comm.collectives import even_split
from hybridpar.runtime.comm.grid import GridSet, ProcessGrid
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel import parallelize, split_units
from hybridpar.runtime.parallel.redistribute import Move, Redistribute, StepRows


def _split_layer(pr, pc, kind):
    grid = ProcessGrid(pr, pc)
    torch.manual_seed(0)
    if kind == "linear":
        full, x = nn.Linear(6, 7), torch.randn(8, 6)  # 7 outputs: uneven shards
    else:
        full, x = nn.Conv2d(3, 7, 3, padding=1, stride=2), torch.randn(8, 3, 6, 6)
    rows = grid.rows(even_split(8, pr * pc))  # this rank's batch group owns a block of the 8
    xb = x[rows].clone().requires_grad_(True)
    ledger = Ledger()
    m = split_units(copy.deepcopy(full), grid.model_group, ledger, "layer")
    split = m.hybridpar_split
    y = m(xb)
    (y.square().sum() / 8).backward()
    for p in m.parameters():
        dist.all_reduce(p.grad, group=grid.batch_group.pg)
    xr = x.clone().requires_grad_(True)
    yr = full(xr)
    (yr.square().sum() / 8).backward()
    torch.testing.assert_close(y, yr[rows])
    torch.testing.assert_close(xb.grad, xr.grad[rows])
    torch.testing.assert_close(m.weight.grad, split.shard(full.weight.grad))
    torch.testing.assert_close(m.bias.grad, split.shard(full.bias.grad))
    assert torch.equal(split.full()["weight"], full.weight.detach())
    assert type(m) is type(full) and list(m.state_dict()) == list(full.state_dict())
    assert {e.term for e in ledger.entries} == (set() if pr == 1 else {"allgather", "dx_allreduce"})


def _split_layers(pr, pc):
    for kind in ("linear", "conv"):
        _split_layer(pr, pc, kind)


@pytest.mark.parametrize("pr,pc", [(2, 1), (1, 2), (3, 1), (4, 1), (2, 2)])
def test_split_linear_and_conv_match_the_whole_layer(pr, pc):
    run_ranks(_split_layers, pr * pc, pr, pc)


def _move(src, dst):
    """Redistribute an activation between the layouts of Pc = src and Pc = dst, forward and back."""
    P = dist.get_world_size()
    grids = GridSet([src, dst], [(src, dst)])
    rows = StepRows()
    n = 11  # uneven over every P
    rows.sizes = even_split(n, P)
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    w = torch.randn(n, 3, generator=torch.Generator().manual_seed(1))
    mine = x[grids.grid(src).rows(rows.sizes)].clone().requires_grad_(True)
    (y,) = Redistribute(Move(grids, rows, Ledger(), "layer"), src, dst)(None, (mine,))
    want = grids.grid(dst).rows(rows.sizes)
    torch.testing.assert_close(y, x[want])
    # a loss whose gradient replicas share: each rank's rows weighted by w, counted once per layout
    (y * w[want]).sum().backward()
    torch.testing.assert_close(mine.grad, w[grids.grid(src).rows(rows.sizes)])


def _moves(pairs):
    for src, dst in pairs:
        _move(src, dst)


@pytest.mark.parametrize(
    "P,pairs", [(4, [(4, 2), (2, 4), (4, 1), (1, 2)]), (2, [(2, 1), (1, 2)]), (3, [(3, 1), (1, 3)])]
)
def test_redistribution_between_nested_layouts(P, pairs):
    run_ranks(_moves, P, pairs)


def _masks(pr, pc):
    """Dropout (p = 0.5) in a layout replicated over a model group: the replicas must draw the
    same masks, or the shards they compute would not belong to one activation."""
    P = pr * pc
    torch.manual_seed(0)
    model = TVAlexNet(p=0.5)
    plan = ParallelPlan(P, 12, {"classifier": Style.model(pr, pc)}, input_shape=(1, 8, 8))
    hp = parallelize(model, plan)
    seen = []
    model.classifier[3].register_forward_hook(lambda m, a, out: seen.append(out.eq(0)))
    hp.train()
    for x, _ in batches(steps=2):
        hp.set_batch(len(x))
        hp(x[hp.input_rows(len(x))]).sum().backward()
        hp.finish_backward()
    grid = hp.output_grid
    every = [None] * P
    dist.all_gather_object(every, [m.tolist() for m in seen])
    partners = [r for r in range(P) if r // pr == grid.c]
    assert all(every[r] == every[dist.get_rank()] for r in partners)
    assert seen[0].any() and not torch.equal(seen[0], seen[1])  # it drops, and anew each step
    return seen[0].tolist()


def test_model_group_replicas_draw_the_same_dropout_masks():
    masks = run_ranks(_masks, 4, 2, 2)
    assert masks[0] == masks[1] and masks[2] == masks[3] and masks[0] != masks[2]


def _state_round_trip():
    """load_full_state_dict then full_state_dict gives back the original model's state; the model
    changed in place keeps its own state_dict keys (its shards locally)."""
    from nets import make, train_reference

    P = dist.get_world_size()
    want = train_reference(make("tv-alexnet"), batches())  # a trained state, the same on every rank
    plan = ParallelPlan(
        P,
        12,
        {"features.3": Style.model(2, 2), "classifier.4": Style.model(4, 1)},
        input_shape=(1, 8, 8),
    )
    torch.manual_seed(dist.get_rank())  # each rank starts from other weights: the load decides
    model = TVAlexNet()
    hp = parallelize(model, plan)
    hp.load_full_state_dict(want)
    assert list(model.state_dict()) == list(want)
    assert model.state_dict()["classifier.4.weight"].shape[0] < want["classifier.4.weight"].shape[0]
    got = hp.full_state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_full_state_dict_round_trip_keeps_the_original_keys():
    run_ranks(_state_round_trip, 4)
