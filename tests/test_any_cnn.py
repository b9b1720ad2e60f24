"""Plan = run, for any CNN (issue 23): over random CNNs built from what real models are made of --
grouped and depthwise convolutions, padding modes other than zeros, channel counts no Pr divides,
branches joined by torch.cat, residual adds, squeeze-and-excitation gates
(x * sigmoid(fc(pool(x)))), channel shuffles (view / transpose / flatten), stochastic depth, pooling
-- every plan of every scenario the planner exports (each feasible grid candidate, not only the
best) is accepted by the runtime's `resolve` on P = 2, 3 and 4, and so is the plan it exports with
the host reducer (whose plans must be all batch)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nets import StochasticDepth, channel_shuffle
from torch import nn

from hybridpar.core.analysis import analyze, trace
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import SCENARIOS, plan_layers
from hybridpar.runtime.parallel.layout import resolve

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
SLOW = Cluster("slow-net", alpha=1e-4, beta=1e-7, flops=1e12)  # model splits win here
B, SHAPE = 12, (3, 8, 8)
PADS = ["zeros", "zeros", "reflect", "replicate", "circular"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Block(nn.Module):
    """One random block; `spec` = (kind, parameters) drawn below; `c` channels in, `self.out` out."""

    def __init__(self, spec: tuple, c: int) -> None:
        super().__init__()
        kind, a, b, pad = spec
        self.kind, self.out = kind, c
        if kind == "conv":  # a: width, b: groups choice, any padding mode
            fits = [g for g in _divisors(c) if a % g == 0]
            groups = fits[b % len(fits)]
            self.f = nn.Sequential(
                nn.Conv2d(c, a, 3, padding=1, groups=groups, padding_mode=pad),
                nn.BatchNorm2d(a),
                nn.ReLU(),
            )
            self.out = a
        elif kind == "depthwise":  # with an expansion (a = multiplier of the channels)
            m = 1 + a % 2
            self.f = nn.Sequential(
                nn.Conv2d(c, c * m, 3, padding=1, groups=c, padding_mode=pad), nn.SiLU()
            )
            self.out = c * m
        elif kind == "cat":  # two branches joined by torch.cat
            self.p, self.q = nn.Conv2d(c, a, 1), nn.Conv2d(c, b + 1, 3, padding=1)
            self.out = a + b + 1
        elif kind == "residual":
            self.f = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        elif kind == "se":  # squeeze-and-excitation
            self.fc1, self.fc2 = nn.Conv2d(c, a, 1), nn.Conv2d(a, c, 1)
        elif kind == "shuffle":  # channel shuffle over a divisor of c
            self.groups = _divisors(c)[b % len(_divisors(c))]
        elif kind == "drop-path":  # stochastic depth on a residual branch
            self.f, self.sd = nn.Conv2d(c, c, 1), StochasticDepth(0.0)
        elif kind == "pool":
            self.f = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k in ("conv", "depthwise", "pool"):
            return self.f(x)
        if k == "cat":
            return torch.cat([self.p(x), self.q(x)], 1)
        if k == "residual":
            return torch.relu(x + self.f(x))
        if k == "se":
            s = nn.functional.adaptive_avg_pool2d(x, 1)
            return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))
        if k == "shuffle":
            return channel_shuffle(x, self.groups)
        return x + self.sd(self.f(x))


class RandomCNN(nn.Module):
    def __init__(self, stem: int, specs: list, hidden: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, stem, 3, padding=1)
        blocks, c, h = [], stem, SHAPE[1]
        for spec in specs:
            if spec[0] == "pool":
                if h < 4:
                    continue
                h //= 2
            blocks.append(Block(spec, c))
            c = blocks[-1].out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Linear(c, hidden), nn.ReLU(), nn.Linear(hidden, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.stem(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


KINDS = ["conv", "depthwise", "cat", "residual", "se", "shuffle", "drop-path", "pool"]
specs = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(1, 9),
        st.integers(0, 7),
        st.sampled_from(PADS),
    ),
    min_size=1,
    max_size=6,
)


def _plans(traced, P: int, net: Cluster, choices: Choices):
    layers = cost_layers(traced.specs)
    r = plan_layers(
        layers, PlanRequest(P, B, net, choices=choices, scenarios=SCENARIOS, input_shape=SHAPE)
    )
    for scenario in SCENARIOS:
        for candidate in r.candidates[scenario]:
            if candidate.feasible:
                yield r.export(candidate)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stem=st.integers(2, 9), specs=specs, hidden=st.integers(2, 9))
def test_every_exported_plan_is_accepted_by_the_runtime(stem, specs, hidden):
    model = RandomCNN(stem, specs, hidden)
    traced = trace(model, SHAPE)  # once, as `hybridpar train` traces once for every check
    for P in (2, 3, 4):
        for net, choices in ((NET, Choices()), (SLOW, Choices()), (SLOW, Choices(reducer="host"))):
            n = 0
            for plan in _plans(traced, P, net, choices):
                resolve(model, plan, SHAPE, P, traced)  # ConfigError on a refused (layer, style)
                n += 1
            assert n, f"no plan at all for P={P}"


def test_a_depthwise_split_is_planned_and_accepted():
    """A fixed case the property above covers by chance: a depthwise conv of 6 channels takes
    model(3x1) (whole groups of 1) and is accepted; a grouped conv of 2 groups of 3 channels
    cannot take model(4x1), and the planner's reason names the Prs that work."""
    from hybridpar.core.plan import Style
    from hybridpar.core.rules import why_not

    model = RandomCNN(6, [("depthwise", 2, 0, "reflect"), ("conv", 6, 1, "zeros")], 4)
    with torch.device("meta"):
        layers = {x.name: x for x in cost_layers(analyze(model, SHAPE))}
    assert why_not(layers["blocks.0.f.0"], Style.model(3, 1), B) == ""
    grouped = layers["blocks.1.f.0"]
    assert grouped.groups == 2, grouped
    why = why_not(grouped, Style.model(4, 1), B)
    assert "would cut one of its 2 groups" in why and "[2]" in why, why


@pytest.mark.parametrize("pad", ["reflect", "replicate"])
def test_other_padding_modes_cannot_take_domain(pad):
    """(A circular padding wraps around: tests/test_operations.py.)"""
    from hybridpar.core.plan import Style
    from hybridpar.core.rules import why_not

    model = RandomCNN(4, [("conv", 4, 0, pad)], 4)
    with torch.device("meta"):
        layers = {x.name: x for x in cost_layers(analyze(model, SHAPE))}
    assert f"pads with '{pad}'" in why_not(layers["blocks.0.f.0"], Style.domain(2, 1), B)


def test_train_with_the_host_reducer_plans_splits_under_auto(train_job):
    """`hybridpar train --reducer host` as a user types it (preset auto): the host reducer runs
    any grid (a reducer per batch group), so on a cluster where the planner splits the FC layers
    it splits them with the host reducer too, and the runtime accepts the plan."""
    from nets import zoo

    from hybridpar.runtime.train.plans import preset_plan, pricing_cluster

    shape = (1, 8, 8)
    model = zoo("digits-wide", 8)()
    slow = pricing_cluster(train_job(cluster="fdr-infiniband"), False)
    for reducer, split in (("process-group", True), ("host", True)):
        job = train_job(procs=4, batch=64, reducer=reducer)
        plan = preset_plan(job, slow)
        assert any(not s.is_batch for s in plan.styles.values()) == split, (reducer, plan.styles)
        resolve(model, plan, shape, 4)
