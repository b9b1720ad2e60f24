"""parallelize(model, plan): the engine that runs `plan` on this rank, for either `plan.engine`.

    engine = parallelize(model, plan)                    # HybridParallel or DDPEngine
    engine = parallelize(model, plan, RuntimeOptions(bucket_mb=8), ledger=Ledger())

The plan is resolved against the model first (hybridpar.runtime.parallel.layout.resolve: every
layer's style checked by the planner's own rule), unless the caller resolved it already (`layout`:
`hybridpar train` resolves once, in the parent, and hands the answer to every rank). Every rank
must pass the same plan: their digests are compared once.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.ddp import DDPEngine
from hybridpar.runtime.parallel.engine import Engine
from hybridpar.runtime.parallel.hybrid import HybridParallel
from hybridpar.runtime.parallel.layout import Layout, resolve

__all__ = ["parallelize"]

ENGINES = {"hybridpar": HybridParallel, "ddp": DDPEngine}


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    options: RuntimeOptions | None = None,
    *,
    ledger: Ledger | None = None,
    layout: Layout | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> Engine:
    """Apply `plan` to `model` (changed in place) on this rank; returns its engine. The model's
    parameters say where it computes (the plan's device, unless auto, must agree)."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed to be initialised")
    options = options or RuntimeOptions()
    _agree(plan)
    if layout is None:
        layout = resolve(model, plan, input_shape, dist.get_world_size())
    elif layout.plan.to_dict() != plan.to_dict():
        raise ConfigError("the layout was resolved for another plan; resolve this one")
    device = _device(model, plan)
    return ENGINES[plan.engine](model, plan, layout, options, device, ledger)


def _device(model: nn.Module, plan: ParallelPlan) -> torch.device:
    """Where the model's parameters are (cuda:k, cpu): every tensor the engine makes goes there."""
    p = next(model.parameters(), None)
    where = p.device if p is not None else torch.device("cpu")
    wanted = plan.choices.device
    if wanted != "auto" and wanted != where.type:
        raise ConfigError(
            f"the plan says device {wanted} but the model's parameters are on {where.type}; "
            f"move the model (model.to('{wanted}')) or re-plan"
        )
    return where


def _agree(plan: ParallelPlan) -> None:
    """Every rank must run the same plan (DESIGN.md invariant 3): compare digests once."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    odd = [r for r, d in enumerate(every) if d != every[0]]
    if odd:
        raise ConfigError(
            f"ranks {odd} hold a different plan than rank 0; give every rank the same plan"
        )
