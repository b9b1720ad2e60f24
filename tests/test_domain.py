"""Domain parallelism (Gholami et al. section 2.4; issue 22): height-split convolutions and
poolings with halo exchange train exactly as one process does, and move exactly the bytes the
cost model predicts.

The oracle in float64 (batch norm on tiny batches amplifies rounding; rtol 1e-7 there), 4 steps
with momentum and weight decay, on tests/nets.py's DomainStack: 3x3, 5x5, 11x11 stride 4,
3x3 dilation 2, 1x1, max and average pooling riding along, a residual block with global batch
norm; on 2, 3 and 4 ranks, Pr = 2, 3, 4 and 2 x 2, uneven bands, one-row bands that a 5x5 halo
crosses; with moves into and out of the domain layout from the replicated layout of the same grid,
from pure batch (all-to-all) and between two domain grids. The zoo's resnet20 and the
torchvision-style AlexNet run under the planner's domain plans in tests/test_equivalence.py."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import CLASSES, DOMAIN_LAYERS, DomainStack, assert_calls, optimizer

from hybridpar.core.analysis import analyze
from hybridpar.core.cluster import Cluster
from hybridpar.core.halo import Window, bands
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import parallelize

B, STEPS = 12, 4
NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)


def _data():
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(B, *DomainStack.SHAPE, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    y = [torch.randint(0, CLASSES, (B,), generator=g) for _ in range(STEPS)]
    return list(zip(x, y, strict=True))


def _model() -> DomainStack:
    torch.manual_seed(0)
    return DomainStack().double()


def priced(styles: dict[str, Style], P: int) -> ParallelPlan:
    """The plan of these styles with the cost model's predictions (as `hybridpar train` prices a
    hand-written plan file)."""
    with torch.device("meta"):
        layers = cost_layers(analyze(DomainStack().double(), DomainStack.SHAPE))
    from hybridpar.core.plan import assign_styles

    names = [x.name for x in layers]
    modules = [n for n, _ in DomainStack().named_modules()]
    chosen = assign_styles(styles, modules, names, P)
    plan = evaluate(
        layers, [chosen[n] for n in names], PlanRequest(P, B, NET, elem_bytes=8)
    )  # float64
    assert plan.feasible, plan.reason
    from hybridpar.core.choices import Choices

    return export(
        plan, procs=P, batch=B, choices=Choices(), input_shape=DomainStack.SHAPE, model="stack"
    )


def _reference():
    m = _model()
    opt = optimizer(m.parameters())
    for x, y in _data():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m.state_dict()


def _plans(P: int) -> dict[str, dict[str, Style]]:
    """name -> styles: every listed layer domain on the 1-column grid; on 2 x 2; mixed with model
    splits of the same grid; two domain grids in a row."""

    def dom(pr, pc):
        return {k: Style.domain(pr, pc) for k in DOMAIN_LAYERS}

    plans = {f"domain({P}x1)": dom(P, 1)}
    if P == 2:
        plans["domain + model(2x1)"] = {**dom(2, 1), "point": Style.model(2, 1),
                                        "avg.0": Style.model(2, 1), "fc": Style.model(2, 1)}  # fmt: skip
    if P == 4:
        plans["domain(2x2)"] = dom(2, 2)
        plans["domain(2x2) -> domain(4x1) -> model(2x2)"] = {
            **dom(2, 2), "alex.0": Style.domain(4, 1), "dilated.0": Style.domain(4, 1),
            "pooled.0": Style.model(2, 2), "head": Style.model(2, 2),
        }  # fmt: skip
    return plans


def _measured(ledger: Ledger) -> dict:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ledger.bytes_by_layer_term())
    total: dict = {}
    for d in every:
        for (layer, term), v in d.items():
            if term != "metrics":
                total[(layer, term)] = total.get((layer, term), 0.0) + v / STEPS / len(every)
    return total


def _counting_calls(monkeypatch_target: dict) -> None:
    """Count the calls of every windowed module's computation, per module (id)."""
    from hybridpar.runtime.parallel.domain import DomainConv, DomainPool

    for cls in (DomainConv, DomainPool):
        real = cls.compute

        def counted(self, *args, real=real):
            monkeypatch_target[id(self)] = monkeypatch_target.get(id(self), 0) + 1
            return real(self, *args)

        cls.compute = counted


