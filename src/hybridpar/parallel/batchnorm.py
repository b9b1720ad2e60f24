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
computes its own mean and variance with torch's stable `var_mean`, turns them into the sums
m_i*mu_i and m_i*(var_i + mu_i^2) in float64, and the reduction and the subtraction happen in
float64. The relative error of the variance is then about 1e-16 * (mean/std)^2 instead of 1e-7 *
(mean/std)^2: a channel with mean 1e4 and std 1 comes out right to about 1e-8 (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpar.comm.collectives import all_reduce, group_size
from hybridpar.comm.ledger import Ledger
from hybridpar.plan import Term

__all__ = [
    "AdaptiveGlobalBatchNorm",
    "BNSwitch",
    "GlobalBatchNorm",
    "GlobalBatchNorm1d",
    "GlobalBatchNorm2d",
    "LossPlateau",
    "convert_global_batchnorm",
]


class _GlobalBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, group, ledger, layer):
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        m_local = x.numel() // c if c else 0
        stats = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)
        if m_local:
            var_l, mean_l = torch.var_mean(x.float(), dim=dims, correction=0)
            mean_l = mean_l.double()
            stats[:c] = m_local * mean_l
            stats[c : 2 * c] = m_local * (var_l.double() + mean_l * mean_l)
        stats[2 * c] = m_local
        all_reduce(stats, group, ledger, Term.BN_STATS, {layer: stats.numel()} if layer else None)
        m = float(stats[2 * c])
        if m <= 1:
            raise ValueError(
                f"GlobalBatchNorm needs more than 1 value per channel over the group, got {int(m)}"
            )
        mean64 = stats[:c] / m
        var64 = (stats[c : 2 * c] / m - mean64 * mean64).clamp_min(0.0)
        # the running variance is unbiased over the global sample count, as for one big batch
        mean, var_unbiased = mean64.to(x.dtype), (var64 * (m / (m - 1))).to(x.dtype)
        invstd = torch.rsqrt(var64 + eps).to(x.dtype)
        # the normalisation itself in one fused pass: torch's batch norm in eval mode, with the
        # global statistics given as its running ones
        y = F.batch_norm(x, mean, var64.to(x.dtype), weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.m, ctx.group, ctx.ledger, ctx.layer = m, group, ledger, layer
        ctx.mark_non_differentiable(mean, var_unbiased)
        return y, mean, var_unbiased

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        xmu = x - mean.view(shape)
        sums = torch.cat([dy.sum(dims), (dy * xmu).sum(dims)]).double()
        dweight = dbias = None
        if weight is not None:  # this rank's share; the gradient synchroniser sums them
            dweight = (sums[c:].to(x.dtype) * invstd) if ctx.needs_input_grad[1] else None
            dbias = sums[:c].to(x.dtype) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            layers = {ctx.layer: sums.numel()} if ctx.layer else None
            all_reduce(sums, ctx.group, ctx.ledger, Term.BN_GRAD, layers)
            mean_dy = (sums[:c] / ctx.m).to(x.dtype).view(shape)
            mean_dy_xmu = (sums[c:] / ctx.m).to(x.dtype).view(shape)
            istd = invstd.view(shape)
            dx = (dy - mean_dy - xmu * istd * istd * mean_dy_xmu) * istd
            if weight is not None:
                dx = dx * weight.view(shape)
        return dx, dweight, dbias, None, None, None, None


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole batch over `group` (default:
    the world). Same parameters, buffers and state_dict keys as torch's BatchNorm; eval mode
    uses the running statistics; a group of one rank (or no torch.distributed) is plain BN."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        ledger: Ledger | None = None,
        layer: str = "",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.group, self.ledger, self.layer = group, ledger, layer

    _dims: tuple[int, ...] | None = None  # accepted input ranks; None: any with a channel dim

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or (self._dims is not None and x.dim() not in self._dims):
            want = " or ".join(f"{d}D" for d in self._dims or (2,))
            raise ValueError(f"{type(self).__name__} expects {want} input, got {x.dim()}D")

    def _group(self) -> dist.ProcessGroup | None:
        if not dist.is_available() or not dist.is_initialized():
            return None
        return self.group if self.group is not None else dist.group.WORLD

    def _momentum_factor(self) -> float:
        """torch BatchNorm's update weight: momentum, or a cumulative average when it is None."""
        if not (self.training and self.track_running_stats):
            return 0.0
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def use_global(self) -> bool:
        """Whether this forward normalises over the group (the adaptive variant overrides it)."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        group = self._group()
        batch_stats = self.training or self.running_mean is None
        if not (batch_stats and self.training and group_size(group) > 1 and self.use_global()):
            return self._local(x)
        factor = self._momentum_factor()
        if torch.is_autocast_enabled(x.device.type):
            # autocast runs batch norm in float32 (torch's policy for F.batch_norm): the same here
            x = x.float()
        with torch.autocast(x.device.type, enabled=False):
            y, mean, var = _GlobalBatchNormFn.apply(
                x, self.weight, self.bias, self.eps, group, self.ledger, self.layer
            )
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        return y

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """torch BatchNorm's forward (what the module would do without the group)."""
        factor = self._momentum_factor()
        batch_stats = self.training or self.running_mean is None
        return F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            batch_stats,
            factor,
            self.eps,
        )


class GlobalBatchNorm1d(GlobalBatchNorm):
    _dims = (2, 3)


class GlobalBatchNorm2d(GlobalBatchNorm):
    _dims = (4,)


