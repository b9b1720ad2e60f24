"""Where an iteration's ranks meet (planning.cost.sync): every blocking call of the runtime, counted as
its ledger books them, each priced at the small all-reduce `hybridpar calibrate` timed
(`Cluster.meeting_s`), carried by the planner into the total and the predicted split; and a
calibration written with the meetings' tables of an older release refused by name."""

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest

from hybridpar.core.cluster import Cluster, _from_mapping, load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.terms import Term
from hybridpar.planning.cost.collectives import Comm
from hybridpar.planning.cost.sync import calls, meetings, segments
from hybridpar.planning.search import make_plan

BASE = Cluster("t", alpha=1e-4, beta=1e-9, flops=1e11, cores=2)
TIMED = dataclasses.replace(  # timed at 2 ranks, as `hybridpar calibrate --nproc 2` does
    BASE, small_alpha=50e-6, shm_beta=1e-10, by_procs=((2, 1e-4, 1e-9, 50e-6, 1e-10),)
)


def _layer(f, b, u=0.0, **terms):
    return SimpleNamespace(
        terms={Term(k): Comm(Term(k), 2, n, 0.0) for k, n in terms.items()},
        forward_s=f,
        backward_s=b,
        update_s=u,
    )


def test_the_meetings_of_an_iteration_in_the_order_the_runtime_runs_them():
    """A batch-parallel trunk (its weights summed after the backward), a hand-off into a split
    layer that all-gathers its output and sums dX, and a last layer with nothing to send: the
    forward meets at the hand-off and at the all-gather, the backward at the dX sum and at the
    hand-off's return (back to back: no compute between), then at the gradient sums with the
    trunk's backward and every update before them."""
    layers = [
        _layer(0.010, 0.020, 0.001, dw_allreduce=100),
        _layer(0.003, 0.006, 0.002, redistribute=50, allgather=40, dx_allreduce=40),
        _layer(0.001, 0.002, 0.0),
    ]
    got = segments(layers)
    assert got == [
        (0.010, True),  # the trunk's forward, then the hand-off
        (0.003, True),  # the split layer's forward, then its all-gather
        (pytest.approx(0.001 + 0.002 + 0.006), True),  # last layer both ways, then dX
        (0.0, True),  # the hand-off's return right after
        (pytest.approx(0.020 + 0.003), False),  # the trunk's backward and the updates
    ]
    # without gradient sums (one model group: nothing replicated) the iteration is a loop: the
    # compute after the last meeting ends at the next iteration's first
    loop = segments([_layer(0.010, 0.020, 0.001), layers[1], layers[2]])
    assert loop[0] == (pytest.approx(0.010 + 0.020 + 0.001 + 0.002), True)
    assert all(blocking for _, blocking in loop) and len(loop) == 4
    # zero bytes (a group of one) is no meeting
    assert segments([_layer(0.01, 0.02, allgather=0)]) == []


def test_a_term_meets_as_often_as_the_runtime_calls_it():
    """A gathering hand-off meets forward only, a halo once per window (the pooling's after the
    convolution's forward), an encoded dX sum twice backward; `calls` is what the plan file and
    the ledger tests count."""
    x = SimpleNamespace(
        terms={
            Term.REDISTRIBUTE: Comm("redistribute", 2, 50, 0.0, (1, 0)),
            Term.HALO_FWD: Comm("halo", 2, 10, 0.0, (2, 0)),
            Term.HALO_BWD: Comm("halo", 2, 10, 0.0, (0, 2)),
            Term.DX_ALLREDUCE: Comm("all_reduce", 2, 40, 0.0, (0, 2)),
            Term.BN_STATS: Comm("all_reduce", 2, 8, 0.0),
        },
        forward_s=0.004,
        backward_s=0.008,
        update_s=0.0,
    )
    trunk = _layer(0.010, 0.020)
    met, rest = meetings([trunk, x])
    assert met == [
        ("redistribute", 0.010),
        ("halo_fwd", 0.0),
        ("halo_fwd", 0.004),  # the pooling's window, after the convolution
        ("bn_stats", 0.0),
        ("dx_allreduce", 0.008),
        ("dx_allreduce", 0.0),
        ("halo_bwd", 0.0),
        ("halo_bwd", 0.0),
    ]
    assert rest == pytest.approx(0.020)
    assert calls(Term.REDISTRIBUTE, Comm("redistribute", 2, 0.0, 0.0, (1, 1))) == (0, 0)
    assert calls(Term.ALLGATHER, Comm("all_gather", 2, 8, 0.0)) == (1, 0)


