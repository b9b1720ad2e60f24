"""The model style: a weighted layer split over the Pr ranks of a model group, the 1.5D algorithm of
Gholami et al. (Eq. 8, Fig. 5), for Linear (output features), Conv2d and Conv3d (output
channels), and any subclass of them whose forward computes its weight row by row
(hybridpar.core.ops); ConvTranspose2d and 3d (groups=1, as torch's own), whose weight holds the
output channels in its second dimension (`ModelSplit.dim`).

The layer stays the user's module: its parameters with one row per output unit (weight, bias, a
gain) become this rank's rows, as torch.chunk splits them (ceil(units / Pr) per rank, fewer or none
on the last: DTensor's Shard(0), so checkpoints re-split onto other grids), and its own operation on
its input (F.linear, F.conv2d) is swapped for this rank's part of it (`ModelSplit`, installed by
core.ops.install); the Pc batch groups hold replicas of the shard and split the examples. A
forward that computes its weight from its parameters (standardisation, a gain) reads them
whole-shaped, this rank's rows among filler, and the operation keeps this rank's rows of the
weight it computed: those depend on this rank's rows alone (core.ops.why_not_split). Forward:
Y_local = f(X, W_shard), then an all-gather of Y over the model group along the unit dimension,
right after the layer (the cost model's d_i is the output before pooling). Backward: dX_partial =
f'(dY_local, W_shard), all-reduced over the model group (the pair in front of the layer); dW_shard
is local and is summed over the batch group by the gradient synchroniser, like any replicated
weight.

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

from hybridpar.core import ops
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import CostLayer
from hybridpar.core.splits import group_split, whole_group_prs
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.collectives import (
    Via,
    all_gather_uneven,
    chunk_sizes,
)
from hybridpar.runtime.comm.group import Group, group_rank, group_size
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.parallel.mappings import Pieces, copy_to_group, gather, split
from hybridpar.runtime.parallel.styles import ParallelStyle

__all__ = ["ModelSplit", "ModelStyle", "copy_to_group", "split_units"]


class ModelSplit:
    """This rank's part of a Linear, Conv2d or Conv3d (any subclass; `module`, changed in place) whose
    output units are split over a model group: the stand-in for its operation on its input, and
    its shards' bookkeeping (gather them whole, cut a whole tensor, view one as a DTensor)."""

    def __init__(
        self,
        module: nn.Module,
        group: Group | dist.ProcessGroup,
        ledger: Ledger | None = None,
        name: str = "",
        codec: Codec | None = None,
    ) -> None:
        name = name or type(module).__name__
        units, pr = ops.units(module), group_size(group)
        if pr > units:
            raise ConfigError(
                f"layer {name} has {units} output units, fewer than Pr={pr}; use a smaller Pr"
            )
        self.transposed = isinstance(module, ops.TRANSPOSED)
        self.conv = isinstance(module, nn.Conv2d | nn.Conv3d) or self.transposed
        groups = module.groups if self.conv else 1
        if self.transposed and groups > 1:
            raise ConfigError(
                f"layer {name}: a transposed convolution of {groups} groups does not split over "
                "a model group (groups=1 does); give it batch"
            )
        if self.conv and not group_split(units, groups, pr):
            ok = whole_group_prs(units, groups, pr) or [1]
            raise ConfigError(
                f"layer {name}: Pr={pr} would cut one of its {groups} groups; use Pr in {ok} or "
                "give it batch"
            )
        self.module, self.group, self.ledger, self.name, self.codec = (
            module,
            group,
            ledger,
            name,
            codec,
        )
        self.sizes = chunk_sizes(units, pr)
        self.r = group_rank(group)
        self.start = sum(self.sizes[: self.r])
        own = dict(module.named_parameters(recurse=False))
        self.names = [k for k, p in own.items() if p.dim() and p.shape[self.dim(p)] == units]
        odd = sorted(set(own) - set(self.names))
        if odd:
            raise ConfigError(f"layer {name}: its parameter {odd[0]} has no row per output unit")
        for k in self.names:
            p = own[k]
            setattr(module, k, nn.Parameter(self.shard(p.detach()).clone(), p.requires_grad))
        self.whole = not ops.is_plain(module)
        """its forward computes the weight it convolves: it reads whole-shaped parameters"""
        self.groups, self.my_groups, self.in_sizes = groups, 1, None
        if groups > 1:
            per_out, per_in = units // groups, module.in_channels // groups
            self.my_groups = self.sizes[self.r] // per_out
            self.in_sizes = [s // per_out * per_in for s in self.sizes]
        around = (lambda: ops.swapped_parameters(module, self._whole())) if self.whole else None
        ops.install(module, self, name=name, enter=self.enter, around=around)
        module.hybridpar_split = self

    mesh = None  # the grid's DeviceMesh ("batch", "model"), set by the style: for checkpoints

    partial_dx = False
    """set where the hand-off into this layer reduce-scatters its input's gradient
    (core/handoff.py: fused): dX is left partial here, and the hand-off sums it"""

    def dim(self, t: torch.Tensor) -> int:
        """The dimension of a parameter-shaped tensor that holds the output units: 0, but 1 of a
        transposed convolution's weight (in, out, ...)."""
        return 1 if self.transposed and t.dim() > 1 else 0

    def as_dtensor(self, local: torch.Tensor):
        """`local` (this rank's shard of a weight-shaped tensor: the weight, its gradient, an
        optimizer buffer) as a DTensor: Shard(dim) over the model group, replicated over the
        batch group. A view, not a copy: torch.distributed.checkpoint loads into it in place."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        d = self.dim(local)
        shape = (*local.shape[:d], sum(self.sizes), *local.shape[d + 1 :])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, [Replicate(), Shard(d)], run_check=False, shape=shape, stride=stride
        )

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole weight-shaped tensor."""
        return full.narrow(self.dim(full), self.start, self.sizes[self.r])

    @torch.no_grad()
    def full(self) -> dict[str, torch.Tensor]:
        """The whole split parameters by name, gathered over the model group (collective)."""
        via = Via(self.group, term=Term.STATE)
        mine = {k: getattr(self.module, k).detach() for k in self.names}
        return {k: all_gather_uneven(t, self.sizes, self.dim(t), via) for k, t in mine.items()}

    def _whole(self) -> dict[str, torch.Tensor]:
        """Each split parameter whole-shaped: this rank's rows, zeros elsewhere."""
        out, units = {}, sum(self.sizes)
        for k in self.names:
            p = self.module._parameters[k]
            below = p.new_zeros((self.start, *p.shape[1:]))
            above = p.new_zeros((units - self.start - p.shape[0], *p.shape[1:]))
            out[k] = torch.cat([below, p, above])
        return out

    def _mine(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or not self.whole else self.shard(t)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input this rank computes on; its backward completes dX over the model group
        (unless the hand-off in front of the layer does: `partial_dx`); a grouped convolution
        keeps the input channels of its groups."""
        if self.in_sizes is not None:
            return split(x, Pieces(tuple(self.in_sizes), 1), self._via(Term.DX_ALLGATHER))
        if self.partial_dx:
            return x
        return copy_to_group(x, self._via(Term.DX_ALLREDUCE))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None, *args, **kwargs):
        """F.linear, F.conv2d or F.conv3d of the layer's forward, on this rank's rows of the
        weight, the output gathered whole over the model group."""
        w, b = self._mine(weight), self._mine(bias)
        if self.transposed:
            y = self._transposed(x, w, b, *args, **kwargs)
        else:
            y = self._conv(x, w, b, *args, **kwargs) if self.conv else F.linear(x, w, b)
        pieces = Pieces(tuple(self.sizes), 1 if self.conv else y.dim() - 1)
        return gather(y, pieces, self._via(Term.ALLGATHER))

    def _conv(self, x, w, b, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
        conv = F.conv3d if w.dim() == 5 else F.conv2d
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
            return conv(x, w, b, stride, padding, dilation)[:, :0]
        return conv(x, w, b, stride, padding, dilation, self.my_groups)

    def _transposed(self, x, w, b, *args, **kwargs) -> torch.Tensor:
        """F.conv_transpose2d or 3d on this rank's output channels (w: (in, mine, ...)); an
        empty shard computes one zero channel and drops it, as `_conv` does."""
        conv = F.conv_transpose3d if w.dim() == 5 else F.conv_transpose2d
        if w.shape[1]:
            return conv(x, w, b, *args, **kwargs)
        w = torch.cat([w, w.new_zeros(w.shape[0], 1, *w.shape[2:])], 1)
        b = None if b is None else torch.cat([b, b.new_zeros(1)])
        return conv(x, w, b, *args, **kwargs)[:, :0]

    def _via(self, term: str) -> Via:
        return Via(self.group, self.ledger, term, self.name, self.codec)


def split_units(
    module: nn.Module,
    group: Group | dist.ProcessGroup,
    ledger: Ledger | None = None,
    name: str = "",
) -> nn.Module:
    """`module` (an nn.Linear, Conv2d or Conv3d, any subclass) split by output units over `group`, in
    place: it keeps this rank's rows and computes its part of the output, gathered whole
    (`module.hybridpar_split` is its ModelSplit). Returns the module."""
    why = ops.why_not_split(module, _input_shape(module))
    if why:
        raise ConfigError(f"{name or type(module).__name__}: {why}")
    ModelSplit(module, group, ledger, name)
    return module


def _input_shape(module: nn.Module) -> tuple[int, ...]:
    """A small input a forward can be checked on."""
    if not isinstance(module, (nn.Conv2d, nn.Conv3d, *ops.TRANSPOSED)):
        return (module.in_features,)
    side = max(
        8, *((k - 1) * d + 1 for k, d in zip(module.kernel_size, module.dilation, strict=True))
    )
    return (module.in_channels, *[side] * len(module.kernel_size))


class ModelStyle(ParallelStyle):
    """model(Pr x Pc): each weighted layer's output units split over the Pr ranks of a model group
    (`ModelSplit`); its shard's gradients summed over the Pc ranks of its batch group."""

    kind = "model"

    def shard(self, name: str, module: nn.Module, layer: CostLayer) -> nn.Module:
        if name != layer.name:  # a layer riding along acts on the gathered output: whole
            return module
        split = ModelSplit(
            module, self.grid.model_group, self.ctx.ledger, layer.name, self.ctx.activation_codec
        )
        split.mesh = self.grid.mesh
        return module
