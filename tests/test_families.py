"""Any CNN a user brings (issue 23): five model families written the way torchvision writes them
(tests/nets.py FAMILIES: MobileNetV2-style inverted residuals with depthwise convolutions,
ShuffleNetV2-style units with a channel split, depthwise convolutions and a channel shuffle,
EfficientNet-style blocks with squeeze-and-excitation, SiLU and stochastic depth, Inception-style
branches joined by torch.cat, DenseNet-style blocks concatenating every earlier feature map) train
under the planner's auto, model and same-grid plans exactly as one process does, through
`plan_for(...).export()` and `HybridTrainer` as the README tells a user, on 2, 3 and 4 gloo ranks.
In float64 (batch norm on tiny batches amplifies rounding), rtol 1e-7; and the ledger's bytes per
(layer, term) equal the plan's prediction, the depthwise layers' dX all-gathers included."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import CLASSES, FAMILIES, MAKERS, B, optimizer

from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.terms import Term
from hybridpar.planning.search import plan_for
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
STEPS = 3
SCENARIOS = {"auto": None, "model": ["model"], "same-grid": ["same-grid"]}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MAKERS[name][0]().double()


def _data(shape):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(B, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (B,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _reference(name: str, data) -> dict:
    m = _model(name)
    opt = optimizer(m.parameters())
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m.state_dict()


def user_plans(name: str, P: int) -> dict:
    """label -> the plan a user gets from plan_for(model, ...).export() for auto, model, same-grid
    (a scenario no plan of which fits, such as pure model parallelism over 3 ranks for a layer of
    2 channels, is refused by the planner and left out)."""
    shape = MAKERS[name][1]
    out, seen = {}, set()
    for label, scenarios in SCENARIOS.items():
        kw = {"scenarios": scenarios} if scenarios else {}
        try:
            plan = plan_for(_model(name), shape, P, B, NET, elem_bytes=8, **kw).export()
        except ConfigError as e:
            assert label != "auto" and "no plan fits" in str(e), e
            continue
        key = tuple((k, v.label) for k, v in plan.styles.items())
        if key not in seen:
            seen.add(key)
            out[label] = plan
    return out


def _families(P: int) -> list[str]:
    done = []
    for name in FAMILIES:
        data = _data(MAKERS[name][1])
        want = _reference(name, data)
        for label, plan in user_plans(name, P).items():
            ledger = Ledger()
            t = HybridTrainer(_model(name), plan, optimizer, ledger=ledger)
            for x, y in data:
                t.train_step(x, y)
            got = t.full_state_dict()
            tag = f"{name} P={P} {label}: " + ", ".join(
                sorted({str(s) for s in plan.styles.values()})
            )
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=f"{tag}: {k}")
            every = [None] * P
            dist.all_gather_object(every, ledger.bytes_by_layer_term())
            measured: dict = {}
            for d in every:
                for (layer, term), v in d.items():
                    if str(term) in {str(x) for x in (Term.CODEC_OVERHEAD, Term.METRICS)}:
                        continue
                    key = (layer, str(term))
                    measured[key] = measured.get(key, 0.0) + v / STEPS / P
            predicted = plan.predicted_bytes(by_layer=True)
            assert set(measured) == set(predicted), f"{tag}: {set(measured) ^ set(predicted)}"
            for k, v in predicted.items():
                assert measured[k] == pytest.approx(v, rel=1e-12), f"{tag}: {k}"
            done.append(tag)
    return done


@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_family_equals_one_process_under_the_users_plans(P):
    done = run_ranks(_families, P, P, timeout_s=400)[0]
    split = {t.split()[0] for t in done if "model(" in t}
    assert {t.split()[0] for t in done if " auto: " in t} == set(FAMILIES), done
    assert split == set(FAMILIES), f"families never split: {set(FAMILIES) - split}; {done}"


def test_the_planner_splits_depthwise_convolutions():
    """The model scenario's plan for MobileNetV2 puts its depthwise convolutions on model grids,
    and prices their backward as an all-gather of dX (not an all-reduce)."""
    plan = user_plans("mobilenetv2", 3)["model"]
    dw = "features.2.conv.1.0"  # 21 channels, 21 groups
    assert plan.styles[dw].pr == 3, plan.styles
    terms = {t for (layer, t) in plan.predicted_bytes(by_layer=True) if layer == dw}
    assert "dx_allgather" in {str(t) for t in terms} and "dx_allreduce" not in {
        str(t) for t in terms
    }