def _train(P: int, shm: bool = True) -> list[str]:
    want = _reference()
    done = []
    options = RuntimeOptions(shared_memory=shm)
    calls: dict[int, int] = {}
    _counting_calls(calls)  # in this rank's process only
    for label, styles in _plans(P).items():
        calls.clear()
        plan = priced(styles, P)
        ledger = Ledger()
        hp = parallelize(_model(), plan, options, ledger=ledger)
        opt = optimizer(hp.parameters())
        for x, y in _data():
            hp.set_batch(B)
            out = hp(x[hp.input_rows(B)])
            loss = torch.nn.functional.cross_entropy(out, y[hp.output_rows(B)], reduction="sum") / B
            opt.zero_grad()
            loss.backward()
            hp.finish_backward()
            opt.step()
        got = hp.full_state_dict()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{label}: {k}")
        assert_calls(ledger, plan, STEPS, label)
        measured, predicted = _measured(ledger), plan.predicted_bytes(by_layer=True)
        assert set(measured) == set(predicted), f"{label}: {set(measured) ^ set(predicted)}"
        for k, v in predicted.items():
            assert measured[k] == pytest.approx(v, rel=1e-12), f"{label}: {k}"
        assert not any(layer == "point" and "halo" in term for layer, term in measured), label
        # a band is one call where its halo comes through shared memory; over messages the
        # interior rows are computed while the halo travels, then the rows at each border
        most = max(calls.values()) / STEPS
        assert most == 1 if shm else most > 1, f"{label}: {most} calls per forward"
        done.append(label)
    return done


@pytest.mark.parametrize("P,shm", [(2, True), (3, True), (4, True), (3, False)])
def test_domain_plans_train_as_one_process_and_book_the_predicted_bytes(P, shm):
    """Parameters after 4 steps equal one process's (float64, rtol 1e-7), and the ledger's
    bytes per (layer, term), halos and redistributions included, equal the prediction exactly;
    the 1x1 layer books no halo. Halo rows through host shared memory, and (shm False) as
    point-to-point messages, as across hosts."""
    done = run_ranks(_train, P, P, shm, timeout_s=240)[0]
    assert len(done) == len(_plans(P)), done


