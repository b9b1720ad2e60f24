"""Two-level clusters (issue 24, items 1 and 2): the file format, the groups a plan forms and the
hosts they span, and each collective priced by the level its group crosses."""

from __future__ import annotations

import json

import pytest

from hybridpar.core.cluster import Cluster, _from_mapping, load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.groups import (
    batch_groups,
    hosts_by_rank,
    model_groups,
    regroup_groups,
    span,
)
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style
from hybridpar.core.terms import Term
from hybridpar.planning.cost.collectives import all_gather, all_reduce
from hybridpar.planning.cost.terms import layer_comms, redistribute
from hybridpar.planning.request import PlanRequest

HOST = {"alpha": 3e-5, "beta": 2e-10, "flops": 2e10}
NET_ALPHA, NET_BETA = 1e-4, 8e-9


def two_level(rph: int = 2, **extra) -> Cluster:
    return Cluster(
        "two", ranks_per_host=rph, net_alpha=NET_ALPHA, net_beta=NET_BETA, **HOST, **extra
    )


def one_level(**extra) -> Cluster:
    return Cluster("one", **HOST, **extra)


def linear(name: str, fin: int, fout: int) -> CostLayer:
    return CostLayer(
        name=name,
        kind="linear",
        params=fin * fout + fout,
        d_in=fin,
        d_out=fout,
        x_shape=(fin,),
        y_shape=(fout,),
        kernel=None,
        out_units=fout,
        flops=2 * fin * fout,
        op="linear",
    )


