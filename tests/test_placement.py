"""Rank placement (issue 24, item 3): a plan may put the batch groups of one grid on consecutive
ranks (within a host) and its model groups across hosts. The rule is one function
(core.groups.why_not_placement) for the planner and the plan; the runtime builds every group
from the placed positions; a placed plan trains as one process does and books what it predicts."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import MAKERS, B, assert_same_state, batches, make, train_parallel, train_reference
from test_equivalence import _measured

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.groups import (
    batch_groups,
    host_order,
    model_groups,
    placed,
    position_of,
    rank_of,
    why_not_placement,
)
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.core.rules import why_not
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export, plan_layers
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import parallelize

# two hosts of two ranks, a slow network between them
TWO = Cluster(
    "two", alpha=3e-5, beta=2e-10, flops=2e10, ranks_per_host=2, net_alpha=1e-4, net_beta=8e-9
)


def test_positions_and_ranks():
    for placement in [(2, 2), (2, 3), (3, 2), (4, 2)]:
        P = placement[0] * placement[1]
        ranks = [rank_of(k, placement) for k in range(P)]
        assert sorted(ranks) == list(range(P))
        assert [position_of(r, placement) for r in ranks] == list(range(P))
    # grid 2x2 placed: batch groups {0, 1} and {2, 3} (one host each), model groups across
    assert placed(batch_groups(2, 2), (2, 2)) == [[0, 1], [2, 3]]
    assert placed(model_groups(2, 2), (2, 2)) == [[0, 2], [1, 3]]


def test_the_placement_rule():
    assert why_not_placement((2, 2), [(1, 4), (2, 2)]) == ""
    assert why_not_placement((4, 2), [(1, 8), (2, 4), (4, 2)]) == ""
    assert "out of order" in why_not_placement((2, 4), [(1, 8), (2, 4), (4, 2)])
    assert "out of order" in why_not_placement((2, 2), [(4, 1)])  # one model group of all
    assert "out of order" in why_not_placement((2, 4), [(1, 8), (2, 4), (8, 1)])


def test_ranks_dealt_round_robin_are_put_back_host_by_host():
    assert host_order(["a", "a", "b", "b"]) is None  # torchrun's numbering: nothing to follow
    assert host_order(["a", "a", "b"]) is None
    order = host_order(["a", "b", "a", "b"])  # SLURM --distribution=cyclic
    assert order == [0, 2, 1, 3]
    assert host_order(["b", "a", "a", "b", "c", "c"]) == [0, 3, 1, 2, 4, 5]
    # the 2x2 grid's model groups (consecutive positions) land within a host, batch groups across
    assert placed(model_groups(2, 2), None, order) == [[0, 2], [1, 3]]
    assert placed(batch_groups(2, 2), None, order) == [[0, 1], [2, 3]]
    # placed so that the batch groups stay within a host: they do, on the dealt ranks too
    assert placed(batch_groups(2, 2), (2, 2), order) == [[0, 2], [1, 3]]
    for at in [(None, order), ((2, 2), order)]:
        assert [position_of(rank_of(k, *at), *at) for k in range(4)] == [0, 1, 2, 3]
    assert why_not_placement(None, [(1, 4), (2, 2)], order) == ""
    assert why_not_placement((2, 2), [(1, 4), (2, 2)], order) == ""
    # one model group of all four in host order is [0, 2, 1, 3]: out of rank order
    assert "number the ranks host by host" in why_not_placement(None, [(4, 1)], order)


def _follows_hosts(P: int) -> list[str]:
    """Ranks dealt to two emulated hosts round-robin: the 2x2 grid's model groups sit within a
    host (as placed, its batch groups), the run equals one process and books what its plan
    predicts; a 4x1 model group cannot follow the hosts, and says so."""
    rank = dist.get_rank()
    os.environ["HYBRIDPAR_HOST"] = "h0,h1,h0,h1"
    name = "digits-wide"
    data = batches(MAKERS[name][1])
    want = train_reference(make(name), data) if rank == 0 else None
    _, layers = _plan(name, P)
    done = []
    for grid, placement in [((2, 2), None), ((2, 2), (2, 2)), ((4, 1), None)]:
        styles = [Style.model(*grid) if x.kind == "linear" else Style.batch(P) for x in layers]
        plan = evaluate(layers, styles, PlanRequest(P, B, TWO), placement=placement)
        assert plan.feasible, plan.reason
        plan = export(plan, procs=P, batch=B, choices=Choices(), input_shape=MAKERS[name][1])
        ledger = Ledger()
        hp = parallelize(make(name), plan, RuntimeOptions(), ledger=ledger)
        g = hp.ctx.grids.grid(grid[1])
        model = dist.get_process_group_ranks(g.model_group.pg)
        batch = dist.get_process_group_ranks(g.batch_group.pg)
        if grid == (4, 1):
            assert hp.order is None and "host by host" in hp.why_not_hosts
        elif placement is None:  # model groups within a host: h0 holds ranks 0 and 2
            assert hp.order == [0, 2, 1, 3] and not hp.why_not_hosts
            assert model == [rank % 2, rank % 2 + 2], model
            assert batch == [rank - rank % 2, rank - rank % 2 + 1], batch
        else:  # placed: batch groups within a host
            assert batch == [rank % 2, rank % 2 + 2], batch
        got = train_parallel(hp, data)
        measured = _measured(ledger, len(data))
        if rank == 0:
            label = f"{grid} {placement}"
            assert_same_state(got, want, label)
            for k, v in plan.predicted_bytes(by_layer=True).items():
                assert measured[k] == pytest.approx(v, rel=1e-12), f"{label}: {k}"
            done.append(label)
    return done


def test_ranks_dealt_round_robin_train_in_groups_that_follow_the_hosts():
    assert len(run_ranks(_follows_hosts, 4, 4, timeout_s=240)[0]) == 3


def _plan(name: str, P: int, cluster=TWO) -> ParallelPlan:
    builder, shape = MAKERS[name]
    with torch.device("meta"):
        model = builder()
    layers = cost_layers(analyze(model, shape))
    r = plan_layers(
        layers,
        PlanRequest(P, B, cluster, choices=Choices(bn="global"), model=name, input_shape=shape),
    )
    return r, layers


def test_plans_carry_their_placement_and_refuse_a_bad_one(tmp_path):
    r, layers = _plan("tv-alexnet", 4)
    placed_plans = [
        p for ps in r.candidates.values() for p in ps if p.feasible and p.placement is not None
    ]
    assert placed_plans, "the planner tried no placement on a two-level cluster"
    plan = r.export(placed_plans[0])
    path = tmp_path / "p.json"
    plan.save(path)
    back = ParallelPlan.load(path)
    assert back.placement == plan.placement == (2, 2)
    assert back.to_json() == plan.to_json()
    bad = plan.to_dict() | {"placement": [4, 1]}
    with pytest.raises(ConfigError, match="Pr, Pc > 1"):
        ParallelPlan.from_dict(bad)
    model = {k: Style.model(4, 1) for k in plan.styles}
    with pytest.raises(ConfigError, match="out of order"):
        replace(plan, styles=model)
    with pytest.raises(ConfigError, match="engine ddp"):
        replace(plan, styles={k: Style.batch(4) for k in plan.styles}, engine="ddp")
    # the planner's pricing of the placed plan is evaluate's, placement included
    again = evaluate(
        layers, [x.style for x in placed_plans[0].layers], PlanRequest(4, B, TWO), placement=(2, 2)
    )
    assert again.total_s == pytest.approx(placed_plans[0].total_s)


def test_the_planner_places_when_it_pays():
    """alexnet-owt 64 x 64, B = 32, on two hosts of two ranks with a slow network: the 2x2 grid
    placed (its batch groups, which sum the FC weights' gradients, within a host) is predicted
    cheaper than unplaced, and the planner's pick is placed and at least as cheap as every
    unplaced candidate."""
    from hybridpar.planning.analysis_cache import zoo_cost_layers

    r = plan_layers(zoo_cost_layers("alexnet-owt", 64), PlanRequest(4, 32, TWO))
    same = {p.placement: p for p in r.candidates["same-grid"] if p.grid == (2, 2)}
    assert same[(2, 2)].total_s < same[None].total_s
    unplaced = [p for ps in r.candidates.values() for p in ps if p.feasible and not p.placement]
    assert r.best.total_s <= min(p.total_s for p in unplaced)
    assert r.best.placement == (2, 2)


def _trains_as_one_process(names: list[str], P: int) -> list[str]:
    rank = dist.get_rank()
    done = []
    for name in names:
        data = batches(MAKERS[name][1])
        want = train_reference(make(name), data) if rank == 0 else None
        r, _ = _plan(name, P)
        plans = []
        for ps in r.candidates.values():
            for p in ps:
                if p.feasible and p.placement is not None:
                    plan = r.export(p)
                    if all(plan.styles != q.styles for q in plans):
                        plans.append(plan)
        assert plans, name
        if name == "digits-cnn":  # the convolutions split by rows, placed
            _, layers = _plan(name, P)
            d = Style.domain(2, 2)
            styles = [d if not why_not(x, d, B) else Style.model(2, 2) for x in layers]
            chosen = evaluate(layers, styles, PlanRequest(P, B, TWO), placement=(2, 2))
            plans = [r.export(chosen)]
        for plan in plans:
            ledger = Ledger()
            hp = parallelize(make(name), plan, RuntimeOptions(), ledger=ledger)
            grids = hp.ctx.grids
            grid = grids.grid(2) if 2 in grids.grids else None
            if grid is not None and grid.pr == 2:  # the placed 2x2 grid's groups
                mine = dist.get_process_group_ranks(grid.model_group.pg)
                assert mine == [rank % 2, rank % 2 + 2], mine
                assert (grid.r, grid.c) == (rank // 2, rank % 2)
            got = train_parallel(hp, data)
            measured = _measured(ledger, len(data))
            if rank == 0:
                label = f"{name} {plan.scenario} {sorted({s.label for s in plan.styles.values()})}"
                assert_same_state(got, want, label)
                predicted = plan.predicted_bytes(by_layer=True)
                assert set(measured) == set(predicted), label
                for k, v in predicted.items():
                    assert measured[k] == pytest.approx(v, rel=1e-12), f"{label}: {k}"
                done.append(label)
    return done


def test_placed_plans_train_as_one_process_and_book_the_predicted_bytes():
    """P = 4, placement 2x2: every placed candidate the planner found for three model families
    (a torchvision-style AlexNet, resnet20 with global BN, digits-wide), and digits-cnn with its
    convolutions split by rows (domain 2x2: the halos between placed model groups), equal one
    process."""
    done = run_ranks(
        _trains_as_one_process,
        4,
        ["tv-alexnet", "resnet20", "digits-wide", "digits-cnn"],
        4,
        timeout_s=400,
    )[0]
    assert len(done) >= 9 and any("domain" in d for d in done), done
