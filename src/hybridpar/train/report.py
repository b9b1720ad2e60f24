"""The training report: what the run predicted and measured, as JSON and a PNG of the curves.

This is where the two halves meet: `predicted_bytes` asks the cost model for the exact chain of
strategies the runtime executed, so the report puts the ledger's measured bytes next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from hybridpar.cluster import Cluster
from hybridpar.cost.layers import CostLayer, Strategy

__all__ = ["predicted_bytes", "runtime_strategies", "write_report"]

_NET = Cluster("bytes-only", alpha=0.0, beta=1e-9, flops=1.0)  # only the volume terms are used


def runtime_strategies(layers: list[CostLayer], model: nn.Sequential, P: int, kind: str,
                       grid: tuple[int, int]) -> list[Strategy]:  # fmt: skip
    """The strategy of every cost layer as the runtime lays it out: the trunk pure batch over P,
    the fully-connected tail on the Pr x Pc grid."""
    from hybridpar.models import fc_tail_start

    pr, pc = grid
    if kind == "ddp" or pr == 1:
        return [Strategy.batch(P)] * len(layers)
    tail = fc_tail_start(model)
    return [
        Strategy.model(pr, pc) if int(x.name.split(".")[0]) >= tail else Strategy.batch(P)
        for x in layers
    ]


def predicted_bytes(layers: list[CostLayer], P: int, B: int, kind: str, grid: tuple[int, int],
                    layer_of: dict[str, str], model: nn.Sequential, by_layer: bool = False) -> dict:  # fmt: skip
    """Bytes per rank per iteration the cost model predicts, by term (or by (layer, term))."""
    from hybridpar.planner import evaluate

    plan = evaluate(layers, P, B, _NET, runtime_strategies(layers, model, P, kind, grid))
    if not plan.feasible:
        return {}
    if by_layer:
        return {
            (x.layer.name, k): c.bytes for x in plan.layers for k, c in x.terms.items() if c.bytes
        }
    return {k: v for k, v in plan.bytes_by_term().items() if v}


def write_report(report: dict, path: str | Path) -> tuple[Path, Path | None]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    png = path.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path, None
    ep = report["epochs"]
    xs = [e["epoch"] for e in ep]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(xs, [e["loss"] for e in ep], marker="o", ms=3)
    a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    a.set_yscale("log")
    b.plot(xs, [e["train_acc"] for e in ep], marker="o", ms=3, label="train")
    b.plot(xs, [e["test_acc"] for e in ep], marker="s", ms=3, label="test")
    b.set_xlabel("epoch")
    b.set_ylabel("accuracy")
    b.legend()
    grid = report.get("grid")
    fig.suptitle(f"{report.get('model')} on {report.get('data')}: P={report['procs']}, "
                 f"{report['strategy']} grid {grid[0]}x{grid[1]}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return path, png
