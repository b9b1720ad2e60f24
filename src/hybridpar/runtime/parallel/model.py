"""The model style: a weighted layer split over the Pr ranks of a model group, the 1.5D algorithm of
Gholami et al. (Eq. 8, Fig. 5), for Linear (output features) and Conv2d (output channels).

The weight's output units are split over the model group as torch.chunk splits them (ceil(units /
Pr) per rank, fewer or none on the last: DTensor's Shard(0), so checkpoints re-split onto other
grids); the Pc batch groups hold replicas of the shard and split the examples. Forward: Y_local = f(X, W_shard), then an all-gather of Y over the model group along
the unit dimension, right after the layer (the cost model's d_i is the output before pooling).
Backward: dX_partial = f'(dY_local, W_shard), all-reduced over the model group (the pair in front
of the layer); dW_shard is local and is summed over the batch group by the gradient synchroniser,
like any replicated weight.

| function       | forward                      | backward                           | term          |
| -------------- | ---------------------------- | ---------------------------------- | ------------- |
| copy_to_group  | identity                     | all-reduce dX over the model group | dx_allreduce  |
| gather (dim)   | all-gather Y's unit shards   | keep this rank's shard of dY       | allgather     |
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.errors import ConfigError
from hybridpar.planning.layers import CostLayer
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.collectives import (
    all_gather_uneven,
    all_reduce,
    chunk_sizes,
    compressed_all_reduce,
)
from hybridpar.runtime.comm.group import Group, group_rank, group_size
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.redistribute import gather
from hybridpar.runtime.parallel.styles import ParallelStyle
from hybridpar.terms import Term

__all__ = [
    "ModelParallel",
    "ModelParallelConv2d",
    "ModelParallelLinear",
    "ModelStyle",
    "copy_to_group",
]


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the group (dX of a split layer)."""

    @staticmethod
    def forward(ctx, x, group, ledger, layer, codec):
        ctx.group, ctx.ledger, ctx.layer, ctx.codec = group, ledger, layer, codec
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        layers = {ctx.layer: grad.numel()}
        if ctx.codec is not None and ctx.codec.name != "none":
            compressed_all_reduce(grad, ctx.group, ctx.codec, ctx.ledger, Term.DX_ALLREDUCE, layers)
        else:
            all_reduce(grad, ctx.group, ctx.ledger, Term.DX_ALLREDUCE, layers)
        return grad, None, None, None, None


def copy_to_group(
    x: torch.Tensor,
    group: Group | dist.ProcessGroup,
    ledger: Ledger | None,
    layer: str,
    codec: Codec | None = None,
) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group, ledger, layer, codec)


class ModelParallel(nn.Module):
    """This rank's shard of a layer whose output units (dim 0 of the weight) are split over a model
    group. Subclasses say how to compute and along which output dimension to gather."""

    codec: Codec | None = None  # activations and their gradients on the wire (None: float32)

    def __init__(
        self, units: int, group: Group | dist.ProcessGroup, ledger: Ledger | None, name: str
    ) -> None:
        super().__init__()
        pr = group_size(group)
        if pr > units:
            raise ConfigError(
                f"layer {name} has {units} output units, fewer than Pr={pr}; use a smaller Pr"
            )
        self.group, self.ledger, self.name = group, ledger, name
        self.sizes = chunk_sizes(units, pr)
        self.r = group_rank(group)
        self.start = sum(self.sizes[: self.r])

    mesh = None  # the grid's DeviceMesh ("batch", "model"), set by parallelize: for checkpoints

    def as_dtensor(self, local: torch.Tensor):
        """`local` (this rank's shard of a weight-shaped tensor: the weight, its gradient, an
        optimizer buffer) as a DTensor: Shard(0) over the model group, replicated over the batch
        group. A view, not a copy: torch.distributed.checkpoint loads into it in place."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape = (sum(self.sizes), *local.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=stride
        )

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole weight or bias."""
        return full.narrow(0, self.start, self.sizes[self.r])

    def _take(self, layer: nn.Module) -> None:
        """This rank's shards of `layer`'s weight and bias, as new parameters."""
        for name in ("weight", "bias"):
            p = getattr(layer, name)
            shard = None if p is None else self.shard(p.detach()).clone()
            setattr(self, name, None if p is None else nn.Parameter(shard, p.requires_grad))

    @torch.no_grad()
    def full(self) -> dict[str, torch.Tensor]:
        """The whole parameters, gathered over the model group (collective; every rank gets them)."""
        return {
            k: all_gather_uneven(p.detach(), self.sizes, 0, self.group, None, Term.STATE, None)
            for k, p in self.named_parameters()
        }

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    unit_dim = -1  # where the output units lie in Y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_group(x, self.group, self.ledger, self.name, self.codec)
        y = self.compute(x)
        dim = self.unit_dim % y.dim()
        return gather(
            y, self.sizes, dim, self.group, self.ledger, Term.ALLGATHER, self.name, self.codec
        )


class ModelParallelLinear(ModelParallel):
    hybridpar_kind = "linear"  # the analysis treats it as a linear layer

    def __init__(
        self,
        linear: nn.Linear,
        group: Group | dist.ProcessGroup,
        ledger: Ledger | None = None,
        name: str = "",
    ) -> None:
        super().__init__(linear.out_features, group, ledger, name or "linear")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._take(linear)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"shard={self.sizes[self.r]} rows from {self.start}, pr={len(self.sizes)}"
        )


class ModelParallelConv2d(ModelParallel):
    """Output channels split over the model group; every rank sees all input channels."""

    hybridpar_kind = "conv"
    unit_dim = 1

    def __init__(
        self,
        conv: nn.Conv2d,
        group: Group | dist.ProcessGroup,
        ledger: Ledger | None = None,
        name: str = "",
    ) -> None:
        if conv.groups != 1 or conv.padding_mode != "zeros":
            raise ConfigError(
                f"layer {name}: a grouped or non-zero-padded Conv2d cannot be split; give it batch"
            )
        super().__init__(conv.out_channels, group, ledger, name or "conv")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self._take(conv)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if not w.shape[0]:
            # an empty shard (torch.chunk gives 5 channels over 4 ranks as 2, 2, 1, 0): conv2d
            # refuses no channels, so compute one zero channel and drop it; the output stays in
            # the graph, so this rank still takes part in the dX all-reduce
            w = torch.cat([w, w.new_zeros(1, *w.shape[1:])])
            b = None if b is None else torch.cat([b, b.new_zeros(1)])
            return F.conv2d(x, w, b, self.stride, self.padding, self.dilation)[:, :0]
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, shard={self.sizes[self.r]} channels "
            f"from {self.start}, pr={len(self.sizes)}"
        )


class ModelStyle(ParallelStyle):
    """model(Pr x Pc): each weighted layer's output units split over the Pr ranks of a model group
    (this file's layers); its shard's gradients summed over the Pc ranks of its batch group."""

    kind = "model"

    def shard(self, name: str, module: nn.Module, layer: CostLayer) -> nn.Module:
        if name != layer.name:  # a layer riding along acts on the gathered output: whole
            return module
        cls = ModelParallelLinear if isinstance(module, nn.Linear) else ModelParallelConv2d
        new = cls(module, self.grid.model_group, self.ctx.ledger, layer.name)
        new.codec, new.mesh = self.ctx.activation_codec, self.grid.mesh
        new.train(module.training)
        return new