@pytest.mark.parametrize("P", [1, 2, 4, 6, 8, 12])
def test_groups_tile_the_ranks(P):
    """Every grid's model groups and batch groups each cover every rank once, and meet in one
    rank; every regroup between nested layouts covers every rank once."""
    for pr in [d for d in range(1, P + 1) if P % d == 0]:
        pc = P // pr
        for groups in (model_groups(pr, pc), batch_groups(pr, pc)):
            assert sorted(k for g in groups for k in g) == list(range(P))
        for m in model_groups(pr, pc):
            for b in batch_groups(pr, pc):
                assert len(set(m) & set(b)) == 1
        for coarse in [d for d in range(1, pc + 1) if pc % d == 0]:
            groups = regroup_groups(P, pc, coarse)
            assert sorted(k for g in groups for k in g) == list(range(P))
            assert all(len(g) == pc // coarse for g in groups)


def test_span_counts_hosts_and_shared_links():
    host = hosts_by_rank(8, 4)  # two hosts of four ranks
    s = span(batch_groups(4, 2), host)  # four groups, each one rank on each host
    assert (s.hosts, s.flows, s.per_host) == (2, 4, 1)
    s = span(model_groups(4, 2), host)  # each within a host
    assert (s.hosts, s.flows, s.per_host) == (1, 0, 4)
    s = span(batch_groups(1, 8), host)  # everyone: one group crossing
    assert (s.hosts, s.flows, s.per_host) == (2, 1, 4)
    s = span(model_groups(8, 1), hosts_by_rank(8, 2))  # four hosts of two
    assert (s.hosts, s.flows, s.per_host) == (4, 1, 2)


def test_file_with_a_second_level_round_trips(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'name = "lab"\nalpha = 3e-5\nbeta = 2e-10\nflops = 2e10\n'
        "[network]\nranks_per_host = 4\nalpha = 1e-4\nbandwidth = 1.25e8\n"
    )
    c = load_cluster(str(path))
    assert (c.ranks_per_host, c.net_alpha, c.net_beta) == (4, 1e-4, 8e-9)
    back = _from_mapping(json.loads(json.dumps(c.to_dict())), "back")
    assert (back.ranks_per_host, back.net_alpha, back.net_beta) == (4, 1e-4, 8e-9)
    assert (back.alpha, back.beta) == (c.alpha, c.beta)
    # ranks_per_host may sit at the top level too; a file without [network] is one level
    path.write_text(
        "alpha = 3e-5\nbeta = 2e-10\nflops = 2e10\nranks_per_host = 2\n"
        "[network]\nalpha = 1e-4\nbandwidth_GBps = 0.125\n"
    )
    assert load_cluster(str(path)).ranks_per_host == 2
    path.write_text("alpha = 3e-5\nbeta = 2e-10\nflops = 2e10\n")
    assert not load_cluster(str(path)).two_level


@pytest.mark.parametrize(
    "text, words",
    [
        ("[network]\nalpha = 1e-4\nbandwidth = 1e8\n", "ranks_per_host"),
        ("[network]\nranks_per_host = 2\nalpha = 1e-4\n", "beta"),
        ("[network]\nranks_per_host = 0\nalpha = 1e-4\nbeta = 1e-8\n", "positive integer"),
        ("[network]\nranks_per_host = 2\nalpha = 1e-4\nbeta = -1\n", "positive"),
        ("[network]\nranks_per_host = 2\nalpha = 1e-4\nbeta = 1e-8\nspeed = 3\n", "unknown"),
        ("ranks_per_host = 2\n", "[network]"),
    ],
)
def test_a_half_given_second_level_is_refused(tmp_path, text, words):
    path = tmp_path / "c.toml"
    path.write_text("alpha = 3e-5\nbeta = 2e-10\nflops = 2e10\n" + text)
    with pytest.raises(ConfigError) as err:
        load_cluster(str(path))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_each_collective_is_priced_by_the_level_its_group_crosses():
    """Two hosts of two ranks, grid 2x2: the model groups stay within a host (the host's alpha and
    beta), the two batch groups each cross and share each host's link (the network's alpha, twice
    its beta). Grid 4x1: the one model group crosses alone."""
    x, B = linear("fc", 512, 256), 32
    two, one = two_level(), one_level()
    t2, t1 = (layer_comms(x, False, Style.model(2, 2), B, c, 4.0) for c in (two, one))
    assert t2[Term.ALLGATHER] == t1[Term.ALLGATHER]
    assert t2[Term.DX_ALLREDUCE] == t1[Term.DX_ALLREDUCE]
    n = (x.params / 2) * 4
    net2 = Cluster("n", alpha=NET_ALPHA, beta=2 * NET_BETA, flops=1.0)
    assert t2[Term.DW_ALLREDUCE].seconds == pytest.approx(all_reduce(n, 2, net2).seconds)
    assert t2[Term.DW_ALLREDUCE].bytes == t1[Term.DW_ALLREDUCE].bytes  # bytes do not change
    t4 = layer_comms(x, False, Style.model(4, 1), B, two, 4.0)
    net1 = Cluster("n", alpha=NET_ALPHA, beta=NET_BETA, flops=1.0)
    got = all_gather(B * x.d_out * 4, 4, net1)
    assert t4[Term.ALLGATHER].seconds == pytest.approx(got.seconds)
    # the hand-off 1x4 -> 2x2 gathers within pairs of ranks of one host; 1x4 -> 4x1 crosses
    d = x.d_in
    within = redistribute(Style.batch(4), Style.model(2, 2), d, B, two, 4.0)
    assert within == redistribute(Style.batch(4), Style.model(2, 2), d, B, one, 4.0)
    across = redistribute(Style.batch(4), Style.model(4, 1), d, B, two, 4.0)
    assert across.seconds == pytest.approx(all_gather(B * d * 4, 4, net1).seconds)


def test_host_reducer_is_priced_in_two_steps():
    """Pure batch over two hosts of two ranks: the host reducer sums within each host through
    shared memory, then the two leaders all-reduce over the network: its seconds are the two
    steps', less than the flat all-reduce that crosses with all four ranks."""
    x, B = linear("fc", 512, 256), 32
    c = two_level(small_alpha=1e-5, shm_beta=1e-10)
    flat = layer_comms(x, False, Style.batch(4), B, c, 4.0)[Term.DW_ALLREDUCE]
    host = layer_comms(x, False, Style.batch(4), B, c, 4.0, reducer="host")[Term.DW_ALLREDUCE]
    n = x.params * 4
    net1 = Cluster("n", alpha=NET_ALPHA, beta=NET_BETA, flops=1.0)
    intra = 1e-5 + 1e-10 * all_reduce(n, 2, c).bytes
    assert host.seconds == pytest.approx(intra + all_reduce(n, 2, net1).seconds)
    assert flat.seconds == pytest.approx(all_reduce(n, 4, net1).seconds)
    assert host.seconds < flat.seconds
    assert host.bytes == flat.bytes  # the plan books the flat bytes; the report scales by hosts


def test_one_level_cluster_prices_as_before():
    """A cluster without a second level prices every group alike (no span is computed)."""
    c = one_level().priced(4)
    assert c.group("batch", 2, 2) is c and c.regroup(4, 4, 2) is c and c.over([[0, 1]]) is c


def test_the_planner_uses_what_it_knows_of_the_hosts():
    """digits-wide, P = 8 on four hosts of two ranks joined at 1 Gbit/s, B = 256. Planned
    knowing the hosts, the pick is at least as fast as every scenario's plan made for one level
    (all evaluated on the two levels), and over 10 % faster there than the one-level pick: a
    4x2 grid for the FC layers, whose batch groups sum a quarter of the FC weights' gradients
    each over the network. The two-level pick keeps the 4x2 grid but places it: its batch groups
    within a host, its model groups across (core.groups)."""
    from hybridpar.planning.analysis_cache import zoo_cost_layers
    from hybridpar.planning.search import evaluate, plan_layers

    layers, P, B = zoo_cost_layers("digits-wide", 8), 8, 256
    two = two_level()
    knowing = plan_layers(layers, PlanRequest(P, B, two))
    blind = plan_layers(layers, PlanRequest(P, B, one_level()))
    best = knowing.best
    styles = [x.style for x in best.layers]
    again = evaluate(layers, styles, PlanRequest(P, B, two), placement=best.placement)
    assert again.total_s == pytest.approx(best.total_s)
    assert best.placement == (4, 2) and blind.best.placement is None
    for plan in blind.scenarios:
        if plan.feasible:
            again = evaluate(layers, [x.style for x in plan.layers], PlanRequest(P, B, two))
            assert best.total_s <= again.total_s * (1 + 1e-12)
    blind_there = evaluate(layers, [x.style for x in blind.best.layers], PlanRequest(P, B, two))
    assert best.total_s < 0.9 * blind_there.total_s
    assert {x.style.label for x in blind.best.layers} == {x.style.label for x in best.layers}


def test_the_network_fit_takes_its_bandwidth_from_the_large_sizes():
    """A link that lets a burst through at once and the rest at its rate (a token bucket): the
    network's fit finds the rate, from the slope of the largest sizes."""
    from hybridpar.runtime.train.calibration import SIZES, fit_network

    rate, burst = 1.25e8, 256 * 1024
    times = {n: 1e-4 + max(0, n - burst) / rate for n in SIZES}  # 2 ranks: each sends n bytes
    alpha, beta = fit_network(times, 2)
    assert 1 / beta == pytest.approx(rate)
    # the smallest size less its bytes at the rate, over the two latencies of a 2-rank sum
    assert alpha == pytest.approx((1e-4 - SIZES[0] / rate) / 2)


def test_the_cluster_files_the_docs_show_load(tmp_path):
    """Every TOML cluster file in the README and docs/cluster.md loads as it is pasted."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    found = 0
    for doc in (root / "README.md", root / "docs" / "cluster.md", root / "docs" / "cost-model.md"):
        for block in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S):
            path = tmp_path / f"c{found}.toml"
            path.write_text(block)
            c = load_cluster(str(path))  # refuses a file it cannot price with
            found += 1
            assert c.two_level == ("[network]" in block), block  # the second level was read
    assert found >= 3


def test_the_report_says_how_the_ranks_sat_on_hosts():
    from hybridpar.runtime.train.report import host_layout

    assert host_layout(["a", "a", "b", "b"]) == {
        "count": 2,
        "ranks": {"a": 2, "b": 2},
        "node_by_node": True,
        "even": True,
    }
    dealt = host_layout(["a", "b", "a", "b"])  # round-robin: the groups follow the hosts
    assert dealt["count"] == 2 and not dealt["node_by_node"]
    assert not host_layout(["a", "a", "b"])["even"] and host_layout(["a", "a", "b"])["node_by_node"]
