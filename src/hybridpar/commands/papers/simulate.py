"""`hybridpar simulate`: sweep P, write a CSV of every candidate and PNG bar charts in the style of
Gholami et al. Figs. 6, 7 and 10 (communication + computation per grid, the best bar labelled
with its speedup over pure batch: total, and communication in parentheses)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybridpar.commands.papers import write_rows
from hybridpar.planning.search import PlanResult

__all__ = ["FIGURES", "plot_sweep", "write_csv"]

# figure file -> (scenario whose candidates are drawn, title)
FIGURES = {
    "fig6_same_grid.png": ("same-grid", "same grid for all layers (Fig. 6)"),
    "fig7_fc_grid.png": ("fc-grid", "conv layers batch, FC layers on the grid (Fig. 7)"),
    "fig10_domain.png": ("domain", "domain-parallel conv layers on the grid (Fig. 10)"),
}


def write_csv(results: list[PlanResult], path: Path) -> None:
    rows = []
    for r in results:
        for name, plans in r.candidates.items():
            chosen = r.scenario(name)
            for p in plans:
                pr, pc = p.grid if p.grid else ("", "")
                row = {"procs": r.procs, "batch": r.batch, "scenario": name, "pr": pr, "pc": pc}
                row["feasible"] = p.feasible
                for k in ("comm_s", "compute_s", "total_s"):
                    row[k] = f"{getattr(p, k):.9g}" if p.feasible else ""
                row.update(best_of_scenario=p is chosen, best_overall=p is r.best, reason=p.reason)
                rows.append(row)
    write_rows(path, rows)


def plot_sweep(
    results: list[PlanResult], out: Path, scenario: str, title: str, filename: str
) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(r, [p for p in r.candidates.get(scenario, []) if p.feasible]) for r in results]
    panels = [(r, ps) for r, ps in panels if ps]
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (r, plans) in zip(axes.flat, panels, strict=False):
        batch = r.scenario("batch")
        labels = [f"{p.grid[0]}x{p.grid[1]}" for p in plans]
        comm = [p.exposed_comm_s for p in plans]
        comp = [p.compute_s for p in plans]
        xs = range(len(plans))
        ax.bar(xs, comp, color="#4c72b0", label="computation")
        ax.bar(xs, comm, bottom=comp, color="#dd8452", label="communication")
        best_i = min(range(len(plans)), key=lambda i: plans[i].total_s)
        if batch is not None and batch.feasible:
            b = plans[best_i]
            ax.text(
                best_i,
                b.total_s * 1.02,
                f"{batch.total_s / b.total_s:.1f}x\n({batch.comm_s / max(b.comm_s, 1e-30):.1f}x)",
                ha="center",
                va="bottom",
                fontsize=8,
                fontweight="bold",
            )
        ax.set_xticks(list(xs), labels, rotation=60, fontsize=7)
        ax.set_title(f"P={r.procs}, B={r.batch}", fontsize=9)
        ax.set_ylabel("seconds / iteration", fontsize=8)
        ax.margins(y=0.2)
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{results[0].model} on {results[0].cluster.name}: {title}", fontsize=10)
    fig.tight_layout()
    path = out / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sweep(
    procs: list[int], make: Callable[[int], PlanResult], progress: bool = True
) -> list[PlanResult]:
    from tqdm import tqdm

    return [make(p) for p in tqdm(procs, desc="simulate", unit="P", disable=not progress)]
