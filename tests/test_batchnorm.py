"""GlobalBatchNorm: outputs, input/weight/bias gradients and running statistics equal nn.BatchNorm's
on the concatenated global batch (rtol 1e-5) for P = 2 and 4, 1d and 2d, uneven batches including a
rank with no examples; one all-reduce forward and one backward per layer; the adaptive switch is
taken at the same step on every rank."""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn

from hybridpar.runtime.comm import kernels
from hybridpar.runtime.comm.collectives import Via, all_reduce
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel import batchnorm
from hybridpar.runtime.parallel.batchnorm import (
    AdaptiveGlobalBatchNorm,
    BNSwitch,
    GlobalBatchNorm2d,
    GlobalStatistics,
    LossPlateau,
    convert_global_batchnorm,
)

SIZES = {2: [3, 5], 3: [3, 0, 4], 4: [3, 0, 4, 2]}  # examples per rank; rank 1 of 3, 4 has none
USE_KERNELS = batchnorm._use_kernels
STEPS = 3


def _shape(dims, n):
    return {1: (n, 6), 2: (n, 6, 3, 4)}[dims]


def _data(dims, sizes, step, offset=0.0):
    g = torch.Generator().manual_seed(100 + step)
    n = sum(sizes)
    x = torch.randn(_shape(dims, n), generator=g) * 3 + offset
    r = torch.randn(_shape(dims, n), generator=g)  # the loss is sum(y * r)
    return x, r


def _reference(dims, sizes, affine, momentum, offset=0.0, dtype=torch.float32):
    torch.manual_seed(0)
    bn = (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(6, affine=affine, momentum=momentum)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    start = copy.deepcopy(bn)
    bn = bn.to(dtype)
    outs = []
    for step in range(STEPS):
        x, r = _data(dims, sizes, step, offset)
        x = x.to(dtype).requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * r.to(dtype)).sum().backward()
        grads = (bn.weight.grad.clone(), bn.bias.grad.clone()) if affine else None
        outs.append((y.detach(), x.grad.clone(), grads))
    return start, bn, outs


def _exactness(dims, affine, momentum, path="kernels"):
    if path == "torch":  # the CUDA / other-dtype path, run here on CPU
        batchnorm._use_kernels = lambda *a: False
    else:
        assert kernels.available()
    P, rank = dist.get_world_size(), dist.get_rank()
    sizes = SIZES[P]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    start, ref, outs = _reference(dims, sizes, affine, momentum)
    ledger = Ledger()
    bn = convert_global_batchnorm(copy.deepcopy(start), ledger=ledger, layer_of={"": "bn"})
    assert type(bn) is type(start)  # the statistics change, not the class
    worst = 0.0
    for step in range(STEPS):
        x, r = _data(dims, sizes, step)
        x = x[lo:hi].clone().requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * r[lo:hi]).sum().backward()
        y_ref, dx_ref, grads_ref = outs[step]
        pairs = [(y, y_ref[lo:hi]), (x.grad, dx_ref[lo:hi])]
        if affine:
            gw, gb = bn.weight.grad.clone(), bn.bias.grad.clone()
            all_reduce(gw, Via(dist.group.WORLD))  # what the gradient synchroniser does
            all_reduce(gb, Via(dist.group.WORLD))
            pairs += [(gw, grads_ref[0]), (gb, grads_ref[1])]
        for a, b in pairs:
            torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-5)
            worst = max(worst, float((a.detach() - b).abs().max()) if a.numel() else 0.0)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked)
    # eval mode uses the running statistics, like nn.BatchNorm
    bn.eval()
    ref.eval()
    x, _ = _data(dims, sizes, 99)
    torch.testing.assert_close(bn(x[lo:hi]), ref(x[lo:hi]).detach(), rtol=1e-5, atol=1e-5)
    return ledger.count("bn_stats"), ledger.count("bn_grad"), worst


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dims", [1, 2])
def test_matches_batchnorm_on_the_global_batch(P, dims):
    for stats, grads, _ in run_ranks(_exactness, P, dims, True, 0.1):
        assert (stats, grads) == (STEPS, STEPS)  # exactly one all-reduce forward, one backward


def test_affine_false_and_cumulative_momentum():
    run_ranks(_exactness, 2, 2, False, None)


