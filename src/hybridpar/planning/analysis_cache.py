"""Cost-model layers of zoo models, cached on disk so that `hybridpar plan` answers without
importing torch (the import alone takes about a second).

The cache key holds the model name, the input size, the package version and a hash of the files
the analysis reads (models.py, analysis.py, ops.py, ...), so editing one invalidates it. Set
HYBRIDPAR_CACHE to move the cache, or HYBRIDPAR_NO_CACHE=1 to bypass it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

from hybridpar.core.cluster import cache_dir, cache_write
from hybridpar.core.layers import CostLayer, cost_layers

__all__ = ["zoo_cost_layers"]

_PACKAGE = Path(__file__).parent.parent


def _key(model: str, input_size: int | None) -> str:
    h = hashlib.sha256()
    for f in (
        "core/zoo.py",
        "core/models.py",
        "core/analysis.py",
        "core/bands.py",
        "core/leaves.py",
        "core/live.py",
        "core/halo.py",
        "core/ops.py",
        "core/operations.py",
        "core/rows.py",
        "core/layers.py",
        "core/plan.py",
    ):
        h.update((_PACKAGE / f).read_bytes())
    return f"{model}-{input_size or 'default'}-{h.hexdigest()[:16]}"


def _analyse(model: str, input_size: int | None) -> list[CostLayer]:
    import torch

    from hybridpar.core.analysis import analyze
    from hybridpar.core.models import build_model, input_shape

    with torch.device("meta"):
        m = build_model(model, input_size=input_size)
    return cost_layers(analyze(m, input_shape(model, input_size)))


def zoo_cost_layers(model: str, input_size: int | None = None) -> list[CostLayer]:
    """An unknown name never has a cache entry: the analysis then raises the one-line error."""
    if os.environ.get("HYBRIDPAR_NO_CACHE"):
        return _analyse(model, input_size)
    path = cache_dir() / "analysis" / f"{_key(model, input_size)}.json"
    if path.is_file():
        try:
            rows = json.loads(path.read_text())
            return [CostLayer.from_dict(r) for r in rows]
        except (json.JSONDecodeError, TypeError):
            pass  # a damaged cache entry is rebuilt below
    layers = _analyse(model, input_size)
    with contextlib.suppress(OSError):  # a read-only home only costs the speed-up
        cache_write(path, [dataclasses.asdict(x) for x in layers], indent=None)
    return layers
