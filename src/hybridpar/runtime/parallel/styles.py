"""Styles that apply themselves: the runtime half of each style kind, the shape of torch's
`ParallelStyle`.

The plan's `Style` (hybridpar.core.plan) is a torch-free description: a kind and a grid. Whether a
layer can take it is the kind's torch-free rule (hybridpar.core.rules.why_not), which the
planner and `resolve` both call. The runtime looks the kind up (kinds.py) and gets a
`ParallelStyle`, which knows the rest of what every consumer of a style asks:

| method / property | answers                                                                    |
| ----------------- | -------------------------------------------------------------------------- |
| `shard`           | this rank's module for a layer of the style (the layer itself: replicated)  |
| `grad_group`      | the ranks whose gradients of a parameter of the style are summed           |
| `bn_group`        | the ranks whose examples a batch norm in the style's layout normalises over |
| `replicated`      | whether the ranks of a model group compute the same activations (so they   |
|                   | must draw the same dropout masks)                                           |

Where two consecutive segments' layouts differ, the move between them is
`hybridpar.runtime.parallel.redistribute.move` (a registry keyed by the two layouts' kinds).

One file per kind holds its class (batch.py, model.py; domain/, a package of one concern a file), and
kinds.py lists them. docs/runtime.md, "How to add a style", walks through a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from hybridpar.core.choices import Choices
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.grid import GridSet, ProcessGrid
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.redistribute import StepRows

__all__ = ["BuildContext", "ParallelStyle"]


@dataclass
class BuildContext:
    """What applying a plan on this rank shares between its styles."""

    grids: GridSet
    choices: Choices
    options: RuntimeOptions
    ledger: Ledger | None
    rows: StepRows = field(default_factory=StepRows)
    codec: Codec | None = None
    """the plan's codec (None: float32 on the wire)"""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """where the model's parameters are: what the runtime makes goes there"""

    @property
    def activation_codec(self) -> Codec | None:
        """The codec of activations and their gradients, where the plan encodes them."""
        return self.codec if self.choices.activations_encoded else None


class ParallelStyle:
    """The runtime of one style kind on this rank (subclasses register themselves by `kind`)."""

    kind: ClassVar[str] = ""

    def __init__(self, spec: Style, ctx: BuildContext) -> None:
        self.spec, self.ctx = spec, ctx

    @property
    def grid(self) -> ProcessGrid:
        return self.ctx.grids.grid(self.spec.pc)

    def shard(self, name: str, module: nn.Module, layer: CostLayer) -> nn.Module:
        """This rank's module for `name`, a member of `layer` (the weighted layer or one riding
        along with it: CostLayer.members); the module itself where the style leaves it whole."""
        return module

    def site(self, name: str, owner: nn.Module, layer: CostLayer) -> None:
        """Set up the call `name` (core.ops.site_name) of a function in `owner`'s own forward,
        a member of `layer`; nothing where the style runs it as written."""

    @property
    def grad_group(self) -> Group:
        """The ranks that hold the same copy of a parameter of this style: its batch group."""
        return self.grid.batch_group

    @property
    def grad_key(self) -> tuple:
        """Parameters with the same key are summed over the same group (one reducer state)."""
        return ("batch", self.spec.pc)

    def bn_group(self) -> Group:
        """The group a global batch norm in this layout takes its statistics over: the ranks that
        split its examples (collective on first use: a twin of the batch group, so statistics
        never queue behind gradient buckets)."""
        return self.ctx.grids.twin_group(self.spec.pc, "bn", shm=True)

    @property
    def replicated(self) -> bool:
        """Whether the ranks of a model group compute the same activations in this layout."""
        return self.spec.pr > 1

    @property
    def random_key(self) -> int:
        """Dropout stream key: replicas of the same activations share it (the batch group
        index), other ranks differ (their rank)."""
        return self.grid.c if self.replicated else 1_000 + self.grid.rank
