"""Krizhevsky's hand-off schemes (core/handoff.py, runtime/parallel/rounds.py).

- (b) and (c) train as one process does (DESIGN.md invariant 1, rtol 1e-5) on P = 2, 3 and 4, with
  uneven splits (B = 15 on P = 3), on the torchvision-style AlexNet, on a model with two batch ->
  model hand-offs, on the zoo's alexnet-owt (its shapes: 64x64 input, 4096-wide FC layers), and (float64, dropout p = 0.5 in the head, rtol 1e-7) with counter-based
  dropout masks drawn for the examples of each round; on shared memory and on gloo alike.
- The ledger's bytes per (layer, term) equal the plan's predictions for (a), (b) and (c) exactly
  (invariant 2).
- Scheme (a)'s backward is one reduce-scatter where the rule allows it: half the bytes of the
  split layer's dX all-reduce it replaces.
- The planner picks a scheme and K, and the plan file carries them; the rule refuses what the
  runtime cannot run, in one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import (
    CLASSES,
    MAKERS,
    TVAlexNet,
    assert_calls,
    assert_same_state,
    batches,
    optimizer,
    straight_and_resumed,
    variable_batch_step,
)
from test_equivalence import _measured
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import Handoff, fused, head, round_rows, why_not_handoff
from hybridpar.core.layers import CostLayer, cost_layers
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.core.terms import Term
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export, plan_layers
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import parallelize
from hybridpar.runtime.parallel.dropout import counter_dropout

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
SEED = 5


class TwoHandoffs(nn.Module):
    """Two batch -> model hand-offs in one forward: fc1 (batch) -> fc2 (model) -> fc3 (batch)
    -> fc4 (model), with functional activations between, not a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 11)
        self.fc2 = nn.Linear(11, 9)
        self.fc3 = nn.Linear(9, 10)
        self.fc4 = nn.Linear(10, CLASSES)

    def forward(self, x):
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        x = torch.tanh(self.fc2(x))
        return self.fc4(torch.relu(self.fc3(x)))