def test_torch_path_matches_batchnorm_on_the_global_batch():
    """The path CUDA and non-float32 tensors take, here on CPU over 3 ranks (without affine
    parameters: the one-process test below)."""
    for stats, grads, _ in run_ranks(_exactness, 3, 2, True, 0.1, "torch"):
        assert (stats, grads) == (STEPS, STEPS)


@pytest.mark.parametrize("shape", [(7, 5), (7, 5, 3), (4, 5, 3, 2)])
@pytest.mark.parametrize("affine", [True, False])
def test_kernel_and_torch_paths_agree_in_one_process(shape, affine):
    """_GlobalBatchNormFn on one rank (no group: the all-reduces are no-ops) by both paths against
    nn.BatchNorm: output, input and parameter gradients, running statistics; dy not contiguous."""
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(5, affine=affine) if len(shape) < 4 else nn.BatchNorm2d(5, affine=affine)
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
    x = torch.randn(shape) * 2 + 3
    dy = torch.randn(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    assert not dy.is_contiguous()
    outs = []
    for fast in (True, False, None):  # kernels, torch ops, nn.BatchNorm
        bn = copy.deepcopy(ref)
        xi = x.clone().requires_grad_()
        if fast is None:
            y = bn(xi)
        else:
            batchnorm._use_kernels = (lambda *a: True) if fast else (lambda *a: False)
            try:
                run = (bn.running_mean, bn.running_var)
                y = batchnorm._GlobalBatchNormFn.apply(
                    xi, bn.weight, bn.bias, run, 0.1, bn.eps, Via(None)
                )
            finally:
                batchnorm._use_kernels = USE_KERNELS
        y.backward(dy)
        grads = [bn.weight.grad, bn.bias.grad] if affine else []
        outs.append([y.detach(), xi.grad, *grads, bn.running_mean, bn.running_var])
    for a, b, c in zip(*outs, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 5), (7, 5, 3), (4, 5, 6, 7), (2, 3, 1, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_bf16_kernels_round_what_the_float32_kernels_compute(shape, affine):
    """The kernels on bfloat16 activations (as autocast hands them over) read each value as the
    float32 kernels read its float32 copy and round their results to nearest even: the same
    output and input gradient, rounded, bit for bit; the same parameter gradients and running
    statistics. Before, the kernels took float32 only: under autocast the module cast the
    activation to float32 and back around them."""
    if not kernels.available():
        pytest.skip("no C compiler: the kernels are not built")
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2 + 3).bfloat16()
    dy = torch.randn(shape).bfloat16()
    assert batchnorm._use_kernels(x, None, None)
    outs = []
    for dtype in (torch.bfloat16, torch.float32):
        bn = (
            nn.BatchNorm1d(5, affine=affine)
            if len(shape) < 4
            else nn.BatchNorm2d(shape[1], affine=affine)
        )
        if affine:
            with torch.no_grad():
                bn.weight.copy_(torch.linspace(0.5, 1.5, bn.num_features))
                bn.bias.copy_(torch.linspace(-1, 1, bn.num_features))
        xi = x.to(dtype, copy=True).requires_grad_()
        run = (bn.running_mean, bn.running_var)
        y = batchnorm._GlobalBatchNormFn.apply(xi, bn.weight, bn.bias, run, 0.1, bn.eps, Via(None))
        assert y.dtype == dtype
        y.backward(dy.to(dtype))
        grads = [bn.weight.grad, bn.bias.grad] if affine else []
        outs.append([y.detach(), xi.grad, *grads, *run])
    (y16, dx16, *rest16), (y32, dx32, *rest32) = outs
    assert dx16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.bfloat16())
    assert torch.equal(dx16, dx32.bfloat16())
    for a, b in zip(rest16, rest32, strict=True):
        assert torch.equal(a, b)


def test_bf16_kernels_round_ties_to_even():
    """Per channel +1 and -1 (mean 0, variance 1; eps 0): y = x + b. 1 + 2^-8 and 1 + 3 2^-8 lie
    halfway between two bfloat16 values; each rounds to the even one (1.0 down, 1 + 2^-6 up), as
    torch rounds."""
    if not kernels.available():
        pytest.skip("no C compiler: the kernels are not built")
    x = torch.tensor([1.0, -1.0, 1.0, -1.0]).view(4, 1, 1, 1).expand(4, 3, 1, 1).contiguous()
    w, b = torch.ones(3), torch.tensor([1.0, 3.0, 0.0]) * 2.0**-8
    y = batchnorm._GlobalBatchNormFn.apply(x.bfloat16(), w, b, None, 0.0, 0.0, Via(None))
    y32 = batchnorm._GlobalBatchNormFn.apply(x, w, b, None, 0.0, 0.0, Via(None))
    assert y32[0, :2, 0, 0].tolist() == [1 + 2.0**-8, 1 + 3 * 2.0**-8]
    assert torch.equal(y, y32.bfloat16())
    assert y[0, :2, 0, 0].tolist() == [1.0, 1 + 2.0**-6]


