"""ModelParallelLinear: the 1.5D fully-connected layer of Gholami et al. (Eq. 8, Fig. 5).

The weight's rows (output features) are split over the Pr ranks of the model group, uneven when
Pr does not divide out_features (the first out % Pr ranks get one row more); the Pc batch groups
hold replicas of the shard and split the examples. Forward: Y_local = X W_shard^T + b_shard, then an
all-gather of Y over the model group. Backward: dX_partial = dY_local W_shard, all-reduced over the
model group (the identity-forward / all-reduce-backward pair in front of the matmul); dW_shard is
local and is summed over the batch group by the gradient synchroniser, like any replicated weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.comm.codecs import Codec
from hybridpar.comm.collectives import all_gather_uneven, copy_to_group, even_split, gather_features
from hybridpar.comm.ledger import Ledger
from hybridpar.errors import ConfigError

__all__ = ["ModelParallelLinear"]


class ModelParallelLinear(nn.Module):
    hybridpar_kind = "linear"  # the analysis treats it as a linear layer

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup | None,
                 bias: bool = True, ledger: Ledger | None = None, name: str = "",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        pr = 1 if group is None else dist.get_world_size(group)
        if pr > out_features:
            raise ConfigError(
                f"layer {name or 'linear'} has {out_features} outputs, fewer than Pr={pr}; use a smaller Pr"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.ledger, self.name = group, ledger, name
        self.sizes = even_split(out_features, pr)
        self.r = 0 if pr == 1 else dist.get_rank(group)
        self.start = sum(self.sizes[: self.r])
        rows = self.sizes[self.r]
        self.weight = nn.Parameter(torch.empty(rows, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None, ledger: Ledger | None = None,
                    name: str = "") -> ModelParallelLinear:  # fmt: skip
        """This rank's shard of an existing nn.Linear (weights copied)."""
        m = cls(linear.in_features, linear.out_features, group=group, bias=linear.bias is not None,
                ledger=ledger, name=name, device=linear.weight.device, dtype=linear.weight.dtype)  # fmt: skip
        m.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return m

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        rows = slice(self.start, self.start + self.sizes[self.r])
        self.weight.copy_(weight[rows])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[rows])

    @torch.no_grad()
    def full(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole weight and bias, gathered over the model group (every rank gets them)."""
        if len(self.sizes) == 1:
            return (
                self.weight.detach().clone(),
                None if self.bias is None else self.bias.detach().clone(),
            )
        w = all_gather_uneven(self.weight.detach(), self.sizes, 0, self.group, None, "state", None)
        b = None
        if self.bias is not None:
            b = all_gather_uneven(
                self.bias.detach(), self.sizes, 0, self.group, None, "state", None
            )
        return w, b

    codec: Codec | None = None  # activations and their gradients on the wire (None: float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_group(x, self.group, self.ledger, self.name, self.codec)
        y = F.linear(x, self.weight, self.bias)
        return gather_features(y, self.sizes, self.group, self.ledger, self.name, self.codec)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"shard={self.sizes[self.r]} rows from {self.start}, pr={len(self.sizes)}")  # fmt: skip
