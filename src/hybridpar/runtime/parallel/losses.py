"""What a loss is divided by: the trainer sums a loss over the outputs each rank holds (examples,
or the bands of a dense prediction's images) and divides by what torch's `reduction="mean"`
divides by on the whole global batch, so the gradient summed over the ranks is the mean's.

| loss (a torch.nn.functional loss, or a functools.partial of one) | divided by                   |
| ----------------------------------------------------------------- | ---------------------------- |
| cross_entropy, nll_loss with class indices                        | the targets not ignored      |
|   ... with `weight`                                               | the summed weights of those  |
| cross_entropy with class probabilities                            | the targets (N x H x W)      |
| mse, l1, smooth L1, Huber, binary cross-entropy                   | the elements                 |
| any other function                                                | the examples (N)             |

Each rank reads the global batch's targets, so the divisor needs no collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F

__all__ = ["counted", "divisor"]

_PER_TARGET = (F.cross_entropy, F.nll_loss)
_PER_ELEMENT = (
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
)


def _parts(loss: Callable) -> tuple[Callable, dict]:
    """The function under any functools.partial, and the keywords given to it."""
    kwargs: dict = {}
    while isinstance(loss, functools.partial):
        kwargs = {**loss.keywords, **kwargs}
        loss = loss.func
    return loss, kwargs


def _kept(y: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return y != kwargs.get("ignore_index", -100)


def divisor(loss: Callable, y: torch.Tensor) -> torch.Tensor:
    """What `loss` with reduction="mean" divides its sum by over the targets `y` (a float64
    scalar on y's device)."""
    func, kwargs = _parts(loss)
    if func in _PER_TARGET and not y.is_floating_point():
        kept = _kept(y, kwargs)
        weight = kwargs.get("weight")
        if weight is None:
            return kept.sum().double()
        return weight.to(y.device, torch.float64)[y[kept]].sum()
    if func in _PER_TARGET:
        return torch.tensor(y.numel() // y.shape[1], dtype=torch.float64, device=y.device)
    n = y.numel() if func in _PER_ELEMENT else len(y)
    return torch.tensor(n, dtype=torch.float64, device=y.device)


def counted(loss: Callable, target: torch.Tensor) -> int:
    """How many targets of `target` the metrics count: the class labels not ignored (a pixel
    each in a dense prediction), else the examples."""
    func, kwargs = _parts(loss)
    if func in _PER_TARGET and not target.is_floating_point():
        return int(_kept(target, kwargs).sum())
    return len(target)
