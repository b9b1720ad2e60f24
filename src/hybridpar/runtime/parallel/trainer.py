"""HybridTrainer: the per-step contract of a hybrid-parallel model in one object.

A HybridParallel model asks for four things each step, in order: the global batch size
(`set_batch`), this rank's rows in (`input_rows`) and out (`output_rows`), a loss summed over the
rows and divided by the global batch (every gradient is then a plain sum over ranks), and the wait
for the gradient sums (`finish_backward`) before the optimizer step. `HybridTrainer.step(x, y)`
does exactly that, so none of it can be forgotten or done in the wrong order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from hybridpar.plan import ParallelPlan, Term
from hybridpar.runtime.comm.collectives import all_gather_uneven, all_reduce
from hybridpar.runtime.comm.grid import rows_of_group
from hybridpar.runtime.parallel.api import HybridParallel, parallelize

__all__ = ["HybridTrainer"]


class HybridTrainer:
    """Train `model` with `plan`: every rank calls `step(x, y)` with the same global batch.

    optimizer: a function of the parameters, e.g. `lambda ps: torch.optim.SGD(ps, lr=0.01)`
    (the model's parameters are this rank's shards, known only after parallelize).
    loss: a torch.nn.functional-style loss that takes `reduction="sum"`.
    The remaining keyword arguments go to `parallelize`."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        loss: Callable[..., torch.Tensor] = F.cross_entropy,
        **kwargs,
    ) -> None:
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer: pass a function of the parameters, e.g. "
                "lambda params: torch.optim.SGD(params, lr=0.01)"
            )
        self.model: HybridParallel = parallelize(model, plan, **kwargs)
        self.optimizer = optimizer(self.model.parameters())
        self.loss = loss

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch (x, y); returns its mean loss (one small
        all-reduce of the loss sums over the ranks that hold different examples)."""
        n = len(x)
        if len(y) != n:
            raise ValueError(f"x has {n} examples but y has {len(y)}")
        m = self.model
        m.train()
        m.set_batch(n)
        out = m(x[m.input_rows(n)])
        loss_sum = self.loss(out, y[m.output_rows(n)], reduction="sum")
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum / n).backward()
        m.finish_backward()
        self.optimizer.step()
        total = loss_sum.detach().reshape(1).double()
        grid = m.output_grid
        all_reduce(total, grid.batch_group, m.ledger, Term.METRICS)
        return float(total) / n

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The model's outputs for the global batch x, on every rank (evaluation mode)."""
        m = self.model
        m.eval()
        n = len(x)
        m.set_batch(n)
        out = m(x[m.input_rows(n)])
        grid = m.output_grid
        sizes = [rows_of_group(m.rows.sizes, grid.pr, c) for c in range(grid.pc)]
        return all_gather_uneven(out, sizes, 0, grid.batch_group, None, Term.METRICS, None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict, shards gathered (every rank calls it)."""
        return self.model.full_state_dict()
