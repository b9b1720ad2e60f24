"""`hybridpar validate` and the compute profile it prices plans with: the rank statistics, the
candidates, the summary, a real run end to end and its bad inputs; ProfileModel's pricing by
style, that the planner's search weighs it, and the profile's cache."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import run_ranks

from hybridpar.commands import validate as val
from hybridpar.commands.validate import Candidate, candidates, contested, spearman, summarize
from hybridpar.core.cluster import PRESETS, Cluster
from hybridpar.core.layers import CostLayer, Norm
from hybridpar.core.plan import Style
from hybridpar.planning import profile as prof
from hybridpar.planning.cost.compute import ProfileModel, style_times
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import make_plan, plan_layers

VALIDATE = [sys.executable, "-m", "hybridpar", "validate"]


# --- rank statistics and the summary -------------------------------------------------------


def test_spearman_orders_ties_and_degenerate_cases():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): r = 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1], [2]) is None
    assert spearman([3, 3, 3], [1, 2, 3]) is None  # one side has a single rank
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


def _cand(label, predicted, measured, picked=False):
    plan = make_plan("digits-wide", 2, 16, PRESETS["cori-knl"]).export()
    plan = type(plan).from_dict(
        {**plan.to_dict(), "totals": {"total_s": predicted, "compute_s": predicted, "comm_s": 0}}
    )
    runs = [
        {"time_s": t, "compute_s": t, "comm_wait_s": 0.0, "round": k}
        for k, t in enumerate(measured)
    ]
    return Candidate(label, plan, picked, runs)


def test_summary_errors_rank_agreement_and_the_pick():
    cands = [
        _cand("a", 1.0, [2.0, 1.0, 1.5], picked=True),  # median round 1.5: error -1/3
        _cand("b", 2.0, [1.0]),  # +100 %, the measured fastest
        _cand("c", 3.0, [3.0, 3.0]),  # 0
    ]
    assert cands[0].measured == {
        "total_s": 1.5,
        "compute_s": 1.5,
        "comm_s": 0.0,
        "waiting_s": 0.0,
        "lo_s": 1.0,
        "hi_s": 2.0,
    }
    s = summarize(cands)
    assert s["plans"] == 3
    assert s["median_abs_error"] == pytest.approx(1 / 3)
    assert s["worst_abs_error"] == pytest.approx(1.0) and s["worst"] == "b"
    assert s["spearman_rho"] == pytest.approx(spearman([1, 2, 3], [1.5, 1.0, 3.0]))
    assert s["fastest"] == "b" and s["picked"] == "a" and not s["picked_is_fastest"]
    assert s["picked_over_fastest"] == pytest.approx(1.5)
    assert summarize([_cand("x", 1.0, [])]) == {}
    # an even count: the mean of the two middle rounds (not the faster of them: a plan run
    # twice would otherwise keep its better round, one run five times its middle one)
    assert _cand("even", 1.0, [2.0, 1.0, 4.0, 3.0]).measured["total_s"] == pytest.approx(2.5)
    assert s["reference"] is None  # no ddp plan ran: no speed-ups


def test_speed_ups_are_taken_round_by_round_over_the_ddp_plan():
    """Each plan's measured speed-up is the median of ddp's time over its own in the rounds both
    ran: a drift of the machine that slows every plan of a round alike cancels (round 2 here runs
    at half speed), and its predicted speed-up is the ratio of the predictions."""
    ddp = _cand("ddp", 4.0, [4.0, 8.0, 4.4])
    a = _cand("a", 1.0, [2.0, 4.0, 2.0], picked=True)  # 2x, 2x, 2.2x: median 2.0
    b = _cand("b", 2.0, [2.0, 4.0])  # 2x in both of its rounds, predicted 2x
    assert a.speedup(ddp) == (4.0, pytest.approx(2.0))
    assert a.speedup_error(ddp) == pytest.approx(1.0) and b.speedup_error(ddp) == pytest.approx(0)
    s = summarize([a, b, ddp])
    assert s["reference"] == "ddp" and s["speedup_worst"] == "a"
    assert s["speedup_median_abs_error"] == pytest.approx(0.5)
    assert s["speedup_worst_abs_error"] == pytest.approx(1.0)
    # the absolute errors measure the drift too: b's median time is 3.0 against 2.0 predicted
    assert b.error == pytest.approx(-1 / 3)


def test_the_contested_plans_are_the_pick_and_those_measured_faster_or_close_behind():
    cands = [
        _cand("a", 1.0, [1.0]),
        _cand("pick", 1.0, [2.0, 3.0, 2.5], picked=True),  # median round 2.5
        _cand("b", 1.0, [2.4]),
        _cand("c", 1.0, [2.7]),  # within 10 % behind
        _cand("d", 1.0, [2.8]),  # 12 % behind
        _cand("unrun", 1.0, []),
    ]
    assert contested(cands) == [1, 0, 2, 3]
    assert contested([_cand("p", 1.0, [1.0], picked=True), _cand("x", 1.0, [1.15])]) == []
    assert contested([_cand("p", 1.0, [1.0], picked=True), _cand("x", 1.0, [1.05])]) == [0, 1]
    assert contested([_cand("p", 1.0, [], picked=True), _cand("x", 1.0, [1.5])]) == []


@pytest.mark.parametrize("b_again, fastest", [(1.3, "pick"), (0.8, "b")])
def test_validate_runs_the_contested_plans_again_and_judges_the_pick_on_every_round(
    tmp_path, monkeypatch, capsys, b_again, fastest
):
    """b measures faster than the pick in the first two rounds; three rounds more of both
    decide: a fluke (b_again 1.3 s) leaves the pick the fastest, a real lead (0.8 s) keeps b
    ahead. c, slower than the pick, is not run again."""
    times = {"pick": [1.0] * 5, "b": [0.9, 0.9, *[b_again] * 3], "c": [2.0, 2.0]}
    monkeypatch.setattr(
        val,
        "_run_one",
        lambda c, *_: {"time_s": times[c.label].pop(0), "compute_s": 0, "comm_wait_s": 0},
    )
    # (each run is tagged with its round: 0 and 1 for every plan, then 2, 3, 4 for the contested)
    cands = [_cand("pick", 1.0, [], picked=True), _cand("b", 1.0, []), _cand("c", 1.0, [])]
    agreed = []
    again = val.validate(cands, None, tmp_path, 2, False, 3, lambda w: agreed.append(w) or w)
    assert agreed == [[0, 1]] and again["confirmed"] == ["pick", "b"]
    assert again["pick_before"] == pytest.approx(1 / 0.9)
    assert [len(c.runs) for c in cands] == [5, 5, 2] and not any(times.values())
    assert [r["round"] for r in cands[1].runs] == [0, 1, 2, 3, 4]
    assert summarize(cands)["fastest"] == fastest
    val.print_table(cands, {**summarize(cands), **again}, "head")
    assert "(1.11x on the first rounds alone)" in capsys.readouterr().out
    cands = [_cand("pick", 1.0, [], picked=True), _cand("c", 1.0, [])]
    times = {"pick": [1.0, 1.0], "c": [2.0, 2.0]}
    assert val.validate(cands, None, tmp_path, 2, False, 3)["confirmed"] == []  # pick fastest


def _contested_on_ranks(tmp: str) -> None:
    """validate on every rank of a job, as under torchrun: rank 0 alone gets the reports, and
    every run is a job of all the ranks (a barrier here), so a rank that ran other plans
    than rank 0 would leave the others waiting."""
    import torch.distributed as dist

    rank, times, ran = dist.get_rank(), {"pick": [1.0] * 5, "b": [0.9] * 5, "c": [2.0] * 2}, []

    def run_one(c, *_):
        dist.barrier()
        ran.append(c.label)
        t = times[c.label].pop(0)
        return {"time_s": t, "compute_s": 0, "comm_wait_s": 0} if rank == 0 else None

    val._run_one = run_one  # a spawned process of its own
    cands = [_cand("pick", 1.0, [], picked=True), _cand("b", 1.0, []), _cand("c", 1.0, [])]
    again = val.validate(cands, None, Path(tmp) / str(rank), 2, False, 3, val._from_rank_0)
    assert again["confirmed"] == ["pick", "b"]
    assert ran == ["pick", "b", "c"] * 2 + ["pick", "b"] * 3


def test_every_rank_runs_the_plans_rank_0_found_contested(tmp_path):
    run_ranks(_contested_on_ranks, 2, str(tmp_path))


def test_candidates_are_distinct_plans_with_the_pick_first_and_the_presets_after():
    result = make_plan("digits-wide", 4, 64, PRESETS["cori-knl"])
    ddp = result.export(result.scenario("batch"), engine="ddp")
    batch = result.export(result.scenario("batch"))
    cands = candidates(result, 3, {"ddp": ddp, "batch": batch})
    ours = [c for c in cands if c.plan.engine == "hybridpar"]
    assert cands[0].picked and sum(c.picked for c in cands) == 1
    assert cands[0].plan.styles == result.export().styles
    chains = [tuple(c.plan.styles.values()) for c in ours]
    assert len(set(chains)) == len(chains)
    # the top 3 by predicted time, in that order
    totals = [c.plan.totals["total_s"] for c in cands[:3]]
    assert totals == sorted(totals)
    presets = [c for c in cands if c.label in ("ddp", "batch")]
    assert [c.plan.engine for c in cands if c.label == "ddp"] == ["ddp"]
    assert cands[: len(cands) - len(presets)] == ours[: len(cands) - len(presets)]
    # the batch preset is run once: only when the top 3 does not hold it already
    assert sum(tuple(c.plan.styles.values()) == tuple(batch.styles.values()) for c in ours) == 1


# --- the command -----------------------------------------------------------------------------


def test_validate_runs_each_plan_and_writes_the_table(tmp_path, cache, localhost):
    env = localhost(cores=os.cpu_count() or 1)
    out = tmp_path / "v"
    r = subprocess.run(
        VALIDATE
        + [
            "--model",
            "digits-wide",
            "--batch",
            "16",
            "--procs",
            "2",
            "--top",
            "2",
            "--steps",
            "3",
            "--repeat",
            "1",
            "--confirm",
            "1",
        ]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads((out / "validate.json").read_text())
    assert (out / "validate.png").stat().st_size > 0
    labels = [p["label"] for p in d["plans"]]
    assert len(d["plans"]) == 3 and labels[-1] == "ddp" and d["plans"][0]["picked"]
    again = d["summary"]["confirmed"]  # the pick and those faster or close, once more: or none
    assert again == [] or (again[0] == labels[0] and len(again) > 1)
    for p in d["plans"]:
        assert p["rounds"] == 1 + (p["label"] in again) and p["measured"]["total_s"] > 0
        m, e = p["measured"], p["error"]
        assert e == pytest.approx((p["predicted"]["total_s"] - m["total_s"]) / m["total_s"])
    assert d["summary"]["plans"] == 3 and d["summary"]["picked"] == labels[0]
    assert "Spearman's rho" in r.stdout and "plans: |error| median" in r.stdout
    # each plan's speed-up over ddp, predicted and measured in the same round
    assert d["summary"]["reference"] == "ddp" and "speed-up over ddp: |error| median" in r.stdout
    ddp = d["plans"][-1]
    for p in d["plans"]:
        up = p["speedup"]
        assert up["reference"] == "ddp" and up["measured"] > 0
        want = ddp["predicted"]["total_s"] / p["predicted"]["total_s"]
        assert up["predicted"] == pytest.approx(want)
    assert len(list((out / "plans").glob("*.json"))) == 3
    # priced with the profile measured here (cached for the next plan), not FLOPs at 1e10
    profiles = list((cache / "profiles").glob("digits-wide-1x8x8-t*.json"))
    assert len(profiles) == 1


def test_a_poisoned_cached_quantity_is_named_by_calibrate_check(tmp_path, cache, localhost):
    """The optimizer step of a cached profile made 100x slower (the issue's was 10x, kept by
    every later prediction): `hybridpar calibrate --check` measures it again and says it no
    longer holds (exit 1)."""
    env = localhost(cores=os.cpu_count() or 1)
    data = json.loads((cache / "localhost.json").read_text())
    data["by_procs"] = {"2": {"alpha": 1e-5, "beta": 1e-9}}
    (cache / "localhost.json").write_text(json.dumps(data))
    hp = [sys.executable, "-m", "hybridpar"]
    args = ["--model", "digits-wide", "--batch", "16", "--procs", "2"]
    plan = hp + ["plan", *args, "--cluster", "localhost"]  # measures the profile
    r = subprocess.run(plan, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    (profile,) = (cache / "profiles").glob("digits-wide-1x8x8-t*.json")
    cached = json.loads(profile.read_text())
    assert cached["update_s"] > 0 and "update_s_spread" in cached and cached["iteration"]
    cached["update_s"] *= 100
    profile.write_text(json.dumps(cached))

    r = subprocess.run(
        hp + ["calibrate", "--check", "--nproc", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    (row,) = [line for line in r.stdout.splitlines() if line.strip().startswith("update_s")]
    assert row.split()[-1] == "NO" and float(row.split()[-3]) < 0.1  # now/cached
    assert "no longer hold" in r.stdout and "update_s x0.0" in r.stdout.splitlines()[-1]
    assert json.loads(profile.read_text()) == cached  # a check saves nothing


def test_validate_under_torchrun_runs_across_the_jobs_hosts(tmp_path, cache, localhost):
    """Under torchrun validate runs in the job (issue 24, item 4): rank 0 plans on a two-level
    cluster (two hosts of one rank, named by HYBRIDPAR_HOST, the network slower than the host)
    and every rank runs each candidate in turn; rank 0 writes the table."""
    env = localhost(cores=os.cpu_count() or 1)
    data = json.loads((cache / "localhost.json").read_text())
    data["network"] = {"ranks_per_host": 1, "alpha": 1e-4, "beta": 8e-9}
    (cache / "localhost.json").write_text(json.dumps(data))
    out = tmp_path / "v"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "hybridpar", "validate", "--model", "digits-wide", "--batch", "16"]
        + ["--procs", "2", "--top", "1", "--steps", "2", "--repeat", "1", "--confirm", "1"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        env={**env, "HYBRIDPAR_HOST": "h0,h1"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads((out / "validate.json").read_text())
    assert [p["label"] for p in d["plans"]][-1] == "ddp" and d["plans"][0]["picked"]
    # every rank ran what rank 0 found contested (the pick and ddp within 10 %: once more)
    again = d["summary"]["confirmed"]
    assert all(p["rounds"] == 1 + (p["label"] in again) for p in d["plans"])
    assert all(p["measured"]["total_s"] > 0 for p in d["plans"])
    assert d["cluster"]["network"]["ranks_per_host"] == 1
    assert "(torchrun, 2 host(s))" in r.stdout
    assert r.stdout.count("plans: |error| median") == 1  # rank 0 alone prints the table


# --- the compute profile ---------------------------------------------------------------------

LAYER = CostLayer(
    name="fc",
    kind="linear",
    params=1000,
    d_in=10,
    d_out=100,
    x_shape=(10,),
    y_shape=(100,),
    kernel=None,
    out_units=100,
    flops=2000,
    members=("fc", "act"),
    extra_params=0,
)


def test_profile_prices_what_a_rank_runs_under_each_style():
    # seconds for the whole layer: fc costs 10/6 ms at 8 samples but only 16/8 at 16 (a fixed
    # 4/4 ms per call); act 1/1 ms at 8 samples, 2/2 at 16 (none)
    table = {
        8: {"fc": (10e-3, 6e-3), "act": (1e-3, 1e-3)},
        16: {"fc": (16e-3, 8e-3), "act": (2e-3, 2e-3)},
    }
    pm = ProfileModel(table, update_s=1e-6, contention=2.0)
    B, P = 16, 2
    f, b, u = style_times(pm, LAYER, Style.batch(P), B, P)  # B/P = 8 samples of all of it
    assert (f, b, u) == pytest.approx((2 * 11e-3, 2 * 7e-3, 2 * 1000e-6))
    # half of fc's weights on 16 samples: half its time there; act on all 16
    f, b, u = style_times(pm, LAYER, Style.model(P, 1), B, P)
    assert (f, b, u) == pytest.approx((2 * (8e-3 + 2e-3), 2 * (4e-3 + 2e-3), 2 * 500e-6))
    # half the rows of 16 samples, whole weights: fc's fixed 4 ms per call (the intercept of
    # 10 ms at 8 samples and 16 at 16) whole and half of the other 12; act has none
    f, b, u = style_times(pm, LAYER, Style.domain(P, 1), B, P)
    assert (f, b) == pytest.approx((2 * (10e-3 + 1e-3), 2 * (6e-3 + 1e-3)))
    # an unmeasured count: the nearest one's per-sample times
    assert pm.times(LAYER, 4) == pytest.approx((11e-3, 7e-3))
    # a fit below zero is no fixed cost: a quarter of the rows cost a quarter
    lean = ProfileModel({8: {"fc": (8e-3, 4e-3)}, 16: {"fc": (20e-3, 8e-3)}})
    assert style_times(lean, LAYER, Style.domain(4, 1), 16, 4)[:2] == pytest.approx((5e-3, 2e-3))


def test_domain_and_model_price_their_layers_at_the_shares_measured():
    """Domain's windows at the share of their time measured on the busiest band; model's
    weighted module at the share measured with the busiest rank's units; without a share for
    that Pr and count, 1/Pr (domain: of what grows with the samples)."""
    table = {16: {"fc": (16e-3, 8e-3), "act": (2e-3, 2e-3)}}
    # fc at 0.7 / 0.8 of its time on the busiest of 2 bands, 0.9 / 0.6 with half its units
    shares = {(2, 16): {"fc": (0.7, 0.8)}}, {(2, 16): {"fc": (0.9, 0.6)}}
    pm = ProfileModel(table, bands=shares[0], splits=shares[1], contention=2.0)
    f, b, _ = style_times(pm, LAYER, Style.domain(2, 1), 16, 2)
    assert (f, b) == pytest.approx((2 * (0.7 * 16e-3 + 1e-3), 2 * (0.8 * 8e-3 + 1e-3)))
    f, b, _ = style_times(pm, LAYER, Style.model(2, 1), 16, 2)
    assert (f, b) == pytest.approx((2 * (0.9 * 16e-3 + 2e-3), 2 * (0.6 * 8e-3 + 2e-3)))
    f, b, _ = style_times(pm, LAYER, Style.domain(2, 1), 32, 2)  # half the rows, no fixed part
    assert (f, b) == pytest.approx((2 * (16e-3 + 2e-3), 2 * (8e-3 + 2e-3)))
    f, b, _ = style_times(pm, LAYER, Style.model(4, 1), 16, 4)
    assert (f, b) == pytest.approx((2 * (16e-3 / 4 + 2e-3), 2 * (8e-3 / 4 + 2e-3)))


def test_a_split_is_timed_with_the_busiest_ranks_units_against_the_whole(monkeypatch):
    import torch

    seen = []
    linear = torch.nn.Linear(6, 10)
    linear.register_forward_pre_hook(lambda m, a: seen.append(m.weight.shape[0]))
    conv = torch.nn.Sequential(torch.nn.Unflatten(1, (1, 10, 1)), torch.nn.Conv2d(1, 7, (3, 1)))
    net = torch.nn.Sequential(linear, torch.nn.ReLU(), conv)
    shares = prof._measure_splits(net, (6,), 3, 4, repeats=2)
    assert set(shares) == {"0", "2.1"}  # the linear layer and the convolution
    assert set(seen) == {10, 4} and seen.count(4) == 3  # ceil(10 / 3) units, warm-up + 2
    assert all(f > 0 and b > 0 for f, b in shares.values())


def test_the_busiest_band_follows_the_halo_geometry():
    from hybridpar.core.halo import Window

    # 3x3, padding 1, 8 rows in 2 bands: each reads 6 (one padding row, 4 own, one halo row)
    assert prof._busiest_band(Window(3, 1, 1, 1, 8), 2) == (1, 0, 4, 1, 0)
    # in 4 bands a middle rank reads a halo row on each side of its 2 rows
    assert prof._busiest_band(Window(3, 1, 1, 1, 8), 4) == (0, 1, 2, 1, 0)
    # a 2x2 stride-2 pooling reads its own rows only; 5x5 over 2-row bands crosses two bands
    assert prof._busiest_band(Window(2, 2, 0, 1, 8), 4) == (0, 0, 2, 0, 0)
    assert prof._busiest_band(Window(5, 1, 2, 1, 8), 4) == (0, 2, 2, 2, 0)


def test_the_profile_measures_each_window_on_its_band():
    from torch import nn

    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1)
    )
    shares = prof._measure_bands(net, (1, 8, 8), 2, 4, 2)
    assert list(shares) == ["0", "2", "3"]  # the convolutions and the pooling, in forward order
    assert all(f > 0 and b > 0 for f, b in shares.values())
    assert all(p.grad is None for p in net.parameters())  # measured without leaving gradients


def test_the_search_weighs_compute_by_style():
    """Where the gathered output's layers cost much (riders at B/Pc samples under model), the
    planner keeps the layer batch-parallel although model moves fewer bytes: it would not if
    compute were left out of its objective."""
    net = Cluster("t", alpha=1e-6, beta=1e-10, flops=1e12)
    heavy = {n: {"fc": (1e-6 * n, 1e-6 * n), "act": (1e-2 * n, 1e-2 * n)} for n in (8, 16)}
    layers = [LAYER]
    kw = {"scenarios": ["per-layer"], "grad_bucket": None}
    by_flops = plan_layers(layers, PlanRequest(2, 16, net, **kw))
    by_profile = plan_layers(layers, PlanRequest(2, 16, net, compute=ProfileModel(heavy), **kw))
    assert by_flops.best.layers[0].style.kind == "model"
    assert by_profile.best.layers[0].style.kind == "batch"
    assert by_profile.best.compute_s == pytest.approx(2 * 8 * (1e-6 + 1e-2))


def test_profile_is_cached_extended_and_remeasured_after_a_calibration(cache, monkeypatch):
    calls = []
    real = prof._measure_count

    def counting(model, shape, n, repeats, device="cpu", leaves=True):
        if leaves:
            calls.append(n)
        return real(model, shape, n, 1, device, leaves)

    monkeypatch.setattr(prof, "_measure_count", counting)
    bands, splits = prof._measure_bands, prof._measure_splits
    monkeypatch.setattr(prof, "_measure_bands", lambda m, s, pr, n, _, d: bands(m, s, pr, n, 1, d))
    monkeypatch.setattr(prof, "_measure_splits", lambda m, s, pr, n, _, d: splits(m, s, pr, n, 1))
    host = Cluster("localhost", alpha=1e-5, beta=1e-9, flops=1e10, cores=2)
    pm = prof.planning_compute(host, "digits-wide", (1, 8, 8), 2, 8)  # counts 4 (1x2), 8 (2x1)
    assert sorted(calls) == [4, 8] and sorted(pm.per_count) == [4, 8]
    assert list(pm.bands) == [(2, 8)] and set(pm.bands[(2, 8)]) == {"0", "2", "4"}  # domain 2x1
    assert list(pm.splits) == [(2, 8)] and set(pm.splits[(2, 8)]) == {"0", "2", "6", "9", "11"}
    assert pm.contention == 1.0 and pm.update_s > 0
    assert set(pm.per_count[8]) >= {"0", "2", "6", "9", "11"}  # the leaves, by module name
    prof.planning_compute(host, "digits-wide", (1, 8, 8), 2, 8)
    assert sorted(calls) == [4, 8]  # cached
    (cached,) = (cache / "profiles").glob("digits-wide-*-t1.json")
    pm4 = prof.planning_compute(host, "digits-wide", (1, 8, 8), 4, 8)  # adds 2; 4 ranks share 2
    assert sorted(calls) == [2, 4, 8]
    assert pm4.contention == 2.0  # the one price of oversubscription: 4 ranks x 1 thread / 2
    again = Cluster("localhost", alpha=1e-5, beta=1e-9, flops=2e10, cores=2)
    prof.planning_compute(again, "digits-wide", (1, 8, 8), 2, 8)
    assert sorted(calls) == [2, 4, 4, 8, 8]  # a new calibration measures again
    # a profile cached by an older release (no `method`) is measured again
    old = json.loads(cached.read_text())
    cached.write_text(json.dumps({k: v for k, v in old.items() if k != "method"}))
    prof.planning_compute(again, "digits-wide", (1, 8, 8), 2, 8)
    assert sorted(calls) == [2, 4, 4, 4, 8, 8, 8]
    # a malformed table of band shares: measured again, not a crash
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "bands": ["2x8"]}))
    pm = prof.planning_compute(again, "digits-wide", (1, 8, 8), 2, 8)
    assert sorted(calls) == [2, 4, 4, 4, 4, 8, 8, 8, 8] and list(pm.bands) == [(2, 8)]
    assert prof.planning_compute(PRESETS["cori-knl"], "digits-wide", (1, 8, 8), 2, 8) is None


def test_a_bf16_run_is_profiled_under_its_autocast(cache, monkeypatch):
    """`--amp bf16` trains under bf16 autocast, so its compute profile is timed under the same
    autocast and cached apart from the fp32 one; before, a bf16 job was priced with fp32
    times (resnet20 at 16 examples runs 1.2x faster in bf16 on this CPU, a GPU far more)."""
    import torch

    seen = []
    real = prof._measure_count

    def once(model, shape, n, repeats, device, leaves=True):
        seen.append((leaves, torch.is_autocast_enabled("cpu")))
        return real(model, shape, n, 1, device, leaves)

    monkeypatch.setattr(prof, "_measure_count", once)
    host = Cluster("localhost", alpha=1e-5, beta=1e-9, flops=1e10, cores=2)
    fp32 = prof.planning_compute(host, "digits-wide", (1, 8, 8), 1, 8)
    bf16 = prof.planning_compute(host, "digits-wide", (1, 8, 8), 1, 8, amp="bf16")
    # one count each, timed under its own precision
    assert [amp for leaves, amp in seen if leaves] == [False, True]
    first_bf16 = seen.index((True, True))
    assert not any(amp for _, amp in seen[:first_bf16]) and all(amp for _, amp in seen[first_bf16:])
    assert fp32.source != bf16.source and bf16.source.endswith("-bf16.json")
    assert json.loads(Path(bf16.source).read_text())["measured"]["amp"] == "bf16"
    with prof._measuring("digits-wide", (1, 8, 8), 1, "cpu", "bf16") as net:
        assert net(torch.randn(2, 1, 8, 8)).dtype == torch.bfloat16
    with prof._measuring("digits-wide", (1, 8, 8), 1, "cpu") as net:
        assert net(torch.randn(2, 1, 8, 8)).dtype == torch.float32


def test_one_stalled_call_does_not_make_a_leaf_slow_in_the_profile(monkeypatch):
    """Two twin layers; one stalls once, for 30 ms, in the five timed iterations (the machine
    taking its core away). Each leaf keeps its median iteration, so the twins stay alike: with the
    mean, the stalled one took over 90 % of the time and the planner routed around it (resnet20's
    layer3.1.conv1 profiled at 8.7 ms forward against 0.13 ms for its twins). The profile reads a
    clock that moves 0.1 ms a reading and 30 ms in the stall, so the machine's own noise
    cannot decide the test."""
    import torch
    from torch import nn

    now = [0.0]

    def clock(_device):
        now[0] += 1e-4
        return now[0]

    class Stalls(nn.Linear):
        hooked = 0  # calls timed by the leaves' hooks

        def forward(self, x):
            if self._forward_hooks:
                Stalls.hooked += 1
                if Stalls.hooked == 3:  # the third of the five hooked iterations
                    now[0] += 0.03
            return super().forward(x)

    monkeypatch.setattr(prof, "clock", clock)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), Stalls(256, 256), nn.Linear(256, 10))
    per, _ = prof._measure_count(model, (256,), 64, 5)
    twin, stalled = sum(per["0"]), sum(per["1"])
    assert Stalls.hooked == 5
    assert stalled == pytest.approx(twin), (stalled, twin)
    assert prof._median_iteration([1.0, 1.0, 9.0, 1.0, 1.0], 5) == 1.0
    assert prof._median_iteration([1.0, 2.0] * 5, 5) == 3.0  # called twice an iteration
    assert prof._median_iteration([], 5) == 0.0


# --- collectives measured at the job's number of ranks ------------------------------------------


def test_a_job_is_priced_with_the_collectives_measured_at_its_P(cache):
    from hybridpar.core.cluster import load_cluster
    from hybridpar.core.errors import ConfigError
    from hybridpar.core.terms import Term

    base = {"name": "localhost", "alpha": 1e-5, "beta": 1e-9, "flops": 1e10, "cores": 2}
    four = {"alpha": 2e-5, "beta": 3e-9, "small_alpha": None, "shm_beta": None}
    (cache / "localhost.json").write_text(json.dumps({**base, "by_procs": {"4": four}}))
    host = load_cluster("localhost")
    assert host.priced(2).alpha == 1e-5 and host.priced(4).beta == 3e-9
    assert host.priced(4).alpha == 2e-5
    assert host.to_dict()["by_procs"] == {"4": four}

    def dw(P):
        r = plan_layers([LAYER], PlanRequest(P, 16, host, scenarios=["batch"], grad_bucket=None))
        return r.best.layers[0].terms[Term.DW_ALLREDUCE].seconds

    n = LAYER.params * 4  # fp32 gradient bytes
    assert dw(2) == pytest.approx(2 * 1e-5 * 1 + 1e-9 * n)  # 2 (P-1)/P n = n at P = 2
    assert dw(4) == pytest.approx(2 * 2e-5 * 2 + 3e-9 * 1.5 * n)
    (cache / "localhost.json").write_text(json.dumps({**base, "by_procs": {"x": four}}))
    with pytest.raises(ConfigError, match="by_procs"):
        load_cluster("localhost")


def test_shared_memory_collectives_take_their_share_of_a_crowded_host(cache):
    """A shared-memory collective is the ranks' own copies, sums and polling. Timed back to back
    by `hybridpar calibrate`, the waiting ranks hand each other the cores; in a step the ranks
    around it compute. So where ranks outnumber the cores it is priced at the contention factor,
    as compute and the codecs are: 4 ranks on 2 cores, twice the measured numbers (before:
    once; resnet20's domain plans then came out 17-28 % low, docs/validate.md)."""

    from hybridpar.core.cluster import _from_mapping, load_cluster
    from hybridpar.core.terms import Term

    base = {"name": "localhost", "alpha": 1e-5, "beta": 1e-9, "flops": 1e10, "cores": 2}
    two = {"alpha": 1e-5, "beta": 1e-9, "small_alpha": 3e-5, "shm_beta": 1e-10}
    four = {"alpha": 2e-5, "beta": 3e-9, "small_alpha": 5e-5, "shm_beta": 2e-10}
    (cache / "localhost.json").write_text(json.dumps({**base, "by_procs": {"2": two, "4": four}}))
    host = load_cluster("localhost")
    assert (host.priced(2).small_alpha, host.priced(2).shm_beta) == (3e-5, 1e-10)  # a core each
    at4 = host.priced(4)
    assert (at4.small_alpha, at4.shm_beta) == (1e-4, 4e-10)  # 2 ranks a core
    # 3 ranks on 2 cores wait for a core as 4 do: 4's numbers (2's before), at 1.5 ranks a core
    assert host.priced(3).small_alpha == pytest.approx(5e-5 * 1.5)
    assert host.priced(3).alpha == 2e-5
    # a 16-core host runs 4 ranks a core each: as measured
    roomy = _from_mapping({**base, "cores": 16, "by_procs": {"4": four}}, "test")
    assert roomy.priced(4).small_alpha == 5e-5
    normed = dataclasses.replace(LAYER, norms=(Norm(16, True),))
    bn = plan_layers([normed], PlanRequest(4, 16, host, scenarios=["batch"], grad_bucket=None))
    assert bn.best.layers[0].terms[Term.BN_STATS].seconds == pytest.approx(1e-4)


def test_plan_and_validate_price_without_shared_memory_when_told(tmp_path, capsys):
    """`hybridpar plan --no-shared-memory` prices a job as `train --no-shared-memory` runs it:
    its activations' and small collectives on alpha-beta (0299212 had no such flag: a plan for
    such a run was priced through shared memory); validate takes the flag to its runs too."""
    from hybridpar.commands.cli import build_parser, main
    from hybridpar.core.config import from_namespace
    from hybridpar.planning.config import PlanConfig

    path = tmp_path / "host.json"
    host = {"name": "host", "alpha": 1e-3, "beta": 1e-9, "flops": 1e11}
    path.write_text(json.dumps({**host, "small_alpha": 2e-5, "shm_beta": 1e-11}))
    flags = ["--model", "alexnet-owt", "--input-size", "64", "--batch", "32", "--procs", "4"]
    flags += ["--cluster", str(path), "--scenario", "fc-grid", "--json"]
    totals = []
    for extra in ([], ["--no-shared-memory"]):
        assert main(["plan", *flags, *extra]) == 0
        totals.append(json.loads(capsys.readouterr().out)["best"]["total_s"])
    assert totals[1] > totals[0] + 4e-3  # alpha, 1 ms, for each gather and dX sum: 20 us each
    args = build_parser().parse_args(["validate", *flags[:-3], "--no-shared-memory"])
    cfg = from_namespace(PlanConfig, args)
    assert not cfg.shared_memory and not cfg.plan_kwargs()["shared_memory"]


def test_a_run_without_shared_memory_is_priced_as_it_runs(cache, train_job):
    """`--no-shared-memory` sends a job's activations' and small collectives through gloo, so its
    prediction prices them on alpha-beta, not at the shared-memory numbers the calibration
    measured (before: resnet20's domain 4 x 1 predicted 76.5 ms with it, measured 318.8)."""

    from hybridpar.core.analysis import analyze
    from hybridpar.core.cluster import load_cluster
    from hybridpar.core.layers import cost_layers
    from hybridpar.core.models import build_model
    from hybridpar.core.terms import Term
    from hybridpar.planning.cost.terms import t_halo
    from hybridpar.runtime.train import plans
    from hybridpar.runtime.train.plans import pricing_cluster

    base = {"name": "localhost", "alpha": 1e-4, "beta": 1e-9, "flops": 1e10, "cores": 2}
    four = {"alpha": 1e-4, "beta": 1e-9, "small_alpha": 5e-6, "shm_beta": 1e-11}
    (cache / "localhost.json").write_text(json.dumps({**base, "by_procs": {"4": four}}))
    # the cluster is what its file says; whether a job takes the shared-memory paths is the
    # job's, in the request its preset is planned with
    jobs = {k: train_job(cluster="localhost", shared_memory=k) for k in (True, False)}
    cluster = pricing_cluster(jobs[True], True)
    assert cluster == pricing_cluster(jobs[False], True) == load_cluster("localhost")
    assert "shared_memory" not in cluster.to_dict()
    asks = {k: plans.request(jobs[k], cluster, 4, 16) for k in (True, False)}
    assert asks[True].priced().shm_paths and not asks[False].priced().shm_paths
    normed = dataclasses.replace(LAYER, norms=(Norm(16, True),))
    bn = {
        k: plan_layers([normed], dataclasses.replace(r, scenarios=("batch",), grad_bucket=None))
        .best.layers[0]
        .terms[Term.BN_STATS]
        for k, r in asks.items()
    }
    assert bn[True].seconds == pytest.approx(1e-5)  # small_alpha, at 2 ranks a core
    assert bn[False].seconds > 2e-4 and bn[False].bytes == bn[True].bytes  # gloo's alpha-beta
    conv = next(x for x in cost_layers(analyze(build_model("resnet20"), (3, 32, 32))) if x.windows)
    halo = {k: t_halo(conv, 4, 1, 32, r.priced(), 4.0) for k, r in asks.items()}
    assert halo[False].bytes == halo[True].bytes > 0
    assert halo[False].seconds > 1e-4 > halo[True].seconds  # a message each way, or the segment


def _split_on_ranks():
    import torch.distributed as dist

    from hybridpar.runtime.comm.ledger import Ledger
    from hybridpar.runtime.train.report import waiting

    ledger = Ledger()
    mine = {0: [(0, 1.0), (0, 2.0), (1, 4.0)], 1: [(0, 3.0), (0, 2.0), (1, 1.0)]}
    for step, seconds in mine[dist.get_rank()]:
        ledger.step = step
        ledger.record("all_gather", 2, 8.0, seconds, "allgather")
    ledger.step = 0
    ledger.record("all_reduce", 2, 8.0, 100.0, "dw_allreduce")  # not blocking: left out
    return waiting(ledger, {0, 1}, ("allgather",))


def test_blocking_time_splits_into_transfer_and_waiting_for_the_slowest():
    """Per call the shortest duration is the transfer, the rest waiting: step 0 calls take
    (1, 3) and (2, 2), step 1's (4, 1): transfer (1+1 + 2+2 + 1+1) / 2 steps / 2 ranks, waiting
    (2 + 0 + 3) / 4."""
    from dist_helpers import run_ranks

    for split in run_ranks(_split_on_ranks, 2):
        assert split == pytest.approx({"transfer_s": 8 / 4, "slowest_s": 5 / 4})


def test_gradient_all_reduces_are_priced_fused_into_the_runtimes_buckets():
    """The layers' gradients share the runtime's buckets: each bucket pays one all-reduce
    latency, split over its layers by their bytes (a lone small layer pays a whole one, as its
    bucket does); without a bucket, once per layer (Gholami et al.'s Eq. 4). The search prices
    a layer by its share of a full bucket (`fused`), the plan it returns by the buckets."""
    from hybridpar.core.terms import Term
    from hybridpar.planning.cost.terms import eq4_batch, fused, t_dw_allreduce
    from hybridpar.planning.search import GRAD_BUCKET_BYTES
    from hybridpar.runtime.options import RuntimeOptions

    assert RuntimeOptions().bucket_bytes == GRAD_BUCKET_BYTES
    net = Cluster("t", alpha=1e-3, beta=1e-9, flops=1e12)
    big = CostLayer(**{**LAYER.__dict__, "name": "big", "params": 2 * 2**20})  # 8 MiB > bucket
    P, latency = 4, 2 * 1e-3 * 2

    def dw(layers, bucket):
        r = plan_layers(layers, PlanRequest(P, 16, net, scenarios=["batch"], grad_bucket=bucket))
        return [x.terms[Term.DW_ALLREDUCE] for x in r.best.layers]

    for layer in (LAYER, big):
        n = layer.params * 4
        (alone,) = dw([layer], None)
        assert alone.seconds == pytest.approx(latency + 1e-9 * 1.5 * n)
        (bucketed,) = dw([layer], GRAD_BUCKET_BYTES)
        assert bucketed.seconds == pytest.approx(alone.seconds)  # a bucket of its own
        assert bucketed.bytes == alone.bytes
        share = min(1.0, n / GRAD_BUCKET_BYTES)
        flat = t_dw_allreduce(layer, P, 1, net, net.word_bytes)
        assert fused(flat, net, GRAD_BUCKET_BYTES).seconds == pytest.approx(
            latency * share + 1e-9 * 1.5 * n
        )
    two = [LAYER, CostLayer(**{**LAYER.__dict__, "name": "second"})]  # one bucket together
    both = dw(two, GRAD_BUCKET_BYTES)
    assert math.fsum(c.seconds for c in both) == pytest.approx(
        latency + 1e-9 * 1.5 * 8 * LAYER.params
    )
    assert both[0].seconds == pytest.approx(both[1].seconds)
    assert eq4_batch([LAYER], P, net) == pytest.approx(dw([LAYER], None)[0].seconds)


def test_a_gpu_job_is_profiled_on_the_gpu_and_a_cpu_job_on_the_cpu(monkeypatch, train_job):
    """The profile is timed on the job's device (5135867 priced a CUDA job by the CPU
    calibration's FLOPs)."""
    from hybridpar.runtime.train import plans

    devices = []

    def profiled(*a, device="cpu", **kw):
        devices.append(device)
        return None  # priced by FLOPs after that: what is asserted is where it would time

    monkeypatch.setattr(prof, "profile_compute", profiled)
    host = Cluster("localhost", alpha=1e-5, beta=1e-9, flops=1e10, cores=2)
    plans.preset_plan(train_job(preset="model", device="cuda"), host)
    plans.preset_plan(train_job(preset="model"), host)
    assert devices == ["cuda", "cpu"]


# --- measurements that repeat (issue 42) -----------------------------------------------------


def test_the_profile_times_the_trainers_optimizer_on_the_models_own_parameters():
    """5135867 timed torch.optim.SGD with weight decay over 4M elements of its own: each step
    allocated a 16 MB temporary whose page faults cost 0.7 or 2.3 ns an element depending on
    the allocator's history (0.74-2.6 ns in six `train` runs here; 10x in the issue's), a cost
    the trainer's in-place optimizer never pays. The profile now steps the trainer's optimizer
    over the model's own parameters, and that step allocates nothing."""
    from torch.profiler import ProfilerActivity, profile

    from hybridpar.core.models import build_any
    from hybridpar.core.optim import KrizhevskySGD

    net = build_any("digits-wide", (1, 8, 8), None)
    opt, n = prof._stepper(net)
    assert type(opt) is KrizhevskySGD
    assert n == sum(p.numel() for p in net.parameters()) > 10_000
    opt.step()  # the velocities' first allocation
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        opt.step()
    allocated = sum(e.cpu_memory_usage for e in trace.events() if e.cpu_memory_usage > 0)
    assert allocated < 1024, allocated  # bytes; a gradient-sized temporary would be 4 n
    got = prof._measure_update(net, repeats=3)
    assert got.value > 0 and got.tries >= 1 and all(p.grad is None for p in net.parameters())
    assert set(got.fields("update_s")) >= {"update_s", "update_s_spread"}


def test_a_measurement_is_repeated_until_its_spread_is_small_and_its_value_plausible():
    from hybridpar.core.timing import settle, spread

    assert spread([1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    batches = iter([[1.0, 3.0, 1.0, 5.0, 2.0], [2.0, 2.0, 2.1, 2.0, 2.0]])
    got = settle(lambda: next(batches))
    assert (got.value, got.tries, got.settled) == (2.0, 2, True)  # the noisy first did not count
    # steady but beyond the sanity bound (a step 10x slower than its traffic): measured again,
    # and where it stays so, kept as the median of every batch and marked unsettled
    runs = iter([[10.0] * 5, [10.0] * 5, [1.0] * 5])
    got = settle(lambda: next(runs), bound=2.0)
    assert (got.value, got.tries, got.settled) == (1.0, 3, True)
    got = settle(lambda: [10.0] * 5, bound=2.0, tries=3)
    assert (got.value, got.tries, got.settled) == (10.0, 3, False)
    assert got.fields("update_s") == {
        "update_s": 10.0,
        "update_s_spread": 0.0,
        "update_s_unsettled": 3,
    }
