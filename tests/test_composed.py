"""The five papers in one run (issue 24, item 6): a hybrid grid (Gholami), the FC hand-off sent by
Krizhevsky's scheme (c) in rounds, batch-norm statistics over the batch group (Liu), gradients
summed by the hierarchical host reducer (Sekiyama) across two hosts, and 8-bit activations and
gradients across hosts (Dettmers).

- Without a codec it trains as one process does (rtol 1e-5, float32: the host reducer sums in
  float32 shared memory), P = 4 on a 2x2 grid over two emulated hosts, and P = 3 on uneven hosts
  (2 + 1); `HybridTrainer.predict` then gives every rank the one process's outputs in
  evaluation mode.
- With the codecs and the adaptive batch norm, a checkpoint resumes bit for bit.
- The same with the first stage's convolutions split by rows (domain 2 x 2, Gholami et al.), and
  with ranks dealt to the hosts round-robin. With domain layers the activations stay 32-bit: a
  band's halo rows travel unencoded, and the planner refuses 8-bit activations there.

Hosts are emulated by name (HYBRIDPAR_HOST), so CI needs no network namespaces."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import CLASSES, MAKERS, optimizer, straight_and_resumed
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.handoff import Handoff
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import Style
from hybridpar.core.rules import why_not
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
SHAPE = MAKERS["resnet20"][1]


def _model():
    torch.manual_seed(0)
    return MAKERS["resnet20"][0]()


def _data(B: int, steps: int = 4):
    g = torch.Generator().manual_seed(4)
    return [
        (
            torch.randn(B, *SHAPE, generator=g),
            torch.randint(0, CLASSES, (B,), generator=g),
        )
        for _ in range(steps)
    ]


def _plan(P: int, B: int, grid: tuple[int, int], K: int, choices: Choices, domain: bool = False):
    """The FC layer on `grid` (its hand-off in K rounds of scheme (c)), the convolutions batch;
    with `domain`, the first stage's (conv1 and layer1, 32 x 32 maps) split by rows on `grid`."""
    with torch.device("meta"):
        layers = cost_layers(analyze(_model(), SHAPE))

    def style(x) -> Style:
        if x.kind == "linear":
            return Style.model(*grid)
        first = x.name == "conv1" or x.name.startswith("layer1.")
        if domain and first:
            assert not why_not(x, Style.domain(*grid), B), x.name
            return Style.domain(*grid)
        return Style.batch(P)

    styles = [style(x) for x in layers]
    fc = next(x.name for x in layers if x.kind == "linear")
    priced = evaluate(
        layers, styles, PlanRequest(P, B, NET, choices=choices), handoffs={fc: Handoff("c", K)}
    )
    assert priced.feasible, priced.reason
    return export(priced, procs=P, batch=B, choices=choices, input_shape=SHAPE)


def _host(hosts: list[int]) -> None:
    os.environ["HYBRIDPAR_HOST"] = f"host{hosts[dist.get_rank()]}"


def _equal(P: int, B: int, grid: tuple[int, int], hosts: list[int], domain: bool = False) -> None:
    _host(hosts)
    choices = Choices(reducer="host", bn="global")
    plan = _plan(P, B, grid, 2, choices, domain)
    into_fc = [r.scheme for r in plan.redistributions if r.layer == "fc"]
    assert into_fc == ["c"] and ("domain" in str(plan.styles)) == domain
    t = HybridTrainer(_model(), plan, optimizer, options=RuntimeOptions(host_stage_mb=0.0))
    data = _data(B)
    for x, y in data:
        t.train_step(x, y)
    got = t.full_state_dict()
    # bytes = prediction, the host reducer's leaders' sums per layer from the hosts they span
    from hybridpar.runtime.comm.host import host_name
    from hybridpar.runtime.train.report import measured, predicted

    names: list = [None] * P
    dist.all_gather_object(names, host_name())
    booked = measured(t.ledger, set(range(len(data))))["by_layer"]
    want = predicted(plan, names, t.model.order)[1]
    g = t.model.ctx.grids.grid(grid[1])  # 2x2: the model groups sit within a host, however dealt
    model_hosts = {names[k] for k in dist.get_process_group_ranks(g.model_group.pg)}
    assert len(model_hosts) == 1 or grid[0] > min(map(names.count, names))
    for key in {k for k in {*booked, *want} if k[1] != "codec_overhead"}:
        assert booked.get(key, 0.0) == pytest.approx(want.get(key, 0.0), rel=1e-9), key
    assert sum(v for k, v in booked.items() if k[1] == "dw_allreduce") > 0  # crossed hosts
    outputs = t.predict(data[0][0])  # collective: the global batch's outputs on every rank
    if dist.get_rank() == 0:
        ref = _model()
        opt = optimizer(ref.parameters())
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            opt.step()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"P={P}: {k}")
        with torch.no_grad():
            want_out = ref.eval()(data[0][0])  # the running statistics, as predict uses them
        torch.testing.assert_close(outputs, want_out, rtol=1e-4, atol=1e-5, msg=f"P={P}: outputs")


def _both(folder: str) -> None:
    # torchrun's numbering, then ranks dealt to the hosts round-robin (SLURM's cyclic), then the
    # first stage's convolutions split by rows (Gholami's domain parallelism) as well; each
    # check asserts in the ranks, and a failed one fails the launch
    _equal(4, 12, (2, 2), [0, 0, 1, 1])
    _equal(4, 12, (2, 2), [0, 1, 0, 1])
    _equal(4, 12, (2, 2), [0, 0, 1, 1], domain=True)
    _resume(folder)
    _resume(folder + "-domain", domain=True)


def test_the_composed_run_trains_as_one_process_on_a_2x2_grid_across_two_hosts(tmp_path):
    """And, in the same spawn, with 8-bit codecs and adaptive BN a checkpoint resumes bit for
    bit (`_resume`)."""
    run_ranks(_both, 4, str(tmp_path / "ck"), timeout_s=300)


def test_the_composed_run_trains_as_one_process_on_uneven_hosts():
    run_ranks(_equal, 3, 3, 15, (3, 1), [0, 0, 1], timeout_s=240)


def _resume(folder: str, domain: bool = False) -> None:
    """With domain layers the activations stay 32-bit: a band's halo rows travel unencoded
    (the planner and the runtime refuse 8-bit activations there), the gradients go 8-bit."""
    _host([0, 0, 1, 1])
    compress = ("grads",) if domain else ("grads", "activations")
    choices = Choices(reducer="host", bn="adaptive", codec="dynamic-tree", compress=compress)
    plan = _plan(4, 12, (2, 2), 2, choices, domain)
    options = RuntimeOptions(host_stage_mb=0.0, bn_window=1, bn_threshold=10.0)  # BN turns global
    data = _data(12, 6)
    t = HybridTrainer(_model(), plan, optimizer, options=options)
    want, got = straight_and_resumed(
        t, lambda: HybridTrainer(_model(), plan, optimizer, options=options), data, 3, folder
    )
    assert t.model.bn_switch.record()["switched_at_step"] is not None
    for k, v in want.items():
        assert torch.equal(got[k], v), k
