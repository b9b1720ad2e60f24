"""The model style: a weighted layer split over the Pr ranks of a model group, the 1.5D algorithm of
Gholami et al. (Eq. 8, Fig. 5), for Linear (output features) and Conv2d (output channels).

The weight's output units are split over the model group as torch.chunk splits them (ceil(units /
Pr) per rank, fewer or none on the last: DTensor's Shard(0), so checkpoints re-split onto other
grids); the Pc batch groups hold replicas of the shard and split the examples. Forward: Y_local = f(X, W_shard), then an all-gather of Y over the model group along
the unit dimension, right after the layer (the cost model's d_i is the output before pooling).
Backward: dX_partial = f'(dY_local, W_shard), all-reduced over the model group (the pair in front
of the layer); dW_shard is local and is summed over the batch group by the gradient synchroniser,
like any replicated weight.

A grouped convolution (depthwise included) splits in whole groups: each rank reads only the input
channels of its groups, a slice of the replicated X (no communication), and its dX is nonzero on
that slice alone, so backward all-gathers the slices instead of all-reducing whole tensors. Padding
modes other than zeros pad the whole input first, as nn.Conv2d does: every rank holds all of it.

| function       | forward                      | backward                           | term          |
| -------------- | ---------------------------- | ---------------------------------- | ------------- |
| copy_to_group  | identity                     | all-reduce dX over the model group | dx_allreduce  |
| split (dim 1)  | keep the channels of my groups | all-gather the dX slices         | dx_allgather  |
| gather (dim)   | all-gather Y's unit shards   | keep this rank's shard of dY       | allgather     |
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import CostLayer
from hybridpar.core.splits import group_split, whole_group_prs
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.collectives import (
    Via,
    all_gather_uneven,
    all_reduce,
    chunk_sizes,
    compressed_all_reduce,
)
from hybridpar.runtime.comm.group import Group, group_rank, group_size
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.redistribute import Pieces, gather, split
from hybridpar.runtime.parallel.styles import ParallelStyle

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
    def forward(ctx, x, via):
        ctx.via = via
        return x

    @staticmethod
    def backward(ctx, grad):
        v, grad = ctx.via, grad.contiguous().clone()
        if v.encoded:
            compressed_all_reduce(grad, v)
        else:
            all_reduce(grad, v)
        return grad, None


def copy_to_group(x: torch.Tensor, via: Via) -> torch.Tensor:
    """Identity forward; backward sums the gradient over `via.group` (booked under its term)."""
    return x if group_size(via.group) == 1 else _CopyToGroup.apply(x, via)


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
            k: all_gather_uneven(p.detach(), self.sizes, 0, Via(self.group, term=Term.STATE))
            for k, p in self.named_parameters()
        }

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    unit_dim = -1  # where the output units lie in Y

    partial_dx = False
    """set where the hand-off into this layer reduce-scatters its input's gradient
    (core/handoff.py: fused): dX is left partial here, and the hand-off sums it"""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input this rank computes on; its backward completes dX over the model group
        (unless the hand-off in front of the layer does: `partial_dx`)."""
        if self.partial_dx:
            return x
        return copy_to_group(x, self._via(Term.DX_ALLREDUCE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.compute(self.enter(x))
        pieces = Pieces(tuple(self.sizes), self.unit_dim % y.dim())
        return gather(y, pieces, self._via(Term.ALLGATHER))

    def _via(self, term: str) -> Via:
        return Via(self.group, self.ledger, term, self.name, self.codec)


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
    """Output channels split over the model group; every rank sees all input channels, or, for a
    grouped convolution, those of its own groups."""

    hybridpar_kind = "conv"
    unit_dim = 1

    def __init__(
        self,
        conv: nn.Conv2d,
        group: Group | dist.ProcessGroup,
        ledger: Ledger | None = None,
        name: str = "",
    ) -> None:
        pr = group_size(group)
        if conv.out_channels >= pr and not group_split(conv.out_channels, conv.groups, pr):
            ok = whole_group_prs(conv.out_channels, conv.groups, pr) or [1]
            raise ConfigError(
                f"layer {name}: Pr={pr} would cut one of its {conv.groups} groups; use Pr in "
                f"{ok} or give it batch"
            )
        super().__init__(conv.out_channels, group, ledger, name or "conv")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.stride, self.dilation = conv.stride, conv.dilation
        self.padding_mode = conv.padding_mode
        if conv.padding_mode == "zeros":
            self.padding, self.pads = conv.padding, None
        else:  # as nn.Conv2d: pad the whole input in that mode, then convolve without padding
            self.padding, self.pads = 0, conv._reversed_padding_repeated_twice
        self.conv_groups = conv.groups
        per_out, per_in = conv.out_channels // conv.groups, conv.in_channels // conv.groups
        self.my_groups = self.sizes[self.r] // per_out if conv.groups > 1 else 1
        self.in_sizes = [s // per_out * per_in for s in self.sizes] if conv.groups > 1 else None
        self._take(conv)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_sizes is None:
            return super().enter(x)
        return split(x, Pieces(tuple(self.in_sizes), 1), self._via(Term.DX_ALLGATHER))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        w, b, groups = self.weight, self.bias, self.my_groups
        if self.pads is not None:
            x = F.pad(x, self.pads, mode=self.padding_mode)
        if not w.shape[0]:
            # an empty shard (torch.chunk gives 5 channels over 4 ranks as 2, 2, 1, 0): conv2d
            # refuses no channels, so compute one zero channel (on zero input channels where a
            # grouped layer's slice is empty) and drop it; the output stays in the graph, so this
            # rank still takes part in the dX all-reduce or all-gather
            w = torch.cat([w, w.new_zeros(1, *w.shape[1:])])
            b = None if b is None else torch.cat([b, b.new_zeros(1)])
            if x.shape[1] < w.shape[1]:
                fill = x.new_zeros(x.shape[0], w.shape[1] - x.shape[1], *x.shape[2:])
                x = torch.cat([x, fill], 1)
            return F.conv2d(x, w, b, self.stride, self.padding, self.dilation)[:, :0]
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, groups={self.conv_groups}, "
            f"shard={self.sizes[self.r]} channels from {self.start}, pr={len(self.sizes)}"
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
