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
                    layer_of: dict[str, str], model: nn.Sequential, by_layer: bool = False,
                    bn: str = "local", codec: str = "none",
                    compress: frozenset[str] = frozenset()) -> dict:  # fmt: skip
    """Bytes per rank per iteration the cost model predicts, by term (or by (layer, term)).
    With bn global (or adaptive, while it is global) every batch norm adds its two all-reduces."""
    from hybridpar.planner import evaluate

    plan = evaluate(layers, P, B, _NET, runtime_strategies(layers, model, P, kind, grid),
                    codec=codec, compress=compress)  # fmt: skip
    if not plan.feasible:
        return {}
    out: dict = {}
    for x in plan.layers:
        for k, c in x.terms.items():
            if c.bytes:
                key = (x.layer.name, k) if by_layer else k
                out[key] = out.get(key, 0.0) + c.bytes
    if bn != "local":
        for key, b in _bn_bytes(model, P, kind, grid, layer_of).items():
            key = key if by_layer else key[1]
            out[key] = out.get(key, 0.0) + b
    return out


def _bn_bytes(model: nn.Sequential, P: int, kind: str, grid: tuple[int, int],
              layer_of: dict[str, str]) -> dict[tuple[str, str], float]:  # fmt: skip
    """(layer, bn_stats | bn_grad) -> bytes of the global batch norms, each over the ranks that
    split its examples: all P in the trunk, the batch group of Pc in the fully-connected tail."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from hybridpar.cost.layers import t_global_bn
    from hybridpar.models import fc_tail_start

    pr, pc = grid
    tail = fc_tail_start(model) if kind != "ddp" and pr > 1 else len(model)
    out: dict[tuple[str, str], float] = {}
    for i, (top, child) in enumerate(model.named_children()):
        for sub, m in child.named_modules():
            if not isinstance(m, _BatchNorm):
                continue
            name = f"{top}.{sub}" if sub else top
            first = i == 0 and not sub  # the input itself needs no gradient
            comms = t_global_bn(m.num_features, P if i < tail else pc, _NET, backward=not first)
            for term, c in comms.items():
                if c.bytes:
                    key = (layer_of.get(name, name), term)
                    out[key] = out.get(key, 0.0) + c.bytes
    return out


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
