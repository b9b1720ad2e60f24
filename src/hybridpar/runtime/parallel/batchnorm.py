"""Global batch normalisation over a process group, on any backend (Liu et al., Algorithms 1-5).

torch's SyncBatchNorm runs only on CUDA tensors; GlobalBatchNorm runs on whatever the group's
backend carries (gloo on CPU, NCCL on GPU) and weights each rank by its own number of examples m_i,
so uneven batches, including a rank with none, normalise exactly like one BatchNorm over the
concatenated global batch.

Forward: one all-reduce of [sum (x), sum (x^2), m] per channel. Backward: one all-reduce of
[sum dy, sum dy * (x - mean)] (Algorithm 4's phi_i, taken about the global mean, which is the same
quantity minus psi * mean and better conditioned). The weight and bias gradients returned are this
rank's share, as in torch's SyncBatchNorm: the gradient synchroniser (hybridpar's or DDP) sums them.

Numerics. var = E[x^2] - E[x]^2 cancels catastrophically in fp32 when |mean| >> std. Each rank
computes its own mean and variance stably (two passes: the C kernel in float64 on CPU, torch's
`batch_norm_update_stats` elsewhere), turns them into the sums
m_i*mu_i and m_i*(var_i + mu_i^2) in float64, and the reduction and the subtraction happen in
float64. The relative error of the variance is then about 1e-16 * (mean/std)^2 instead of 1e-7 *
(mean/std)^2: a channel with mean 1e4 and std 1 comes out right to about 1e-8 (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpar.core import ops
from hybridpar.core.halo import tile
from hybridpar.core.terms import Term
from hybridpar.runtime.comm import kernels
from hybridpar.runtime.comm.collectives import Via, all_reduce
from hybridpar.runtime.comm.group import Group, group_size
from hybridpar.runtime.comm.ledger import Ledger

__all__ = [
    "AdaptiveGlobalBatchNorm",
    "BNSwitch",
    "BandStatistics",
    "GlobalBatchNorm",
    "GlobalBatchNorm1d",
    "GlobalBatchNorm2d",
    "GlobalStatistics",
    "LossPlateau",
    "Plateau",
    "convert_global_batchnorm",
]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


_ELEM = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the kernels' element types


def _use_kernels(x: torch.Tensor, weight: torch.Tensor | None, running) -> bool:
    """The C kernels take contiguous CPU activations of float32 or bfloat16 (as autocast hands
    them over), with float32 parameters and buffers."""
    f32 = torch.float32
    return (
        x.device.type == "cpu"
        and x.dtype in _ELEM
        and x.is_contiguous()
        and (weight is None or weight.dtype == f32)
        and (running is None or all(r.dtype == f32 and r.is_contiguous() for r in running))
        and kernels.available()
    )


class _GlobalBatchNormFn(torch.autograd.Function):
    """Global BN's forward and backward, each around one all-reduce. `running` is (running_mean,
    running_var) to update with weight `factor`, or None. `via` books the forward's all-reduce
    (as BN_STATS) and `grad_via`, where given, the backward's (else `via` as BN_GRAD).

    At a per-rank batch of 8 a BN layer holds a few thousand values, so small ops, not arithmetic,
    set its cost. On CPU, for float32 and bfloat16 activations, four C kernels
    (hybridpar.runtime.comm.kernels) do the work: the moments, the normalisation with the
    running-statistics update, the backward's sums, and dx. Elsewhere (CUDA, other dtypes) torch
    ops do it: forward `batch_norm_update_stats`, the all-reduce, then
    batch norm in eval mode with the global statistics as its running ones; backward torch's
    eval-mode batch-norm backward for this rank's sums and, after their all-reduce, dx = w invstd
    dy + [the eval-mode batch norm of x whose weight and bias carry the global sums]."""

    @staticmethod
    def forward(ctx, x, weight, bias, running, factor, eps, via: Via, grad_via: Via | None = None):
        c = x.shape[1]
        n, s = (x.shape[0], x.numel() // (x.shape[0] * c)) if x.numel() else (0, 0)
        fast = _use_kernels(x, weight, running)
        stats = torch.empty(2 * c + 1, dtype=torch.float64, device=x.device)
        if fast:
            kernels.bn(_ELEM[x.dtype]).stats(x.data_ptr(), n, c, s, stats.data_ptr())
        else:
            _stats_torch(x, stats)
        all_reduce(stats, via if via.term == Term.BN_STATS else replace(via, term=Term.BN_STATS))
        m = float(stats[2 * c])
        if m <= 1:
            raise ValueError(
                f"GlobalBatchNorm needs more than 1 value per channel over the group, got {int(m)}"
            )
        if fast:
            y, var = torch.empty_like(x), None
            mean, invstd = (x.new_empty(c, dtype=torch.float32) for _ in range(2))
            rm, rv = running if running is not None else (None, None)
            kernels.bn(_ELEM[x.dtype]).forward(
                x.data_ptr(), n, c, s, stats.data_ptr(), eps, _ptr(weight), _ptr(bias),
                y.data_ptr(), mean.data_ptr(), invstd.data_ptr(), _ptr(rm), _ptr(rv), factor,
            )  # fmt: skip
        else:
            y, mean, var, invstd = _forward_torch(x, stats, m, weight, bias, running, factor, eps)
        ctx.save_for_backward(x, weight, mean, invstd, var)
        ctx.m, ctx.eps, ctx.fast = m, eps, fast
        ctx.via = grad_via or replace(via, term=Term.BN_GRAD)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, var = ctx.saved_tensors
        c, need = x.shape[1], ctx.needs_input_grad
        n, s = (x.shape[0], x.numel() // (x.shape[0] * c)) if x.numel() else (0, 0)
        fast = ctx.fast
        if fast:
            dy = dy.contiguous()
        sums = torch.empty(2 * c, dtype=torch.float64, device=x.device)
        # this rank's sum dy and invstd * sum dy * (x - mean): the bias and weight gradients'
        # shares (the gradient synchroniser sums them, as for torch's SyncBatchNorm)
        if fast:
            dweight = torch.empty_like(weight) if weight is not None and need[1] else None
            dbias = torch.empty_like(weight) if weight is not None and need[2] else None
            kernels.bn(_ELEM[x.dtype]).backward_reduce(
                dy.data_ptr(), x.data_ptr(), n, c, s, mean.data_ptr(), invstd.data_ptr(),
                sums.data_ptr(), _ptr(dweight), _ptr(dbias),
            )  # fmt: skip
        elif not x.numel():  # a rank with no examples (torch's kernel divides by zero)
            dweight, dbias = torch.zeros_like(mean), torch.zeros_like(mean)
            sums.zero_()
        else:
            # eval mode reads the running statistics (mean, var); CUDA's kernel asserts that
            # save_mean and save_invstd are given all the same
            _, dweight, dbias = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, mean, var, mean, invstd, False, ctx.eps, [False, True, True]
            )
            torch.cat([dbias, dweight], out=sums)
        dx = None
        if need[0]:
            all_reduce(sums, ctx.via)
            if fast:
                dx = torch.empty_like(x)
                kernels.bn(_ELEM[x.dtype]).backward(
                    dy.data_ptr(), x.data_ptr(), n, c, s, mean.data_ptr(), invstd.data_ptr(),
                    _ptr(weight), sums.data_ptr(), ctx.m, dx.data_ptr(),
                )  # fmt: skip
            else:
                dx = _backward_torch(dy, x, weight, mean, var, invstd, sums, ctx.m, ctx.eps)
        if weight is None or not need[1]:
            dweight = None
        if weight is None or not need[2]:
            dbias = None
        return dx, dweight, dbias, None, None, None, None, None


def _stats_torch(x: torch.Tensor, stats: torch.Tensor) -> None:
    """hp_bn_stats_* in torch ops: [sum x, m (var + mean^2), m] in float64 from torch's own stable
    per-channel statistics (var = E[x^2] - E[x]^2 would cancel in fp32 when |mean| >> std)."""
    c = x.shape[1]
    m_local = x.numel() // c if c else 0
    if m_local:
        xs = x if x.dtype in (torch.float32, torch.float64) else x.float()
        mean_l, var_l = torch.batch_norm_update_stats(xs, None, None, 0.0)
        mean_d = mean_l.double()
        torch.mul(mean_d, m_local, out=stats[:c])
        torch.addcmul(var_l.double(), mean_d, mean_d, out=stats[c : 2 * c]).mul_(m_local)
    else:
        stats[: 2 * c] = 0.0
    stats[2 * c] = m_local


def _forward_torch(x, stats, m, weight, bias, running, factor, eps):
    """hp_bn_forward_* in torch ops; returns y, mean, biased variance, invstd."""
    c = x.shape[1]
    mom = stats[: 2 * c].view(2, c) / m  # E[x], E[x^2] in float64
    var64 = torch.addcmul(mom[1], mom[0], mom[0], value=-1.0).clamp_min_(0.0)
    # mean, biased variance (for normalising), unbiased variance over the global sample count
    # (for the running statistics, as for one big batch)
    mean, var, var_unbiased = torch.stack([mom[0], var64, var64 * (m / (m - 1))]).to(x.dtype)
    if running is not None:
        torch._foreach_mul_(list(running), 1 - factor)
        torch._foreach_add_(list(running), [mean, var_unbiased], alpha=factor)
    y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
    return y, mean, var, torch.rsqrt(var64 + eps).to(x.dtype)


def _backward_torch(dy, x, weight, mean, var, invstd, sums, m, eps):
    """hp_bn_backward_* in torch ops."""
    c = x.shape[1]
    scale = invstd if weight is None else invstd * weight  # d y / d x-hat, per channel
    # -(w invstd / m) * [global sum dy, global invstd * sum dy * (x - mean)]
    coef = (sums.view(2, c) * (-1.0 / m)).to(x.dtype).mul_(scale)
    dx = F.batch_norm(x, mean, var, coef[1], coef[0], False, 0.0, eps)
    return dx.addcmul_(dy, scale.view([1, c] + [1] * (x.dim() - 2)))


class GlobalStatistics:
    """What global batch norm swaps in for a batch norm's own F.batch_norm on its input
    (hybridpar.core.ops): in training, statistics over `group` (default: the world), when the
    `switch` (adaptive, Liu et al. 4.3) says global; else torch's own batch norm. The module's
    forward (its momentum, its running statistics, an activation or dropout it applies after)
    runs as written. In evaluation (`module` not training) always torch's own: a batch norm
    without running statistics normalises each rank's batch by itself, and no rank waits for
    another's evaluation."""

    def __init__(
        self,
        module: nn.Module,
        group: Group | dist.ProcessGroup | None = None,
        ledger: Ledger | None = None,
        layer: str = "",
        switch: BNSwitch | None = None,
    ) -> None:
        self.module, self.group, self.ledger, self.layer = module, group, ledger, layer
        self.switch = switch
        self._vias: tuple[object, tuple[Via, Via]] | None = None  # (group, its two Vias)

    def _group(self) -> Group | dist.ProcessGroup | None:
        if not dist.is_available() or not dist.is_initialized():
            return None
        return self.group if self.group is not None else dist.group.WORLD

    def __call__(
        self,
        x: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        training: bool = False,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> torch.Tensor:
        group = self._group()
        use = self.switch is None or self.switch.use_global
        if not (training and self.module.training and group_size(group) > 1 and use):
            return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        running = None if running_mean is None else (running_mean, running_var)
        if self._vias is None or self._vias[0] is not group:  # made once: a call costs microseconds
            made = (Via(group, self.ledger, t, self.layer) for t in (Term.BN_STATS, Term.BN_GRAD))
            self._vias = (group, tuple(made))
        vias, factor = self._vias[1], float(momentum)
        if not torch.is_autocast_enabled(x.device.type):
            return _GlobalBatchNormFn.apply(x, weight, bias, running, factor, eps, *vias)
        # under autocast the statistics and the normalisation run in float32 (the kernels read
        # bfloat16 as it is; torch's ops take it cast), and y comes back in x's dtype, as torch's
        # batch norm gives it to the next layer
        dtype = x.dtype
        if not _use_kernels(x, weight, running):
            x = x.float()
        with torch.autocast(x.device.type, enabled=False):
            y = _GlobalBatchNormFn.apply(x, weight, bias, running, factor, eps, *vias)
        return y.to(dtype)


class BandStatistics:
    """What the domain style swaps in for an instance, group or layer norm's own F.instance_norm,
    F.group_norm or F.layer_norm on a band of rows: each example's statistics (per channel, per
    group of channels, or over all of it) over every rank holding a band of it (`group`, the
    model group), by global batch norm on the band viewed as one example of N x K channels; the
    affine after (a layer norm's, over (C, H, W), cut to the band's rows: on tiles to its
    columns too, `pw`). In evaluation too (a band alone does not hold an example's statistics),
    unless an instance norm tracks running statistics: those it updates as torch does (each
    example's copy moved by its statistics, then their mean over the examples of every batch
    group: `batch`), and in evaluation it normalises each pixel by them alone."""

    def __init__(self, module: nn.Module, group: Group, ledger: Ledger | None, layer: str,
                 batch: Group | None = None, pw: int = 1):  # fmt: skip
        self.groups = getattr(module, "num_groups", None)  # None: instance norm
        self.layer_norm = hasattr(module, "normalized_shape")
        self.group, self.ledger, self.layer, self.batch, self.pw = group, ledger, layer, batch, pw

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.layer_norm:  # F.layer_norm(x, normalized_shape, weight, bias, eps)
            names = ("normalized_shape", "weight", "bias", "eps")
        elif self.groups is None:  # F.instance_norm(x, running_mean, running_var, weight, bias,
            names = ("running_mean", "running_var", "weight", "bias", "use", "momentum", "eps")
        else:  # F.group_norm(x, num_groups, weight, bias, eps)
            names = ("num_groups", "weight", "bias", "eps")
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        weight, bias, eps = given.get("weight"), given.get("bias"), given.get("eps", 1e-5)
        if not given.get("use", True):  # running statistics: each pixel by itself
            return F.instance_norm(x, *args, **kwargs)
        n, c = x.shape[:2]
        k = 1 if self.layer_norm else c if self.groups is None else self.groups
        tracked = given.get("running_mean") is not None and self.groups is None
        copies = (
            tuple(given[r].repeat(n) for r in ("running_mean", "running_var")) if tracked else None
        )
        dtype = x.dtype
        if not n:  # a batch group without examples: every rank of its model group has none
            y = x * 1.0
        else:
            with torch.autocast(x.device.type, enabled=False):
                via = Via(self.group, self.ledger, layer=self.layer)
                flat = x.float() if dtype not in (torch.float32, torch.float64) else x
                y = _GlobalBatchNormFn.apply(flat.reshape(1, n * k, -1), None, None, copies,
                                             given.get("momentum", 0.1), eps, via)  # fmt: skip
        if copies is not None:
            self._settle(copies, (given["running_mean"], given["running_var"]), n, c)
        y = y.reshape(x.shape).to(dtype)
        if weight is not None:
            y = y * self._affine(weight, x)
        if bias is not None:
            y = y + self._affine(bias, x)
        return y

    def _affine(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A per-channel weight shaped to broadcast; a layer norm's cut to this rank's band."""
        if not self.layer_norm:
            return t.view(1, x.shape[1], *[1] * (x.dim() - 2))
        held = tile(tuple(t.shape[1:]), self.group.size, self.pw, self.group.rank)
        for dim, (lo, hi) in enumerate(held if self.pw > 1 else (held,), start=1):
            t = t.narrow(dim, lo, hi - lo)
        return t

    def _settle(self, copies: tuple, running: tuple, n: int, c: int) -> None:
        """The examples' updated copies of the running statistics averaged into them, over the
        examples of every batch group (one all-reduce of their sums and counts where Pc > 1)."""
        both = torch.stack(copies).view(2, n, c)
        if self.batch is None or self.batch.size == 1:
            if n:
                running[0].copy_(both[0].mean(0))
                running[1].copy_(both[1].mean(0))
            return
        sums = torch.cat([both.sum(1).flatten().double(), both.new_full((1,), n).double()])
        all_reduce(sums, Via(self.batch, self.ledger, Term.BN_STATS, self.layer))
        means = (sums[:-1] / sums[-1]).view(2, c).to(both.dtype)
        running[0].copy_(means[0])
        running[1].copy_(means[1])


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole batch over `group` (default:
    the world). Same parameters, buffers and state_dict keys as torch's BatchNorm; eval mode
    uses the running statistics; a group of one rank (or no torch.distributed) is plain BN. Any
    other batch norm gets the same statistics in place with `convert_global_batchnorm`."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        group: Group | dist.ProcessGroup | None = None,
        ledger: Ledger | None = None,
        layer: str = "",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.statistics = GlobalStatistics(self, group, ledger, layer)

    _dims: tuple[int, ...] | None = None  # accepted input ranks; None: any with a channel dim

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or (self._dims is not None and x.dim() not in self._dims):
            want = " or ".join(f"{d}D" for d in self._dims or (2,))
            raise ValueError(f"{type(self).__name__} expects {want} input, got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.call(self, super().forward, self.statistics, x, name=self.statistics.layer)


class GlobalBatchNorm1d(GlobalBatchNorm):
    _dims = (2, 3)


class GlobalBatchNorm2d(GlobalBatchNorm):
    _dims = (4,)


@dataclass
class Plateau:
    """Convergence rule: converged when the training `signal` averaged over the last `window`
    steps improved on the window before it by less than `threshold` (relative): the training
    accuracy rising (Liu et al.: "until the training accuracy converges", sections 1 and 4.3), or
    the training loss falling."""

    window: int = 50
    threshold: float = 0.01
    signal: str = "accuracy"

    def __post_init__(self) -> None:
        if self.window < 1 or not self.threshold >= 0:
            raise ValueError("Plateau needs window >= 1 and threshold >= 0")
        if self.signal not in SIGNALS:
            raise ValueError(f"Plateau signal must be one of {SIGNALS}, got {self.signal!r}")

    def converged(self, window_means: list[float]) -> bool:
        if len(window_means) < 2:
            return False
        prev, cur = window_means[-2], window_means[-1]
        if self.signal == "loss":
            return prev <= 0 or (prev - cur) / prev < self.threshold
        return prev >= 1 or (cur - prev) / max(prev, 1e-12) < self.threshold


SIGNALS = ("accuracy", "loss")


@dataclass
class LossPlateau(Plateau):
    """Plateau of the training loss."""

    signal: str = "loss"


@dataclass
class BNSwitch:
    """The adaptive rule of Liu et al. section 4.3, shared by every AdaptiveGlobalBatchNorm of a
    model. AGBN "degrades into the original BN algorithm (1) under large-batch regime; (2) until
    the training accuracy converges" (their introduction): the global step is skipped while the
    model has not converged, and always when the batch BZ is at least `bz_max`. So statistics are
    local from the start, turn global once the training accuracy (or, by choice, the loss) stops
    improving, and stay global; with BZ >= bz_max they stay local throughout and no switch is ever
    watched for.

    BZ is the global batch, the batch "for the whole devices" as their section 5 defines it (the
    per-device batch there is BZ_mini = BZ / n); pass `bz_max` times n for a per-device threshold.

    Call `start(global_batch)` before training and `observe(loss_sum, count, correct)` after every
    step on every rank. Every `rule.window` steps the ranks all-reduce the window's sums,
    so all of them apply the rule to the same global numbers and switch at the same step (DESIGN.md
    invariant 3)."""

    bz_max: int | None = None
    rule: Plateau | None = field(default_factory=Plateau)
    group: Group | dist.ProcessGroup | None = None
    ledger: Ledger | None = None
    device: torch.device | str = "cpu"  # the model's: where the agreed window sums are reduced
    mode: str = "local"
    switched_at: int | None = None
    reason: str = ""
    steps: int = 0
    window_means: list[float] = field(default_factory=list)
    large_batch: bool = False
    _acc: list[float] = field(
        default_factory=lambda: [0.0, 0.0, 0.0, 0.0]
    )  # loss, n, steps, correct

    @property
    def use_global(self) -> bool:
        return self.mode == "global"

    @classmethod
    def of(cls, plan, options, group, ledger: Ledger | None, device) -> BNSwitch | None:
        """The plan's switch (None unless its batch norm is adaptive), with the options' rule,
        deciding over `group`, started on the plan's global batch; both engines build it so."""
        if plan.choices.bn != "adaptive":
            return None
        o = options
        rule = Plateau(o.bn_window, o.bn_threshold, o.bn_signal)
        switch = cls(o.bn_max_batch, rule, group, ledger, device)
        switch.start(plan.batch)  # BZ: the global batch (Liu et al. section 5)
        return switch

    def start(self, global_batch: int) -> None:
        if self.bz_max is not None and global_batch >= self.bz_max:
            self.large_batch = True
            self.reason = f"batch {global_batch} >= bz_max {self.bz_max}: local throughout"

    def observe(self, loss_sum: float, count: float, correct: float = 0.0) -> None:
        self.steps += 1
        if self.use_global or self.large_batch or self.rule is None:
            return
        a = self._acc
        self._acc = [a[0] + float(loss_sum), a[1] + float(count), a[2] + 1, a[3] + float(correct)]
        if self._acc[2] < self.rule.window:
            return
        sums = [self._acc[0], self._acc[1], self._acc[3]]
        t = torch.tensor(sums, dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            all_reduce(t, Via(self.group or dist.group.WORLD, self.ledger, Term.BN_SWITCH))
        self._acc = [0.0, 0.0, 0.0, 0.0]
        signal = float(t[0]) if self.rule.signal == "loss" else float(t[2])
        self.window_means.append(signal / max(float(t[1]), 1.0))
        if self.rule.converged(self.window_means):
            prev, cur = self.window_means[-2:]
            self._switch(
                f"training {self.rule.signal} converged: window mean {prev:.4g} -> {cur:.4g} "
                f"(< {self.rule.threshold:g} relative improvement over {self.rule.window} steps)"
            )

    def state(self) -> dict:
        """For a checkpoint: the decision so far and this rank's window accumulators."""
        keys = ("mode", "switched_at", "reason", "steps", "window_means", "large_batch")
        return {**{k: getattr(self, k) for k in keys}, "acc": list(self._acc)}

    def restore(self, state: dict) -> None:
        for k in ("mode", "switched_at", "reason", "steps", "window_means"):
            setattr(self, k, state[k])
        self.large_batch = bool(state.get("large_batch", False))
        self._acc = list(state["acc"]) + [0.0] * (4 - len(state["acc"]))  # older: no correct

    def _switch(self, reason: str) -> None:
        self.mode, self.switched_at, self.reason = "global", self.steps, reason

    def record(self) -> dict:
        """For the training report."""
        return {
            "mode": self.mode,
            "bz_max": self.bz_max,
            "rule": None
            if self.rule is None
            else {
                "window": self.rule.window,
                "threshold": self.rule.threshold,
                "signal": self.rule.signal,
            },
            "switched_at_step": self.switched_at,
            "reason": self.reason,
            "window_means": self.window_means,
        }


class AdaptiveGlobalBatchNorm(GlobalBatchNorm):
    """GlobalBatchNorm whose statistics are local until its `switch` turns them global (Liu et
    al. 4.3: AGBN)."""

    def __init__(self, num_features: int, *args, switch: BNSwitch | None = None, **kwargs) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.switch = switch if switch is not None else BNSwitch()
        self.statistics.switch = self.switch


def convert_global_batchnorm(
    module: nn.Module,
    group: Group | dist.ProcessGroup | None = None,
    *,
    ledger: Ledger | None = None,
    switch: BNSwitch | None = None,
    layer_of: dict[str, str] | None = None,
    prefix: str = "",
) -> nn.Module:
    """Every batch norm in `module` (itself included, any subclass of torch's: one that applies
    an activation in its own forward keeps it) takes its training statistics over `group`, or
    adaptively with a `switch`: its F.batch_norm on its input is swapped in place
    (`GlobalStatistics`; hybridpar.core.ops), its class, parameters, buffers and forward stay.
    Returns `module`, like torch's convert_sync_batchnorm. `layer_of` maps module names
    (`prefix` is the name of `module` itself) to the layer names the ledger uses. A batch norm
    over a given group of one rank is torch's own and stays so (group None: the world when it
    runs)."""
    if group is not None and group_size(group) == 1:
        return module
    for name, m in module.named_modules(prefix=prefix):
        if isinstance(m, _BatchNorm) and not isinstance(m, GlobalBatchNorm):
            layer = (layer_of or {}).get(name, name)
            m.hybridpar_statistics = GlobalStatistics(m, group, ledger, layer, switch)
            ops.install(m, m.hybridpar_statistics, name=name or "bn")
    return module
