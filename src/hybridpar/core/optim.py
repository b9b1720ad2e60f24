"""Krizhevsky's update rule, learning-rate schedules and batch-size scaling (Krizhevsky 2014, section 5).

    v := mu * v - lr * (g + wd * w)
    w := w + v

Unlike torch.optim.SGD (v := mu v + g + wd w; w := w - lr v) the learning rate multiplies inside
the velocity, so a schedule that changes lr does not rescale the momentum already accumulated.
"""

from __future__ import annotations

import math

import torch

from hybridpar.core.errors import ConfigError

__all__ = ["SCHEDULES", "KrizhevskySGD", "lr_factor", "scale_hparams"]

SCHEDULES = ("constant", "krizhevsky", "cosine")


class KrizhevskySGD(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float, momentum: float = 0.9, weight_decay: float = 5e-4
    ) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ConfigError("need lr > 0, 0 <= momentum < 1 and weight_decay >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """One multi-tensor update per (group, device, dtype), no per-parameter temporaries:
        v *= mu; v -= lr g; v -= lr wd w; w += v (torch's _foreach kernels, as torch.optim.SGD's
        foreach path uses)."""
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            by_kind: dict[tuple, tuple[list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "v" not in state:
                    state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                ps, gs, vs = by_kind.setdefault((p.device, p.dtype), ([], [], []))
                ps.append(p)
                gs.append(p.grad)
                vs.append(state["v"])
            for ps, gs, vs in by_kind.values():
                torch._foreach_mul_(vs, mu)
                torch._foreach_add_(vs, gs, alpha=-lr)
                if wd:
                    torch._foreach_add_(vs, ps, alpha=-lr * wd)
                torch._foreach_add_(ps, vs)


def lr_factor(schedule: str, progress: float) -> float:
    """Multiplier of the base learning rate at `progress` in [0, 1) of training."""
    if schedule == "constant":
        return 1.0
    if schedule == "krizhevsky":  # x 250^(-1/3) at 25 %, 50 % and 75 % of training
        return 250.0 ** (-sum(progress >= q for q in (0.25, 0.5, 0.75)) / 3)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    raise ConfigError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def scale_hparams(lr: float, weight_decay: float, k: float, rule: str) -> tuple[float, float]:
    """Learning rate and weight decay for a batch k times larger (Krizhevsky 2014, section 5).

    sqrt: lr' = sqrt(k) lr and wd' = (1 - (1 - lr wd)^k) / lr', which keeps the total weight decay
    of k small steps in one big one. linear: lr' = k lr, wd' = wd (the heuristic the paper used).
    """
    if rule == "none":
        return lr, weight_decay
    if rule == "linear":
        return k * lr, weight_decay
    if rule == "sqrt":
        lr2 = math.sqrt(k) * lr
        return lr2, (1 - (1 - lr * weight_decay) ** k) / lr2
    raise ConfigError(f"unknown scaling rule {rule!r}; choose none, linear or sqrt")
