"""hybridpar: hybrid batch / model / domain parallel training on torch.distributed.

Two halves meet in one object, the `ParallelPlan` (hybridpar.core.plan):

    hybridpar/
      plan.py       the ParallelPlan both halves share (torch-free, JSON)
      planning/     the planner: model analysis, the alpha-beta cost model, the search, presets
      runtime/      the runtime: comm (collectives, ledger), parallel (styles, engines, the trainer),
                    train (data, the epoch loop, reports, the `hybridpar train` job)
      commands/     the command line: plan, simulate, profile, train, codecs, calibrate

What a user imports stays at the top: this module's names, and the documented paths
`hybridpar.comm`, `hybridpar.parallel` and `hybridpar.planner`, which are the runtime's and the
planner's own modules under a short name (the same module objects, not copies).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from hybridpar.core.choices import Choices
from hybridpar.core.cluster import PRESETS, Cluster, load_cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import CostLayer, cost_layers
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.planning.search import SCENARIOS, Plan, PlanResult, make_plan, plan_for, plan_layers
from hybridpar.runtime.options import RuntimeOptions

__version__ = "0.1.0"

SHORT_NAMES = {
    "hybridpar.comm": "hybridpar.runtime.comm",
    "hybridpar.parallel": "hybridpar.runtime.parallel",
    "hybridpar.planner": "hybridpar.planning.search",
    "hybridpar.hooks": "hybridpar.runtime.comm.hooks",
}
"""documented import path -> the module it names"""


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `hybridpar.comm[.x]` as the module `hybridpar.runtime.comm[.x]` itself: one module
    object under two names, so module state (the ledger's, the groups') is never duplicated."""

    @staticmethod
    def _real(name: str) -> str | None:
        for short, real in SHORT_NAMES.items():
            if name == short or name.startswith(short + "."):
                return real + name[len(short) :]
        return None

    def find_spec(self, name, path=None, target=None):
        real = self._real(name)
        return None if real is None else importlib.util.spec_from_loader(name, self)

    def __init__(self) -> None:
        self._specs: dict[int, object] = {}

    def create_module(self, spec):
        module = importlib.import_module(self._real(spec.name))
        self._specs[id(module)] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import machinery stamped the short name's spec on the module: give it its own back
        module.__spec__ = self._specs.pop(id(module), module.__spec__)


if not any(isinstance(f, _ShortNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortNames())  # before the path finder, which would load copies


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