def test_each_meeting_costs_the_calibrated_small_all_reduce_and_the_split_adds_up():
    """digits-wide at P = 4 on a host `hybridpar calibrate` measured: every plan pays the
    small-message latency fitted at 2 ranks at each meeting (the nearest count: `Cluster.priced`);
    the predicted split (the report's and validate's) shows the blocking meetings' share as
    waiting and adds up to the total; a batch plan meets only at the gradient sums, a model plan
    at its blocking collectives too. On a cluster nothing was measured on (a preset, a file
    without `by_procs`) the meetings are free."""
    plain = make_plan("digits-wide", 4, 64, BASE, scenarios=["batch", "model"])
    timed = make_plan("digits-wide", 4, 64, TIMED, scenarios=["batch", "model"])
    each = TIMED.priced(4).meeting_s()
    assert each == 1e-4  # the alpha `calibrate` fitted (at 2 ranks, the nearest count)
    for name in ("batch", "model"):
        p, t = plain.scenario(name), timed.scenario(name)
        assert p.sync.meetings == 0 and p.total_s == pytest.approx(p.compute_s + p.exposed_comm_s)
        cuts = segments(t.layers)
        assert t.sync.meetings == len(cuts) > 0
        assert t.sync.excess_s == pytest.approx(each * len(cuts))
        assert t.sync.wait_s == pytest.approx(each * sum(b for _, b in cuts))
        assert t.total_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.sync.excess_s)
        split = t.split()
        assert split["compute_s"] + split["comm_s"] == pytest.approx(split["total_s"])
        assert split["waiting_s"] == t.sync.wait_s
    batch, model = timed.scenario("batch"), timed.scenario("model")
    assert batch.sync.wait_s == 0 and batch.sync.meetings == 1
    assert model.sync.wait_s > 0 and model.sync.meetings > batch.sync.meetings
    exported = timed.export(model).totals
    assert exported["waiting_s"] == model.sync.wait_s
    assert exported["total_s"] == pytest.approx(model.total_s)
    # through gloo too (`--no-shared-memory`): the ranks meet all the same
    assert TIMED.priced(4, shared_memory=False).meeting_s() == 1e-4


def test_a_job_across_hosts_meets_at_the_small_all_reduce_timed_across_them():
    two = Cluster(
        "two", 1e-5, 1e-9, 1e11, small_alpha=20e-6, shm_beta=1e-10, ranks_per_host=2,
        net_alpha=1e-4, net_beta=1e-8, net_small=300e-6, by_procs=((2, 3e-5, 1e-9, 2e-5, 1e-10),),
    )  # fmt: skip
    assert two.priced(4).meeting_s() == 300e-6 and two.priced(2).meeting_s() == 3e-5


@pytest.mark.parametrize(
    "entry, key",
    [
        ({"by_procs": {"4": {"alpha": 1e-5, "beta": 1e-9, "sync": [[1e-3, 2e-3, 1e-4]]}}}, "by_procs 4 sync"),
        ({"network": {"ranks_per_host": 2, "alpha": 1e-4, "beta": 1e-8, "sync": [[1e-3, 2e-3, 1e-4]]}}, "[network] sync"),
    ],
)  # fmt: skip
def test_a_calibration_with_the_removed_meetings_table_is_refused_by_name(
    tmp_path, cache, entry, key
):
    """A localhost.json an older release wrote (the meetings' table per count, or across hosts)
    is never read silently: one line names the key and `hybridpar calibrate`."""
    data = {"name": "localhost", "alpha": 1e-5, "beta": 1e-9, "flops": 1e10, "cores": 2, **entry}
    (cache / "localhost.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        load_cluster("localhost")
    msg = str(e.value)
    assert "\n" not in msg and key in msg and "`hybridpar calibrate`" in msg, msg
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=re.escape(f"{key} is no longer read")):
        load_cluster(str(path))


def test_a_calibration_at_2_and_4_ranks_prices_8_and_16():
    """A job of more ranks than `hybridpar calibrate` measured is priced with the fit of the
    largest count it measured below; 3 ranks on 2 cores wait for a core as 4 do and take 4's
    fit; a count it measured, its own."""
    two = {"alpha": 2e-5, "beta": 1e-9}
    four = {"alpha": 4e-5, "beta": 2e-9}
    data = {"alpha": 2e-5, "beta": 1e-9, "flops": 1e11, "cores": 16}
    c = _from_mapping({**data, "by_procs": {"2": two, "4": four}}, "test")
    for P in (8, 16):
        assert (c.priced(P).alpha, c.priced(P).beta) == (4e-5, 2e-9)
    both = _from_mapping({**data, "cores": 2, "by_procs": {"2": two, "4": four}}, "test")
    assert (both.priced(3).alpha, both.priced(3).beta) == (4e-5, 2e-9)
    assert c.priced(2).alpha == 2e-5  # as measured


def test_waits_split_at_the_fastest_rank_of_each_call():
    """The report's split and the calibration's sync table share one rule: per call, the
    shortest time any rank saw is the transfer and the rest of each rank's is waiting."""
    from hybridpar.runtime.train.report import split_waits

    transfer, waiting = split_waits([{0: 1.0, 1: 3.0}, {0: 2.0, 1: 1.0}, {0: 1.5}])
    assert transfer == pytest.approx(1.0 + 1.0 + 1.0 + 1.0 + 1.0)
    assert waiting == pytest.approx(0.0 + 2.0 + 1.0 + 0.0 + 0.5)


def _calibration_with_three_shm_levels() -> dict:
    from hybridpar.runtime.train import calibration

    levels = iter([(31e-6, 1e-10), (62e-6, 3e-10)])
    calibration._time_shm = lambda *a: next(levels)
    calibration._time_allreduce = lambda *a, **k: {}
    return calibration._time_all((8,), 1)


def test_a_small_collectives_cost_is_the_mean_of_measurements_spread_over_the_calibration():
    """Issue 42 item 2: `small_alpha` at 4 ranks on 2 cores was 30-85 us from one calibration to
    the next: the shared-memory all-reduce costs one of two levels for seconds at a time, and
    one measurement's median caught either. It is the mean of two, taken before and after the
    all-reduces."""
    from dist_helpers import run_ranks

    from hybridpar.runtime.train.calibration import _mean_shm

    for got in run_ranks(_calibration_with_three_shm_levels, 2):
        assert got["small"] == pytest.approx(93e-6 / 2) and got["shm_beta"] == pytest.approx(2e-10)
    assert _mean_shm([(None, None)] * 3) == (None, None)  # several hosts: no such path
