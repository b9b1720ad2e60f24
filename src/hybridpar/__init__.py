"""hybridpar: hybrid batch / model / domain parallel training on torch.distributed.

Two halves that agree: the planner (`hybridpar.planner`, pure arithmetic over the alpha-beta cost
model in `hybridpar.cost`) and the runtime that executes a plan and measures it.
"""

from hybridpar.cluster import PRESETS, Cluster, load_cluster
from hybridpar.cost.layers import CostLayer, cost_layers
from hybridpar.errors import ConfigError
from hybridpar.plan import ParallelPlan, Style
from hybridpar.planner import SCENARIOS, Plan, PlanResult, make_plan, plan

__version__ = "0.1.0"


def __getattr__(name: str):
    """HybridTrainer needs torch: imported on first use, so `hybridpar plan` stays torch-free."""
    if name == "HybridTrainer":
        from hybridpar.parallel.trainer import HybridTrainer

        return HybridTrainer
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "SCENARIOS",
    "Cluster",
    "ConfigError",
    "CostLayer",
    "HybridTrainer",
    "ParallelPlan",
    "Plan",
    "PlanResult",
    "Style",
    "cost_layers",
    "load_cluster",
    "make_plan",
    "plan",
]