def _tv(p: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return TVAlexNet(p=p)


def _two() -> nn.Module:
    torch.manual_seed(0)
    return TwoHandoffs()


def _owt() -> nn.Module:
    from nets import make

    return make("alexnet-owt")


MODELS = {
    "tv-alexnet": (_tv, (1, 8, 8)),
    "two": (_two, (1, 4, 4)),
    "alexnet-owt": (_owt, MAKERS["alexnet-owt"][1]),  # the zoo's, 64x64, 4096-wide FC layers
    "tv-alexnet-2x2": (_tv, (1, 8, 8)),  # FC layers on a 2x2 grid: replicated over batch groups
}


def _styles(name: str, layers: list[CostLayer], P: int) -> list[Style]:
    if name == "two":  # batch, model, batch, model
        return [Style.batch(P), Style.model(P, 1), Style.batch(P), Style.model(P, 1)]
    fc = Style.model(2, 2) if name.endswith("2x2") else Style.model(P, 1)
    return [fc if x.kind == "linear" else Style.batch(P) for x in layers]


def _plan(name: str, P: int, B: int, h: Handoff, dtype=torch.float32) -> ParallelPlan:
    """The model's conv-batch / FC-model plan with every batch -> model hand-off sent by `h`
    (b: one round per gathering rank), priced and exported as the planner does."""
    build, shape = MODELS[name]
    with torch.device("meta"):
        layers = cost_layers(analyze(build().to(dtype), shape))
    styles = _styles(name, layers, P)
    fixed = {}
    for i, x in enumerate(layers):
        if i and styles[i].pc < styles[i - 1].pc:
            m = styles[i - 1].pc // styles[i].pc
            fixed[x.name] = Handoff("b", m) if h.scheme == "b" else h
    e = 8 if dtype == torch.float64 else None
    priced = evaluate(layers, styles, PlanRequest(P, B, NET, elem_bytes=e), handoffs=fixed)
    assert priced.feasible, priced.reason
    return export(priced, procs=P, batch=B, choices=Choices(), input_shape=shape)


def _train(model, plan, data, shm: bool):
    ledger = Ledger()
    options = RuntimeOptions(seed=SEED, shared_memory=shm)
    hp = parallelize(model, plan, options, ledger=ledger)
    opt = optimizer(hp.parameters())
    for x, y in data:
        n = len(x)
        hp.set_batch(n)
        out = hp(x[hp.input_rows(n)])
        loss = F.cross_entropy(out, y[hp.output_rows(n)], reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        hp.finish_backward()
        opt.step()
    assert_calls(ledger, plan, len(data), f"{plan.redistributions}")
    return hp.full_state_dict(), _measured(ledger, len(data))


def _reference(model, data):
    opt = optimizer(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


CASES = [Handoff("b", 0), Handoff("c", 2)]  # (c) in 3 rounds and (a) where the case says


def _matrix(name: str, P: int, B: int, shm: bool, more: tuple = ()) -> list[str]:
    build, shape = MODELS[name]
    data = batches(shape, b=B)
    want = _reference(build(), data) if dist.get_rank() == 0 else None
    done = []
    for h in (*CASES, *more):
        plan = _plan(name, P, B, h)
        got, measured = _train(build(), plan, data, shm)
        if dist.get_rank() == 0:
            label = f"{name} P={P} B={B} scheme {h.label} shm={shm}"
            assert_same_state(got, want, label)
            predicted = plan.predicted_bytes(by_layer=True)
            assert set(measured) == set(predicted), f"{label}: {set(measured) ^ set(predicted)}"
            for k, v in predicted.items():
                assert measured[k] == pytest.approx(v, rel=1e-12), f"{label}: {k}"
            done.append(label)
    return done


def _matrices(P: int, cases: list) -> list[str]:
    """Every case on the same P in one spawn (the ranks start once)."""
    return [label for case in cases for label in _matrix(case[0], P, *case[1:])]


@pytest.mark.parametrize(
    "P,cases",
    [
        (2, [("tv-alexnet", 12, True, ()), ("alexnet-owt", 6, True, ())]),
        (3, [("tv-alexnet", 15, True, (Handoff("c", 3),)), ("two", 15, False, ())]),
        (
            4,
            [
                ("tv-alexnet", 12, False, ()),
                ("two", 12, True, (Handoff("a"),)),  # two fused (a) hand-offs in one model
                ("tv-alexnet-2x2", 12, True, ()),  # the head's gradients summed over batch groups
            ],
        ),
    ],
)
def test_schemes_b_and_c_train_as_one_process_and_book_the_predicted_bytes(P, cases):
    done = run_ranks(_matrices, P, P, cases, timeout_s=300)[0]
    assert len(done) == sum(len(CASES) + len(c[3]) for c in cases), done


def _dropout(P: int) -> list[str]:
    """Dropout p = 0.5 before and between the FC layers, float64: the masks of every round are
    the slices of the masks one process draws (counter-based), so training is the same."""
    B, shape = 15 if P == 3 else 12, (1, 8, 8)
    g = torch.Generator().manual_seed(3)
    data = [
        (
            torch.randn(B, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (B,), generator=g),
        )
        for _ in range(3)
    ]
    want = None
    if dist.get_rank() == 0:
        want = _reference(counter_dropout(_tv(0.5).double(), SEED), data)
    done = []
    for h in (Handoff("c", 2), Handoff("b", 0)):
        plan = _plan("tv-alexnet", P, B, h, torch.float64)
        got, _ = _train(_tv(0.5).double(), plan, data, shm=True)
        if dist.get_rank() == 0:
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{h}: {k}")
            (r,) = plan.redistributions
            done.append(f"{r.scheme}{r.rounds}")
    return done


def test_dropout_in_the_head_draws_each_rounds_examples():
    assert run_ranks(_dropout, 3, 3, timeout_s=240)[0] == ["c2", "b3"]  # uneven: 5 rows a rank


def _encoded(P: int) -> list[str]:
    """Scheme (c) with 8-bit activations (Dettmers' sub-batch pipeline): every round's piece is
    encoded, and the ledger's payload per (layer, term) is the prediction."""
    build, shape = MODELS["tv-alexnet"]
    data = batches(shape, b=12)
    done = []
    choices = Choices(codec="dynamic-tree", compress=("activations",))
    for h in (Handoff("c", 2), Handoff("c", 3)):
        with torch.device("meta"):
            layers = cost_layers(analyze(build(), shape))
        styles = _styles("tv-alexnet", layers, P)
        first = next(x.name for x in layers if x.kind == "linear")
        priced = evaluate(
            layers, styles, PlanRequest(P, 12, NET, choices=choices), handoffs={first: h}
        )
        plan = export(priced, procs=P, batch=12, choices=choices, input_shape=shape)
        assert plan.redistributions[0].rounds == h.rounds
        _, measured = _train(build(), plan, data, shm=True)
        if dist.get_rank() == 0:
            predicted = plan.predicted_bytes(by_layer=True)
            measured = {k: v for k, v in measured.items() if k[1] != "codec_overhead"}
            assert set(measured) == set(predicted), set(measured) ^ set(predicted)
            for k, v in predicted.items():
                assert measured[k] == pytest.approx(v, rel=1e-12), f"{h}: {k}"
            done.append(h.label)
    return done


def test_scheme_c_carries_8_bit_activations_and_books_the_predicted_payload():
    assert run_ranks(_encoded, 3, 3, timeout_s=240)[0] == ["c2", "c3"]


# --- the rule and the cost model (no processes) ---------------------------------------------------


def _layers(name: str = "tv-alexnet") -> list[CostLayer]:
    build, shape = MODELS[name] if name in MODELS else MAKERS[name]
    with torch.device("meta"):
        return cost_layers(analyze(build(), shape))


def test_a_hand_off_backward_is_half_the_bytes_of_the_dx_all_reduce_it_replaces():
    layers = _layers()
    P, B = 4, 12
    styles = _styles("tv-alexnet", layers, P)
    first = next(i for i, x in enumerate(layers) if x.kind == "linear")
    x = layers[first]
    assert fused(x, styles[first - 1], styles[first], acts_encoded=False)
    assert not fused(x, styles[first - 1], styles[first], acts_encoded=True)
    assert not fused(x, Style.model(2, 2), styles[first], acts_encoded=False)  # not pure batch
    r = plan_layers(layers, PlanRequest(P, B, NET, scenarios=["fc-grid"]))
    paper = plan_layers(layers, PlanRequest(P, B, NET, scenarios=["fc-grid"], fuse_handoff=False))

    def bytes_of(result):
        c = next(c for c in result.candidates["fc-grid"] if c.grid == (4, 1))
        lp = next(lp for lp in c.layers if lp.layer.name == x.name)
        return lp.terms[Term.REDISTRIBUTE].bytes, lp.terms[Term.DX_ALLREDUCE].bytes

    (redist, dx), (redist0, dx0) = bytes_of(r), bytes_of(paper)
    n = B * x.d_in * 4  # the gathered activation's bytes
    assert redist0 == pytest.approx(3 / 4 * n) and dx0 == pytest.approx(2 * 3 / 4 * n)
    assert dx == 0 and redist - redist0 == pytest.approx(dx0 / 2)  # backward bytes halved


def test_round_rows_and_the_rule():
    assert round_rows(7, "c", 3, 0) == [3, 2, 2]
    assert round_rows(5, "b", 3, 1) == [0, 5, 0]
    assert round_rows(5, "a", 1, 0) == [5]
    layers = _layers()
    x = next(x for x in layers if x.kind == "linear")
    batch, model = Style.batch(4), Style.model(4, 1)
    assert why_not_handoff(Handoff("c", 3), batch, model, [x], 12, False, "fc") == ""
    assert "rounds must be 4" in why_not_handoff(
        Handoff("b", 2), batch, model, [x], 12, False, "fc"
    )
    assert "at most 3 rounds" in why_not_handoff(Handoff("c", 4), batch, model, [x], 12, False, "f")
    assert "--handoff a" in why_not_handoff(Handoff("c", 2), model, batch, [x], 12, False, "fc")
    assert "unencoded" in why_not_handoff(Handoff("b", 4), batch, model, [x], 12, True, "fc")
    assert why_not_handoff(Handoff("c", 2), batch, model, [x], 12, True, "fc") == ""
    assert "one of" in why_not_handoff(Handoff("d", 2), batch, model, [x], 12, False, "fc")
    normed = replace(x, norms=((13, True),))
    assert "batch norm" in why_not_handoff(Handoff("c", 2), batch, model, [normed], 12, False, "f")


def test_the_head_is_what_the_rounds_run_and_batch_norm_there_is_refused():
    """A hand-off into a Linear of an nn.Sequential runs the Sequential's later children in its
    rounds too, up to the first change of layout (runtime/parallel/rounds.py). Batch norm riding
    on a later Linear there would see one round's examples: the planner and the runtime both
    refuse scheme (c) into the first Linear (at 5135867 they checked its segment alone, and the
    runtime trained the norm on rounds), and both accept it where the layout changes before
    the norm."""
    torch.manual_seed(0)
    tail = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.Flatten(),
        nn.Linear(64, 13), nn.ReLU(), nn.Linear(13, 7), nn.BatchNorm1d(7), nn.ReLU(),
        nn.Linear(7, CLASSES),
    )  # fmt: skip
    with torch.device("meta"):
        layers = cost_layers(analyze(tail, (1, 4, 4)))
    assert [x.name for x in layers] == ["0", "2", "4", "7"] and layers[2].norms
    P, B, c2 = 2, 12, Handoff("c", 2)
    batch, model = Style.batch(P), Style.model(P, 1)
    every = [batch, model, model, model]
    assert head(layers, [s.layout for s in every], 1) == [1, 2, 3]
    assert head(layers, None, 1) == [1]  # in the search, before the later styles are chosen
    before = [batch, model, batch, batch]  # the layout changes before the norm's Linear
    assert head(layers, [s.layout for s in before], 1) == [1]
    refused = evaluate(layers, every, PlanRequest(P, B, NET), handoffs={"2": c2})
    assert not refused.feasible and "batch norm in 4" in refused.reason, refused.reason
    plan = _export(layers, P, B, every)
    from hybridpar.runtime.parallel.layout import resolve

    named = replace(plan, redistributions=[replace(plan.redistributions[0], scheme="c", rounds=2)])
    with pytest.raises(ConfigError, match="batch norm in 4"):
        resolve(tail, named)
    ok = evaluate(layers, before, PlanRequest(P, B, NET), handoffs={"2": c2})
    assert ok.feasible and ok.layers[1].handoff == c2
    plan = export(ok, procs=P, batch=B, choices=Choices(), input_shape=(1, 4, 4))
    assert resolve(tail, plan).handoffs


def _export(layers, P, B, styles):
    priced = evaluate(layers, styles, PlanRequest(P, B, NET))
    return export(priced, procs=P, batch=B, choices=Choices(), input_shape=(1, 4, 4))


def test_the_planner_picks_a_scheme_and_the_plan_file_carries_it(tmp_path):
    """On a network slow enough that the hand-off is worth hiding and a head heavy enough to
    hide it behind, `handoff="auto"` sends it in rounds; the plan file keeps scheme and rounds,
    and the runtime's resolve accepts it."""
    layers = _layers()
    slow = Cluster("slow", alpha=1e-6, beta=1e-6, flops=1e6)
    r = plan_layers(
        layers,
        PlanRequest(4, 12, slow, scenarios=["fc-grid"], handoff="auto", input_shape=(1, 8, 8)),
    )
    best = min(r.candidates["fc-grid"], key=lambda c: c.total_s)
    assert any(lp.handoff is not None and lp.handoff.scheme != "a" for lp in best.layers)
    plan = r.export(best)
    (red,) = plan.redistributions
    assert red.scheme in ("b", "c") and red.rounds > 1
    path = tmp_path / "plan.json"
    plan.save(path)
    again = ParallelPlan.load(path)
    assert again.redistributions == plan.redistributions
    from hybridpar.runtime.parallel.layout import resolve

    layout = resolve(_tv(), again)
    assert [h.scheme for h in layout.handoffs.values()] == [red.scheme]
    # rounds priced: the same bytes as (a), less exposed time here
    a = plan_layers(
        layers, PlanRequest(4, 12, slow, scenarios=["fc-grid"], handoff="a")
    ).candidates["fc-grid"]
    a = [c for c in a if c.grid == best.grid]
    moved = r.export(best).predicted_bytes()
    assert sum(moved.values()) == pytest.approx(sum(r.export(a[0]).predicted_bytes().values()))
    assert best.total_s < a[0].total_s


def test_a_scheme_the_runtime_cannot_run_is_refused_in_one_line():
    plan = _plan("tv-alexnet", 4, 12, Handoff("c", 2))
    from hybridpar.runtime.parallel.layout import resolve

    bad = replace(plan, redistributions=[replace(plan.redistributions[0], rounds=5)])
    with pytest.raises(ConfigError, match="at most 3 rounds"):
        resolve(_tv(), bad)
    layers = _layers()
    styles = _styles("tv-alexnet", layers, 4)
    first = next(x.name for x in layers if x.kind == "linear")
    priced = evaluate(layers, styles, PlanRequest(4, 12, NET), handoffs={first: Handoff("b", 3)})
    assert not priced.feasible and "rounds must be 4" in priced.reason


def test_rounds_hide_all_but_the_first_gather_and_the_last_return():
    """Priced with no latency and a head far slower than the wire, (c) in K rounds exposes one
    round's gather and one round's return: 1/K of (a)'s hand-off; with a head faster than the
    wire nothing hides but what compute covers. Bytes never change."""
    layers = _layers()
    styles = _styles("tv-alexnet", layers, 4)
    first = next(x.name for x in layers if x.kind == "linear")

    def redistribute(net, h):
        p = evaluate(layers, styles, PlanRequest(4, 12, net, grad_bucket=None), handoffs={first: h})
        lp = next(lp for lp in p.layers if lp.layer.name == first)
        return lp.terms[Term.REDISTRIBUTE]

    slow_head = Cluster("wire", alpha=0.0, beta=1e-6, flops=1e3)
    a = redistribute(slow_head, Handoff())
    for k in (2, 3):
        c = redistribute(slow_head, Handoff("c", k))
        assert c.bytes == pytest.approx(a.bytes)
        assert c.seconds == pytest.approx(a.seconds / k)
    fast_head = Cluster("wire", alpha=0.0, beta=1e-6, flops=1e18)  # nothing to hide behind
    assert redistribute(fast_head, Handoff("c", 3)).seconds == pytest.approx(a.seconds, rel=1e-6)


# --- variable batch (Krizhevsky 4.2) ---------------------------------------------------------------


def _round_examples(B: int, P: int, K: int) -> list[list[int]]:
    """The global examples of each round of scheme (c) over P pure-batch ranks (member order)."""
    from hybridpar.core.splits import even_split

    rows, starts = even_split(B, P), []
    for i in range(P):
        starts.append(sum(rows[:i]))
    out = []
    for j in range(K):
        ex = []
        for i in range(P):
            per = round_rows(rows[i], "c", K, i)
            off = starts[i] + sum(per[:j])
            ex += list(range(off, off + per[j]))
        out.append(ex)
    return out


def _variable_reference(data, P: int, K: int) -> dict:
    """Variable batch in one process: the trunk once on the whole batch; per round the head's
    forward, its mean loss, its backward and its own SGD step; the trunk's gradient the rounds'
    (each weighted by its share of the batch); then the trunk's step."""
    model = _tv()
    head_mods = model.classifier[1:]
    head_ids = {id(p) for p in head_mods.parameters()}
    trunk_opt = optimizer([p for p in model.parameters() if id(p) not in head_ids])
    head_opt = optimizer(head_mods.parameters())
    for x, y in data:
        h = model.classifier[0](torch.flatten(model.avgpool(model.features(x)), 1))
        variable_batch_step(h, y, _round_examples(len(x), P, K), head_mods, head_opt, trunk_opt)
    return model.state_dict()


def _variable(P: int, B: int, K: int, folder: str) -> dict:
    from hybridpar.runtime.parallel.trainer import HybridTrainer

    data = batches((1, 8, 8), steps=4, b=B)
    plan = _plan("tv-alexnet", P, B, Handoff("c", K))
    options = RuntimeOptions(seed=SEED, variable_batch=True)
    t = HybridTrainer(_tv(), plan, optimizer, options=options)
    counts = {"head": 0, "trunk": 0}
    for which, opt in (("head", t.optimizer.head), ("trunk", t.optimizer.rest)):
        step = opt.step

        def counted(*a, _step=step, _which=which, **kw):
            counts[_which] += 1
            return _step(*a, **kw)

        opt.step = counted
    got, resumed = straight_and_resumed(
        t, lambda: HybridTrainer(_tv(), plan, optimizer, options=options), data, 2, folder
    )
    out = {"counts": counts}

    class Scaled(TVAlexNet):  # changes the head's output after it: no per-round loss of it
        def forward(self, x):
            return super().forward(x) * 2

    scaled = HybridTrainer(Scaled(), plan, optimizer, options=options)
    with pytest.raises(ConfigError, match="drop --variable-batch"):
        scaled.train_step(*data[0])
    if dist.get_rank() == 0:
        want = _variable_reference(data, P, K)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"P={P} K={K}: {k}")
        for k, v in got.items():
            assert torch.equal(resumed[k], v), f"resume is not bit-exact: {k}"
    return out


@pytest.mark.parametrize("P,B,K", [(2, 12, 2), (3, 15, 3)])
def test_variable_batch_steps_the_head_every_round_and_the_trunk_once(tmp_path, P, B, K):
    """The FC layers after the hand-off step K times per iteration on each round's examples and
    the convolutions once, as a one-process implementation of section 4.2 does (rtol 1e-5); a
    run resumed from a checkpoint goes on bit for bit."""
    got = run_ranks(_variable, P, P, B, K, str(tmp_path / "ck"), timeout_s=240)
    assert all(r["counts"] == {"head": 4 * K, "trunk": 4} for r in got), got