def _casts_under_autocast():
    """aten casts a global BN's forward and backward dispatch under CPU bf16 autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Casts.n += func.overloadpacket is torch.ops.aten._to_copy
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    bn = convert_global_batchnorm(nn.BatchNorm2d(4))
    x = torch.randn(3, 4, 5, 5).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
        y = bn(x)
        y.backward(torch.ones_like(y))
    return Casts.n, y.dtype, x.grad.dtype


def test_under_autocast_the_kernels_take_bf16_without_casts():
    """The casts of the activation to float32 and back, forward and backward, cost as much as
    the batch norm itself at resnet20's first layers (docs/batchnorm.md); the kernels read
    bf16."""
    if not kernels.available():
        pytest.skip("no C compiler: the kernels are not built")
    for casts, y, dx in run_ranks(_casts_under_autocast, 2):
        assert (casts, y, dx) == (0, torch.bfloat16, torch.bfloat16)


def _large_mean():
    """mean 1e4, std 3: fp32 E[x^2] - E[x]^2 would lose every digit of the variance."""
    P, rank = dist.get_world_size(), dist.get_rank()
    sizes = SIZES[P]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    start, _, outs64 = _reference(2, sizes, True, 0.1, offset=1e4, dtype=torch.float64)
    bn = convert_global_batchnorm(copy.deepcopy(start))
    x, _ = _data(2, sizes, 0, offset=1e4)
    y = bn(x[lo:hi])
    err = float((y.double() - outs64[0][0][lo:hi]).abs().max())
    naive_var = (x.float() ** 2).mean((0, 2, 3)) - x.float().mean((0, 2, 3)) ** 2
    true_var = x.double().var((0, 2, 3), unbiased=False)
    naive_err = float(((naive_var.double() - true_var) / true_var).abs().max())
    return err, naive_err


def test_no_cancellation_for_large_means():
    for err, naive_err in run_ranks(_large_mean, 2):
        assert err < 2e-3, err  # normalised outputs are O(1); fp32 rounding of x itself is ~1e-3
        assert naive_err > 1e-2  # the naive fp32 formula really is wrong on this data


def _under_autocast():
    """A global BN between two convolutions under CPU bf16 autocast, as the trainer runs it."""
    P, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3))
    reference, x = copy.deepcopy(net), torch.randn(4 * P, 3, 8, 8)
    got = convert_global_batchnorm(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = got[:2](x[4 * rank : 4 * rank + 4])
        want = reference[:2](x)[4 * rank : 4 * rank + 4]
        got(x[4 * rank : 4 * rank + 4]).float().sum().backward()
    return mine.dtype, want.dtype, float((mine.float() - want.float()).abs().max())


def test_under_autocast_global_bn_hands_on_the_dtype_torch_batch_norm_does():
    """Under CPU bf16 autocast torch's batch norm gives bf16 to the next layer; the global one
    normalises in float32 and gives the same dtype (before: float32, so the activation and the
    next layer's input cast were twice as large as a one-process run's)."""
    for mine, want, err in run_ranks(_under_autocast, 2):
        assert mine == want == torch.bfloat16
        assert err < 0.05, err  # bf16 rounding of O(1) normalised values


def test_single_process_is_plain_batchnorm():
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4)
    bn = convert_global_batchnorm(copy.deepcopy(ref))
    x = torch.randn(5, 4, 3, 3)
    torch.testing.assert_close(bn(x), ref(x))
    torch.testing.assert_close(bn.running_var, ref.running_var)
    with pytest.raises(ValueError, match="4D"):
        bn(torch.randn(5, 4))


def test_convert_is_recursive_and_keeps_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(5)))
    model[1].running_mean.fill_(0.5)
    keys = set(model.state_dict())
    switch = BNSwitch(bz_max=4)
    conv = convert_global_batchnorm(model, switch=switch)
    assert conv is model and type(conv[1]) is nn.BatchNorm2d  # in place, classes kept
    assert type(conv[2][0]) is nn.BatchNorm1d
    stats = [conv[1].hybridpar_statistics, conv[2][0].hybridpar_statistics]
    assert all(isinstance(st, GlobalStatistics) and st.switch is switch for st in stats)
    assert set(conv.state_dict()) == keys
    assert float(conv[1].running_mean[0]) == 0.5
    assert GlobalBatchNorm2d(2)._dims == (4,)
    assert AdaptiveGlobalBatchNorm(2, switch=switch).statistics.switch is switch


def _adaptive(window, threshold, bz_max, per_rank):
    rank = dist.get_rank()
    ledger = Ledger()
    switch = BNSwitch(bz_max=bz_max, rule=LossPlateau(window, threshold), ledger=ledger)
    switch.start(per_rank * dist.get_world_size())  # BZ: the global batch
    torch.manual_seed(0)
    model = convert_global_batchnorm(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)),
        switch=switch,
        ledger=ledger,
    )
    per_step = []
    for step in range(8):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(per_rank, 3, generator=g)
        before = ledger.count("bn_stats")
        loss = model(x).pow(2).sum()
        loss.backward()
        per_step.append(ledger.count("bn_stats") - before)
        # a loss, different on each rank, that stops improving at step 2: the window means are
        # 10, 1, 1, so the third window (steps 4-5) sees no improvement and the switch comes at 6
        switch.observe(1.0 if step >= 2 else 10.0 - step + rank, 1)
    return switch.record(), per_step, ledger.count("bn_switch")


def test_adaptive_starts_local_and_turns_global_on_every_rank_at_the_same_step():
    """Liu et al. 4.3: the global step is skipped until the model converges."""
    results = run_ranks(_adaptive, 2, 2, 0.05, None, 4)
    records = [r for r, _, _ in results]
    assert all(r == records[0] for r in records)  # one decision for all ranks
    rec = records[0]
    assert rec["mode"] == "global" and rec["switched_at_step"] == 6
    assert "converged" in rec["reason"]
    for _, per_step, agreed in results:
        assert per_step == [0] * 6 + [1] * 2  # local statistics until the switch, global after
        assert agreed == 3  # one agreement per window until the switch, none after


def test_adaptive_stays_local_throughout_for_a_large_global_batch():
    """BZ = 8 (2 ranks x 4) >= bz_max = 8: local throughout, and nothing is all-reduced to decide."""
    for rec, per_step, agreed in run_ranks(_adaptive, 2, 2, 0.05, 8, 4):
        assert rec["mode"] == "local" and rec["switched_at_step"] is None
        assert "bz_max" in rec["reason"] and per_step == [0] * 8 and agreed == 0
    # one example fewer per rank: BZ = 6 < 8, so the rule is watched and the switch comes
    for rec, per_step, _ in run_ranks(_adaptive, 2, 2, 0.05, 8, 3):
        assert rec["mode"] == "global" and per_step == [0] * 6 + [1] * 2


def test_the_convergence_signal_is_the_training_accuracy_by_default():
    """Liu et al. watch the training accuracy ("until the training accuracy converges"); the
    loss is a choice (RuntimeOptions.bn_signal, --bn-signal). One process, windows of 2 steps:
    accuracy 0.2, 0.5, 0.8, 0.8, ... turns global after the fourth window, while the loss of the
    same steps keeps falling by 20 % a window, so the loss rule never switches."""
    from hybridpar.runtime.options import RuntimeOptions
    from hybridpar.runtime.parallel.batchnorm import Plateau

    assert RuntimeOptions().bn_signal == "accuracy" and Plateau().signal == "accuracy"
    by_signal = {}
    for signal in ("accuracy", "loss"):
        switch = BNSwitch(rule=Plateau(2, 0.05, signal))
        switch.start(10)
        for step in range(12):
            acc = min(0.2 + 0.3 * (step // 2), 0.8)
            switch.observe(loss_sum=10 * 0.8 ** (step // 2), count=10, correct=10 * acc)
        by_signal[signal] = switch.record()
    acc, loss = by_signal["accuracy"], by_signal["loss"]
    assert acc["mode"] == "global" and acc["switched_at_step"] == 8, acc
    assert acc["window_means"][:4] == pytest.approx([0.2, 0.5, 0.8, 0.8])
    assert "training accuracy converged" in acc["reason"]
    assert loss["mode"] == "local" and loss["rule"]["signal"] == "loss", loss
    with pytest.raises(ValueError, match="signal"):
        Plateau(2, 0.05, "gradnorm")
