"""Dropout that does not depend on P or the grid (issue 23): masks drawn from a counter-based
generator keyed by (seed, step, module, global example, global feature), so every rank draws the
slice of the mask one process draws. The oracle with dropout on (p = 0.5 in the FC head and in a
conv segment, float64, rtol 1e-7) on 2, 3 and 4 ranks under every plan of every scenario, and a
digits-wide run (dropout 0.5 in its head) resumed from 2 x 2 onto 3 x 1 that ends where the
uninterrupted run ends."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import CLASSES, optimizer
from torch import nn

from hybridpar.core.analysis import analyze
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import SCENARIOS, plan_layers
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import HybridTrainer
from hybridpar.runtime.parallel.dropout import CounterDropout, Where, counter_dropout, uniform

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
B, STEPS, SHAPE, SEED = 12, 3, (2, 11, 6), 7


def test_a_rank_draws_the_slice_one_process_draws():
    """Examples 5..8 and rows 3..6 of an 11-row activation (and of them columns 2..4, a tile):
    the same numbers as the whole mask's slice; Dropout2d drops whole channels; other steps and
    modules draw other masks."""
    e = torch.arange(12).view(12, 1, 1, 1)
    f = torch.arange(2 * 11 * 6).view(1, 2, 11, 6)
    whole = uniform(1, 2, 3, e, f)
    ex = torch.arange(5, 9).view(4, 1, 1, 1)
    band = (
        torch.arange(2).view(2, 1, 1) * 66 + torch.arange(3, 7).view(1, 4, 1) * 6
    ) + torch.arange(6)
    torch.testing.assert_close(uniform(1, 2, 3, ex, band.unsqueeze(0)), whole[5:9, :, 3:7])
    assert not torch.equal(uniform(1, 3, 3, e, f), whole)
    assert not torch.equal(uniform(1, 2, 4, e, f), whole)
    assert 0.45 < (whole < 0.5).double().mean() < 0.55  # about uniform

    x = torch.ones(12, *SHAPE, dtype=torch.float64)
    full = CounterDropout(0.5, False, False, 9, 1, Where(lambda: 4))(x)
    part = CounterDropout(0.5, False, False, 9, 1, Where(lambda: 4, lambda: 5, 3, SHAPE))
    torch.testing.assert_close(part(x[5:9, :, 3:7]), full[5:9, :, 3:7])
    tile = CounterDropout(0.5, False, False, 9, 1, Where(lambda: 4, lambda: 5, (3, 2), SHAPE))
    torch.testing.assert_close(tile(x[5:9, :, 3:7, 2:5]), full[5:9, :, 3:7, 2:5])  # a tile's
    assert set(full.unique().tolist()) == {0.0, 2.0}
    ch = CounterDropout(0.5, False, True, 9, 1, Where(lambda: 4))(x)
    assert (ch.amax((2, 3)) == ch.amin((2, 3))).all() and (ch == 0).any()


class DropNet(nn.Module):
    """Dropout (p = 0.5) in a conv segment (between two convolutions that may be split by height)
    and Dropout2d after them, two dropouts in the FC head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 5, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.conv2 = nn.Conv2d(5, 4, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.5)
        self.head = nn.Sequential(
            nn.Dropout(0.5),
            nn.Linear(4 * 11 * 6, 13),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(13, CLASSES),
        )

    def forward(self, x):
        x = self.conv2(self.drop(torch.relu(self.conv1(x))))
        return self.head(torch.flatten(self.drop2d(torch.relu(x)), 1))


def _model():
    torch.manual_seed(0)
    return DropNet().double()


