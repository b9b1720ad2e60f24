"""The hand-off from the batch-parallel trunk to the model-parallel FC block (Krizhevsky 2014,
section 4; Gholami et al. Eq. 6).

Scheme (a): each worker sends its last trunk activations to the others of its model group, which
then hold the B/Pc examples of their batch group; backward, each worker keeps the rows of dX for
the examples it produced. The module takes a `scheme` so that (b) and (c) (K rounds, each round's
communication overlapped with the previous round's FC compute) slot in here without touching the
layers around it; only (a) is implemented so far.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.comm.codecs import Codec
from hybridpar.comm.collectives import gather_batch
from hybridpar.comm.ledger import Ledger
from hybridpar.errors import ConfigError

__all__ = ["HandOff"]


class HandOff(nn.Module):
    def __init__(self, group: dist.ProcessGroup | None, ledger: Ledger | None, layer: str,
                 scheme: str = "a") -> None:  # fmt: skip
        super().__init__()
        if scheme != "a":
            raise ConfigError(f"hand-off scheme {scheme!r} is not implemented yet; use 'a'")
        self.group, self.ledger, self.layer, self.scheme = group, ledger, layer, scheme
        self.pr = 1 if group is None else dist.get_world_size(group)
        self.sizes: list[int] | None = None  # rows of each model-group rank this step
        self.codec: Codec | None = None  # the activations on the wire (None: float32)

    def set_sizes(self, sizes: list[int]) -> None:
        """Rows held by each rank of this model group in the coming step (known to every rank)."""
        if len(sizes) != self.pr:
            raise ValueError(f"expected {self.pr} sizes, got {len(sizes)}")
        self.sizes = list(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes or [x.shape[0]] * self.pr
        return gather_batch(x, sizes, self.group, self.ledger, self.layer, self.codec)
