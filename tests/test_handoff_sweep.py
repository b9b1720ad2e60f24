"""Krizhevsky's communication-to-computation argument for the hand-off schemes (section 4),
priced by `hybridpar simulate --handoffs` (commands.papers.handoff_sweep)."""

import csv

import pytest
from test_cli import run

from hybridpar.commands.papers.handoff_sweep import paper_exposed, sweep_handoffs
from hybridpar.core.cluster import PRESETS


def test_paper_links_give_the_papers_ratios_where_rounds_hide():
    """No latency and a head slow enough to hide every round: (a) and (b) expose K - 1 times a
    worker's rows, (c) (K - 1) / K of them, bounded as K grows; raw (c) sends what (a) sends."""
    S, beta, slow = 1e6, 1e-9, 1.0
    got = {
        (s, K): paper_exposed(s, K, S, 0.0, beta, slow, slow) for s in "abc" for K in (2, 4, 8, 64)
    }
    for K in (2, 4, 8, 64):
        assert got["a", K][0] == pytest.approx(2 * (K - 1) * S * beta, rel=1e-12)
        assert got["b", K][0] == pytest.approx(2 * (K - 1) * S * beta, rel=1e-12)
        assert got["c", K][0] == pytest.approx(2 * (K - 1) / K * S * beta, rel=1e-12)
        assert got["c", K][1] == pytest.approx(got["a", K][1], rel=1e-12)
        assert all(got[s, K][2] for s in "abc")
    assert got["a", 64][0] / got["a", 2][0] == pytest.approx(63)
    assert got["c", 64][0] / got["c", 2][0] < 2
    # a head too fast to hide a round: every round of (b) waits, and it says so
    fast = paper_exposed("b", 8, S, 0.0, beta, 1e-6, 1e-6)
    assert not fast[2] and fast[0] > 8 * 7 * S * beta


def test_sweep_keeps_compute_and_orders_the_schemes(tmp_path):
    """alexnet-owt, 128 examples per worker on K20s over PCIe (Krizhevsky's machine): a worker's
    compute stays the same as K grows; on the paper's links (c) exposes the least and grows the
    slowest while its rounds hide (behind the three FC layers the runtime runs in rounds: up to
    K = 8, not 16), (a) grows as K - 1 and (b) faster; in the cost model (c) is the cheapest at
    every K."""
    pts = sweep_handoffs("alexnet-owt", [2, 4, 8, 16], 128, PRESETS["k20-pcie"])
    by = {(p.scheme, p.workers): p for p in pts}
    computes = {p.compute_s for p in pts}
    assert max(computes) == pytest.approx(min(computes), rel=1e-9)
    assert {(p.scheme, p.rounds) for p in pts if p.workers == 4} == {("a", 1), ("b", 4), ("c", 4)}
    a, b, c = ([by[s, K].paper_ratio for K in (2, 4, 8)] for s in "abc")
    assert a[2] / a[0] == pytest.approx(7, rel=0.02)  # (K - 1), alpha aside
    assert b[2] / b[0] > a[2] / a[0]
    assert c[1] / c[0] < 2 and by["c", 8].hides and not by["c", 16].hides
    for K in (2, 4, 8):
        assert by["c", K].exposed_s < by["a", K].exposed_s
        assert by["c", K].paper_s < by["a", K].paper_s


def test_simulate_handoffs_writes_table_and_png(tmp_path):
    r = run(
        "simulate", "--model", "alexnet-owt", "--batch", "256", "--procs", "2,4",
        "--handoffs", "128", "--cluster", "k20-pcie", "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "exposed hand-off / compute per iteration" in r.stdout
    rows = list(csv.DictReader((tmp_path / "handoff_ratio.csv").open()))
    assert [(x["workers"], x["scheme"]) for x in rows] == [
        (k, s) for k in ("2", "4") for s in "abc"
    ]
    png = (tmp_path / "handoff_ratio.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
