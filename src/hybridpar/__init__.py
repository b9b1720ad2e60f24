"""hybridpar: hybrid batch / model / domain parallel training on torch.distributed.

Two halves meet in one object, the `ParallelPlan` (hybridpar.core.plan):

    hybridpar/
      core/         what both halves read: the plan, its choices, the trace, the style rules
      planning/     the planner: the alpha-beta cost model, the search, presets, the profile
      runtime/      the runtime: comm (collectives, ledger, codecs, reducers), parallel (styles,
                    engines, the trainer), train (data, the epoch loop, the `hybridpar train` job)
      commands/     the command line

What a user imports is this module's names, and the runtime's parts under their own paths
(`hybridpar.runtime.parallel`, `hybridpar.runtime.comm`); docs/architecture.md draws the layers.
"""

from __future__ import annotations

from hybridpar.core.choices import Choices
from hybridpar.core.cluster import PRESETS, Cluster, load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import CostLayer, cost_layers
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.planning.search import SCENARIOS, Plan, PlanResult, make_plan, plan_for, plan_layers
from hybridpar.runtime.options import RuntimeOptions

__version__ = "0.1.0"


def __getattr__(name: str):
    """The runtime needs torch: imported on first use, so `hybridpar plan` stays torch-free."""
    if name in ("HybridTrainer", "parallelize"):
        from hybridpar.runtime import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "SCENARIOS",
    "Choices",
    "Cluster",
    "ConfigError",
    "CostLayer",
    "HybridTrainer",
    "ParallelPlan",
    "Plan",
    "PlanResult",
    "RuntimeOptions",
    "Style",
    "cost_layers",
    "load_cluster",
    "make_plan",
    "parallelize",
    "plan_for",
    "plan_layers",
]
