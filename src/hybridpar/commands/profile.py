"""`hybridpar profile`: measure forward and backward seconds per sample of every leaf layer of a zoo
model on this machine, and save them as a compute table the planner can use (`--compute PATH`).

Forward time is taken between a forward pre-hook and a forward hook, backward time between a full
backward pre-hook and a full backward hook; the median over repeats is kept.
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

__all__ = ["profile_model"]


def profile_model(
    model_name: str,
    batch: int = 16,
    input_size: int | None = None,
    repeats: int = 5,
    warmup: int = 1,
    progress: bool = True,
) -> dict:
    import torch
    from tqdm import tqdm

    from hybridpar.core.models import build_model, input_shape
    from hybridpar.planning.profile import hook_timers, no_inplace

    torch.manual_seed(0)
    model = build_model(model_name, input_size=input_size)
    no_inplace(model)
    fwd, bwd, handles = hook_timers(model)
    x = torch.randn(batch, *input_shape(model_name, input_size), requires_grad=True)
    try:
        for it in tqdm(range(warmup + repeats), desc=f"profile {model_name}", disable=not progress):
            if it == warmup:
                for v in (*fwd.values(), *bwd.values()):
                    v.clear()
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
    per_sample = {
        n: [statistics.median(fwd[n]) / batch, statistics.median(bwd[n]) / batch if bwd[n] else 0.0]
        for n in fwd
        if fwd[n]
    }
    return {
        "model": model_name,
        "input_size": input_size,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "machine": platform.node(),
        "per_sample_s": per_sample,
    }


def save(table: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return path