def _data():
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(B, *SHAPE, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (B,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _oracle(P: int) -> list[str]:
    ref = counter_dropout(_model(), SEED)
    opt = optimizer(ref.parameters())
    for x, y in _data():
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    want = ref.state_dict()
    with torch.device("meta"):
        layers = cost_layers(analyze(DropNet().double(), SHAPE))
    r = plan_layers(
        layers, PlanRequest(P, B, NET, scenarios=SCENARIOS, input_shape=SHAPE, elem_bytes=8)
    )
    plans = [r.export(c) for sc in SCENARIOS for c in r.candidates[sc] if c.feasible]
    # the planner prefers model to domain for conv1 here: the masks on bands (on tiles: 1 x 2,
    # 2 x 2) by hand, and DDP
    dom = [(P, 1)] + ([(2, 2)] if P == 4 else [])
    doms = [Style.domain(*g) for g in dom] + ([Style.domain(P, 1, 2)] if P % 2 == 0 else [])
    plans += [ParallelPlan(P, B, {"conv1": d}, input_shape=SHAPE) for d in doms]  # and tiles
    plans.append(ParallelPlan(P, B, {}, input_shape=SHAPE, engine="ddp"))
    done, seen = [], set()
    for plan in plans:
        key = (plan.engine, tuple((k, v.label) for k, v in plan.styles.items()))
        if key in seen:
            continue
        seen.add(key)
        t = HybridTrainer(_model(), plan, optimizer, options=RuntimeOptions(seed=SEED))
        for x, y in _data():
            t.train_step(x, y)
        got = t.full_state_dict()
        label = plan.engine + ": " + ", ".join(f"{k}={v}" for k, v in plan.styles.items())
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{label}: {k}")
        done.append(label)
    return done


@pytest.mark.parametrize("P", [2, 3, 4])
def test_dropout_on_trains_as_one_process_on_every_plan(P):
    done = run_ranks(_oracle, P, P, timeout_s=300)[0]
    assert any("model(" in d for d in done) and any("domain(" in d for d in done), done
    assert any(d.startswith("ddp") for d in done), done


def _digits(folder: str, grid: tuple[int, int], steps: range, resume: bool):
    from nets import preset, zoo

    P = dist.get_world_size()
    plan = preset("digits-wide", f"grid:{grid[0]}x{grid[1]}", P)
    torch.manual_seed(0)
    model = zoo("digits-wide", 8)()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.5
    assert any(isinstance(m, nn.Dropout) for m in model.modules())
    t = HybridTrainer(model, plan, optimizer, options=RuntimeOptions(seed=SEED))
    if resume:
        t.load(folder)
    g = torch.Generator().manual_seed(5)
    data = [
        (torch.randn(B, 1, 8, 8, generator=g), torch.randint(0, CLASSES, (B,), generator=g))
        for _ in range(4)
    ]
    for i in steps:
        t.train_step(*data[i])
    if not resume and steps.stop == 2:
        t.save(folder)
    return t.full_state_dict()


def test_a_digits_wide_run_resumed_from_2x2_onto_3x1_is_the_same_run(tmp_path):
    whole = run_ranks(_digits, 4, str(tmp_path / "a"), (2, 2), range(4), False, timeout_s=180)[0]
    run_ranks(_digits, 4, str(tmp_path / "b"), (2, 2), range(2), False, timeout_s=180)
    resumed = run_ranks(_digits, 3, str(tmp_path / "b"), (3, 1), range(2, 4), True, timeout_s=180)[
        0
    ]
    for k, v in whole.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_same_random_seeds_the_generator_without_torch_manual_seed(monkeypatch):
    """A segment's random stream is seeded on the CPU generator alone: torch.manual_seed also
    queues a seeding of every lazy device kind with a captured stack (about 1 ms a call on one
    thread, at every segment of every step), which the runtime no longer pays."""
    from hybridpar.runtime.parallel.dropout import SameRandom

    r = SameRandom(5, [0, 11])
    r.step = 3

    def refuse(seed):
        raise AssertionError("torch.manual_seed called per step")

    monkeypatch.setattr(torch, "manual_seed", refuse)
    r.enter(1)
    first = torch.rand(4)
    assert torch.initial_seed() == (5 * 1_000_003 + 3 * 1_009 + 1 * 10_007 + 11) % 2**63
    r.enter(1)
    assert torch.equal(torch.rand(4), first)  # the same stream again