def _input_gradient(P: int):
    """The input's gradient through a domain first layer (its bands' gradients all-gathered back
    into whole images) and the outputs, against one process."""
    x, y = _data()[0]
    ref = _model()
    xr = x.clone().requires_grad_(True)
    out_r = ref(xr)
    torch.nn.functional.cross_entropy(out_r, y, reduction="sum").backward()
    styles = {"stem": Style.domain(P, 1), **{k: Style.domain(P, 1) for k in DOMAIN_LAYERS}}
    hp = parallelize(_model(), priced(styles, P))
    hp.set_batch(B)
    rows = hp.input_rows(B)
    xs = x[rows].clone().requires_grad_(True)
    out = hp(xs)
    torch.nn.functional.cross_entropy(out, y[hp.output_rows(B)], reduction="sum").backward()
    hp.finish_backward()
    torch.testing.assert_close(out, out_r[hp.output_rows(B)], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(xs.grad, xr.grad[rows], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("P", [2, 3])
def test_input_gradients_through_a_domain_first_layer(P):
    run_ranks(_input_gradient, P, P)


def _got(w, parts: int) -> list[dict]:
    """{sender: [lo, hi)} of the rows each rank receives (one piece per sender without wrap)."""
    return [{p.rank: (p.lo, p.hi) for p in mine} for mine in w.plan(parts)]


def test_halo_rows_follow_stride_dilation_and_bands():
    """The rows each band reads from the others (core.halo): a middle band has two
    neighbours and the end bands one; stride and dilation change the rows, not floor(k/2); a
    band thinner than the halo is crossed; a 1x1 window moves nothing."""
    assert bands(13, 4) == [(0, 4), (4, 7), (7, 10), (10, 13)]
    w = Window(3, 1, 1, 1, 12)  # 3x3 pad 1 over 3 bands of 4 rows
    assert _got(w, 3) == [{1: (4, 5)}, {0: (3, 4), 2: (8, 9)}, {1: (7, 8)}]
    assert w.rows_sent(3) == [1, 2, 1] and w.messages(3) == [1, 2, 1]
    dil = Window(3, 1, 2, 2, 12)  # dilation 2: two rows each side
    assert dil.rows_sent(3) == [2, 4, 2]
    alex = Window(11, 4, 2, 1, 53)  # output bands [0,3) [3,6) [6,9) [9,12) over 4 ranks
    assert alex.h_out == 12 and _got(alex, 4)[1] == {0: (10, 14), 2: (27, 29)}
    thin = Window(5, 1, 2, 1, 5)  # 5 rows over 4 ranks: [2, 1, 1, 1]; row 3 reads rows 1..4
    assert _got(thin, 4)[2] == {0: (1, 2), 1: (2, 3), 3: (4, 5)}
    assert Window(1, 1, 0, 1, 12).rows_sent(4) == [0, 0, 0, 0]


def test_a_periodic_dimension_wraps_its_halo_around_the_edges():
    """A circular padding (core.halo.RowMap.wrap): the first band reads the last band's rows
    above it and the last the first's below; on 2 bands each reads two pieces of the other in
    one message; one band (or a band reading its own rows from across the edge) sends
    nothing; an F.pad of the rows maps output row o to input row o - top."""
    from hybridpar.core.halo import Pad, Piece

    w = Window(3, 1, 1, 1, 12, wrap=True)
    assert w.plan(3)[0] == (Piece(2, 11, 12, -1), Piece(1, 4, 5, 4))
    assert w.plan(3)[2] == (Piece(1, 7, 8, 7), Piece(0, 0, 1, 12))
    assert w.rows_sent(3) == [2, 2, 2] and w.messages(3) == [2, 2, 2]
    assert w.plan(2)[0] == (Piece(1, 11, 12, -1), Piece(1, 6, 7, 6))
    assert w.rows_sent(2) == [2, 2] and w.messages(2) == [1, 1]
    assert w.plan(1) == [(Piece(0, 11, 12, -1), Piece(0, 0, 1, 12))] and w.rows_sent(1) == [0]
    assert Window(3, 1, 1, 1, 12).rows_sent(3) == [1, 2, 1]  # zero padding: the ends send less
    pad = Pad(2, -1, 8, wrap=False)  # two rows of fill above, the last row cut off
    assert pad.h_out == 9 and pad.reads(0, 3) == (-2, 1) and _got(pad, 2) == [{}, {0: (3, 4)}]
    assert Pad(2, 1, 8, wrap=True).plan(2)[0] == (Piece(1, 6, 8, -2),)


def test_the_domain_rule_refuses_with_the_reason():
    """What cannot take domain says why, in one line: a Linear, a segment that flattens, more
    ranks than rows (naming the largest Pr that works)."""
    from hybridpar.core.rules import why_not

    with torch.device("meta"):
        layers = {x.name: x for x in cost_layers(analyze(DomainStack(), DomainStack.SHAPE))}
    assert "cannot be split by height" in why_not(layers["fc"], Style.domain(2, 1), B)
    assert "flatten mixes rows" in why_not(layers["head"], Style.domain(2, 1), B)
    assert "largest Pr that works is 5" in why_not(layers["block.conv1"], Style.domain(6, 1), B)
    assert why_not(layers["alex.0"], Style.domain(4, 1), B) == ""


def _half(folder: str, styles: dict, resume: bool):
    """HybridTrainer on `styles`: 2 steps then a checkpoint then 2 more (or, resuming, load and
    the last 2); the full weights at the end."""
    from hybridpar.runtime.parallel import HybridTrainer

    P = dist.get_world_size()
    t = HybridTrainer(_model(), priced(styles, P), optimizer)
    data = _data()
    if resume:
        t.load(folder)
    else:
        for x, y in data[:2]:
            t.train_step(x, y)
        t.save(folder)
    for x, y in data[2:]:
        t.train_step(x, y)
    return t.full_state_dict()


def test_a_domain_checkpoint_resumes_onto_another_grid_and_p(tmp_path):
    """Domain layers hold whole parameters: a checkpoint of domain(2x2) on 4 ranks resumes as
    domain(3x1) on 3 ranks and ends where the uninterrupted run ends (float64)."""
    on4 = {k: Style.domain(2, 2) for k in DOMAIN_LAYERS}
    on3 = {k: Style.domain(3, 1) for k in DOMAIN_LAYERS}
    whole = run_ranks(_half, 4, str(tmp_path), on4, False, timeout_s=180)[0]
    resumed = run_ranks(_half, 3, str(tmp_path), on3, True, timeout_s=180)[0]
    for k, v in whole.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-7, atol=1e-10, msg=k)
