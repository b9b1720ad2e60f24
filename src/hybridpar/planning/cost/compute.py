"""Per-layer compute time: FLOPs over a sustained rate, or a table measured by `hybridpar profile`.

Every style gives each process B/P samples' worth of a layer's work (batch: B/P samples of the
whole layer; model: B/Pc samples of 1/Pr of it; domain: B/Pc samples of 1/Pr of the image), so
compute time depends on B/P only; the backward pass costs twice the forward (dX and dW).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hybridpar.errors import ConfigError
from hybridpar.planning.layers import CostLayer

__all__ = ["ComputeModel", "FlopsModel", "TableModel", "load_table"]


class ComputeModel(Protocol):
    def times(self, layer: CostLayer, samples: float) -> tuple[float, float]:
        """(forward seconds, backward seconds) of `layer` for `samples` samples on one process."""


@dataclass(frozen=True)
class FlopsModel:
    flops: float  # sustained FLOP/s of one process

    def times(self, layer: CostLayer, samples: float) -> tuple[float, float]:
        fwd = layer.flops * samples / self.flops
        return fwd, 2 * fwd


@dataclass(frozen=True)
class TableModel:
    """Measured seconds per sample for each leaf layer: {name: [forward, backward]}."""

    per_sample: dict[str, tuple[float, float]]
    source: str = ""

    def times(self, layer: CostLayer, samples: float) -> tuple[float, float]:
        missing = [m for m in layer.members if m not in self.per_sample]
        if missing:
            raise ConfigError(
                f"compute table {self.source!r} has no entry for layer(s) {missing}; "
                "re-run `hybridpar profile` for this model and input size"
            )
        fwd = sum(self.per_sample[m][0] for m in layer.members)
        bwd = sum(self.per_sample[m][1] for m in layer.members)
        return fwd * samples, bwd * samples


def load_table(path: str | Path) -> TableModel:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"compute table {str(p)!r} does not exist; make one with `hybridpar profile`"
        )
    try:
        data = json.loads(p.read_text())
        table = {k: (float(v[0]), float(v[1])) for k, v in data["per_sample_s"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise ConfigError(
            f"compute table {str(p)!r} is malformed ({exc.__class__.__name__}); "
            "re-run `hybridpar profile`"
        ) from exc
    return TableModel(table, str(p))
