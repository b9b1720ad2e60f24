"""Presets: the named plans of `hybridpar train --preset`, each built by the planner, so presets
and plan files share one code path."""

from __future__ import annotations

import re
from dataclasses import replace

from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import ParallelPlan
from hybridpar.planning.request import SCENARIOS, PlanRequest
from hybridpar.planning.search import plan_layers

__all__ = ["PRESETS", "SEARCHED", "parse_preset", "plan_preset"]

PRESETS = (
    "auto",
    "ddp",
    "owt",
    "grid:RxC",
    "batch",
    "model",
    "same-grid",
    "fc-grid",
    "domain",
    "per-layer",
)
SEARCHED = ("auto", "same-grid", "fc-grid", "domain", "per-layer")  # chosen on a cluster


def parse_preset(
    preset: str, procs: int, check_procs: bool = True
) -> tuple[str, tuple[int, int] | None]:
    """(scenario, fixed grid or None) of a preset; scenario "all" for auto (the best of every
    scenario the runtime executes)."""
    fixed = {
        "ddp": ("batch", (1, procs)),
        "batch": ("batch", (1, procs)),
        "model": ("model", (procs, 1)),
        "owt": ("fc-grid", (procs, 1)),
    }
    if preset in fixed:
        return fixed[preset]
    if preset in SEARCHED:
        return ("all" if preset == "auto" else preset), None
    m = re.fullmatch(r"grid:(\d+)x(\d+)", preset)
    if not m:
        raise ConfigError(f"unknown preset {preset!r}; use {', '.join(PRESETS)} (e.g. grid:2x2)")
    pr, pc = int(m.group(1)), int(m.group(2))
    if check_procs and pr * pc != procs:
        raise ConfigError(
            f"grid {pr}x{pc} has {pr * pc} ranks but the job has {procs}; use Pr*Pc = {procs}"
        )
    return "fc-grid", (pr, pc)


def plan_preset(preset: str, layers: list[CostLayer], request: PlanRequest) -> ParallelPlan:
    """The ParallelPlan a preset names for `layers`, built by the planner on `request` (its
    scenarios are the preset's), so presets and plans share one code path; only what the runtime
    executes is considered."""
    P, B = request.procs, request.batch
    scenario, grid = parse_preset(preset, P)
    names = tuple(SCENARIOS) if scenario == "all" else (scenario,)
    r = plan_layers(layers, replace(request, scenarios=names))
    if grid is None:
        chosen = r.best
    else:
        chosen = next((p for p in r.candidates[scenario] if p.grid == grid), None)
        if chosen is None:
            raise ConfigError(
                f"preset {preset}: grid {grid[0]}x{grid[1]} does not fit P={P}, B={B}; "
                f"Pc must be at most the batch"
            )
    if not chosen.feasible:
        raise ConfigError(f"preset {preset} cannot run: {chosen.reason}")
    return r.export(chosen, engine="ddp" if preset == "ddp" else "hybridpar")
