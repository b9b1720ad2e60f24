"""Every plan on a GPU, checked on the CPU (issue 38).

The device matrix (tests/device_matrix.py: every style, hand-off scheme, batch-norm mode,
reducer, codec, bf16, dropout, variable batch and a checkpoint moved between devices) runs on 2
gloo ranks against one process, on the CPU under CUDA's device rules (tests/device_rules.py) and
on the paths a GPU takes (no shared-memory fast path), and on a GPU where there is one (ranks
sharing it over gloo; skipped cleanly here). On 5135867 the CPU run fails with the three crashes
an H200 showed: the batch-norm backward's kernel called without save_mean, gloo point-to-point
given device tensors (the domain halos), a host index into device rows (hand-off rounds)."""

import pytest
import torch
from device_matrix import CELLS, TOLERANCE, data, model, run_cells, update_error
from device_rules import DeviceRules
from dist_helpers import run_ranks

EXPECTED = {c.name: "refused" if c.kind == "refused" else "match" for c in CELLS}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_every_cell_of_the_device_matrix_matches_one_process(device):
    cpu = device == "cpu"  # on the CPU: CUDA's rules checked, the paths a GPU takes
    rows = run_ranks(run_cells, 2, list(EXPECTED), device, cpu, not cpu, timeout_s=240)[0]
    got = {name: result for name, result, *_ in rows}
    bad = [
        f"{name}: {result} {detail}" for name, result, detail, _ in rows if result != EXPECTED[name]
    ]
    assert got.keys() == EXPECTED.keys() and not bad, "\n".join(bad)


def test_the_lossy_tolerance_catches_a_gradient_summed_over_half_the_batch():
    from device_matrix import _steps

    cpu, wide = torch.device("cpu"), torch.float64
    batches = data(wide, cpu)
    start = model(wide, cpu).state_dict()
    want = _steps(model(wide, cpu), batches)
    half = _steps(model(wide, cpu), [(x[: len(x) // 2], y[: len(y) // 2]) for x, y in batches])
    assert update_error(half, want, start) > 2 * max(TOLERANCE.values())
    assert update_error(want, want, start) == 0.0


# --- the rules themselves, one process ----------------------------------------------------------


def test_the_rules_flag_a_host_index_into_device_rows_and_pass_one_made_on_the_rows_device():
    rows = torch.randn(6, 3)  # made before the rules: the inputs' (a GPU's) tensor
    with DeviceRules() as rules:
        rows.index_select(0, torch.arange(6).flip(0))
    assert any("index_select" in v for v in rules.violations), rules.violations
    with DeviceRules() as rules:
        rows.index_select(0, torch.arange(6, device=rows.device).flip(0))
        rows[torch.arange(3)]  # indexing with host indices is allowed on CUDA
        rows * torch.tensor(2.0)  # so is a 0-dim host scalar
        torch.zeros(3, device="cpu") + torch.arange(3)  # host with host
    rules.check()


def test_the_rules_flag_the_batch_norm_backward_without_save_mean():
    x, dy = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    w, mean, var = torch.ones(3), torch.zeros(3), torch.ones(3)
    backward = torch.ops.aten.native_batch_norm_backward
    with DeviceRules() as rules:
        backward(dy, x, w, mean, var, None, None, False, 1e-5, [False, True, True])
    assert any("save_mean" in v for v in rules.violations), rules.violations
    with DeviceRules() as rules:
        backward(dy, x, w, mean, var, mean, var.rsqrt(), False, 1e-5, [False, True, True])
    rules.check()


def test_the_rules_look_inside_backward():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * torch.arange(len(g))  # a host tensor against the gradient's device

    x = torch.randn(3, requires_grad=True)
    with DeviceRules() as rules:
        Scale.apply(x).sum().backward()
    assert any("mul" in v for v in rules.violations), rules.violations


def _reads_per_step() -> list[str]:
    from device_rules import HostReads

    from hybridpar.core.plan import ParallelPlan
    from hybridpar.runtime.parallel.trainer import HybridTrainer

    model_ = model(torch.float32, torch.device("cpu"))
    plan = ParallelPlan(1, 12, {}, input_shape=(1, 8, 8))
    t = HybridTrainer(model_, plan, lambda ps: torch.optim.SGD(ps, lr=0.1))
    (x, y), *_ = data(torch.float32, torch.device("cpu"))
    t.train_step(x, y)  # the first step builds what later steps reuse
    with HostReads() as reads:
        t.train_step(x, y)
    return reads.where


def test_a_one_rank_step_reads_the_device_once():
    """On a GPU every read of a value waits for the kernels queued before it: one per step, the
    loss and the correct count together, after the backward is queued (5135867 read the loss
    right after the forward and the count after the optimizer step: two)."""
    where = run_ranks(_reads_per_step, 1)[0]
    assert len(where) == 1, where