@dataclass
class LossPlateau:
    """Convergence rule: converged when the mean training loss over the last `window` steps
    improved on the window before it by less than `threshold` (relative)."""

    window: int = 50
    threshold: float = 0.01

    def __post_init__(self) -> None:
        if self.window < 1 or not self.threshold >= 0:
            raise ValueError("LossPlateau needs window >= 1 and threshold >= 0")

    def converged(self, window_means: list[float]) -> bool:
        if len(window_means) < 2:
            return False
        prev, cur = window_means[-2], window_means[-1]
        return prev <= 0 or (prev - cur) / prev < self.threshold


@dataclass
class BNSwitch:
    """The adaptive rule of Liu et al. section 4.3, shared by every AdaptiveGlobalBatchNorm of a
    model. AGBN "degrades into the original BN algorithm (1) under large-batch regime; (2) until
    the training accuracy converges" (their introduction): the global step is skipped while the
    model has not converged, and always when the batch BZ is at least `bz_max`. So statistics are
    local from the start, turn global once the training loss stops improving, and stay global; with
    BZ >= bz_max they stay local throughout and no switch is ever watched for.

    BZ is the global batch, the batch "for the whole devices" as their section 5 defines it (the
    per-device batch there is BZ_mini = BZ / n); pass `bz_max` times n for a per-device threshold.

    Call `start(global_batch)` before training and `observe(loss_sum, count)` after every step
    on every rank. Every `rule.window` steps the ranks all-reduce the window's loss sum and count,
    so all of them apply the rule to the same global numbers and switch at the same step (DESIGN.md
    invariant 3)."""

    bz_max: int | None = None
    rule: LossPlateau | None = field(default_factory=LossPlateau)
    group: dist.ProcessGroup | None = None
    ledger: Ledger | None = None
    device: str = "cpu"  # where the agreed window sums are reduced (cuda under NCCL)
    mode: str = "local"
    switched_at: int | None = None
    reason: str = ""
    steps: int = 0
    window_means: list[float] = field(default_factory=list)
    large_batch: bool = False
    _acc: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    @property
    def use_global(self) -> bool:
        return self.mode == "global"

    def start(self, global_batch: int) -> None:
        if self.bz_max is not None and global_batch >= self.bz_max:
            self.large_batch = True
            self.reason = f"batch {global_batch} >= bz_max {self.bz_max}: local throughout"

    def observe(self, loss_sum: float, count: float) -> None:
        self.steps += 1
        if self.use_global or self.large_batch or self.rule is None:
            return
        self._acc = [self._acc[0] + float(loss_sum), self._acc[1] + float(count), self._acc[2] + 1]
        if self._acc[2] < self.rule.window:
            return
        t = torch.tensor(self._acc[:2], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            all_reduce(t, self.group or dist.group.WORLD, self.ledger, Term.BN_SWITCH)
        self._acc = [0.0, 0.0, 0.0]
        self.window_means.append(float(t[0]) / max(float(t[1]), 1.0))
        if self.rule.converged(self.window_means):
            prev, cur = self.window_means[-2:]
            self._switch(
                f"training loss converged: window mean {prev:.4g} -> {cur:.4g} "
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
        self._acc = list(state["acc"])

    def _switch(self, reason: str) -> None:
        self.mode, self.switched_at, self.reason = "global", self.steps, reason

    def record(self) -> dict:
        """For the training report."""
        return {
            "mode": self.mode,
            "bz_max": self.bz_max,
            "rule": None
            if self.rule is None
            else {"window": self.rule.window, "threshold": self.rule.threshold},
            "switched_at_step": self.switched_at,
            "reason": self.reason,
            "window_losses": self.window_means,
        }


class AdaptiveGlobalBatchNorm(GlobalBatchNorm):
    """GlobalBatchNorm whose statistics are local until its `switch` turns them global (Liu et
    al. 4.3: AGBN)."""

    def __init__(self, num_features: int, *args, switch: BNSwitch | None = None, **kwargs) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.switch = switch if switch is not None else BNSwitch()

    def use_global(self) -> bool:
        return self.switch.use_global


def convert_global_batchnorm(
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    ledger: Ledger | None = None,
    switch: BNSwitch | None = None,
    layer_of: dict[str, str] | None = None,
    prefix: str = "",
) -> nn.Module:
    """Replace every BatchNorm in `module` (recursively) by a GlobalBatchNorm over `group`, or by an
    AdaptiveGlobalBatchNorm when a `switch` is given, copying parameters, running statistics and
    the training flag; like torch's convert_sync_batchnorm, children are replaced in place and the
    converted module is returned. `layer_of` maps module names (`prefix` is the name of `module`
    itself) to the layer names the ledger uses."""
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, GlobalBatchNorm):
        kw = {"group": group, "ledger": ledger, "layer": (layer_of or {}).get(prefix, prefix)}
        cls = GlobalBatchNorm
        if switch is not None:
            cls, kw["switch"] = AdaptiveGlobalBatchNorm, switch
        p = next(iter(module.parameters()), None)
        ref = p if p is not None else module.running_mean
        out = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device=ref.device if ref is not None else None,
            dtype=ref.dtype if ref is not None else None,
            **kw,
        )
        out._dims = _DIMS.get(type(module))
        with torch.no_grad():
            if module.affine:
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
                out.weight.requires_grad_(module.weight.requires_grad)
                out.bias.requires_grad_(module.bias.requires_grad)
            if module.track_running_stats:
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
                out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.train(module.training)
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        new = convert_global_batchnorm(
            child, group, ledger=ledger, switch=switch, layer_of=layer_of, prefix=full
        )
        if new is not child:
            out.add_module(name, new)
    return out


_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}
