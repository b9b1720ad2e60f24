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
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import CostLayer, cost_layers

__all__ = ["model_layers", "zoo_cost_layers"]

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


def model_layers(
    model: str, input_size: int | None = None, input_shape: tuple[int, ...] | None = None
) -> tuple[list[CostLayer], tuple[int, ...]]:
    """(the cost layers, one example's shape) of a zoo model by name (its layers from the
    analysis cache: no torch), or of the model a user's factory `package.module:function` builds,
    traced for `input_shape`; a name, factory or shape that does not work is a ConfigError."""
    from hybridpar.core.zoo import input_shape as zoo_shape
    from hybridpar.core.zoo import is_factory, zoo_entry

    if is_factory(model):
        if input_shape is None:
            raise ConfigError(f"--model {model} needs --input-shape C,H,W (one example's shape)")
        import torch

        from hybridpar.core.analysis import analyze
        from hybridpar.core.models import build_user_model

        with torch.device("meta"):
            module = build_user_model(model)
        layers = cost_layers(analyze(module, input_shape))
        shape = tuple(input_shape)
    else:
        zoo_entry(model)  # an unknown name is named before anything else
        if input_shape is not None:
            raise ConfigError(
                "--input-shape is for --model package.module:factory; zoo models take --input-size"
            )
        layers = zoo_cost_layers(model, input_size)
        shape = zoo_shape(model, input_size)
    return layers, shape
