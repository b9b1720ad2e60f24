"""HybridParallel: hybridpar's engine, an unmodified nn.Module of any shape running a ParallelPlan.

The shape of torch's `parallelize_module`, for hybrid plans: the model is changed in place by
module name and its class and `forward` are untouched. Each segment's style (styles.py, one file
per kind) applies itself: a split layer becomes this rank's shard; a forward pre-hook at the entry
of each segment whose layout differs from the previous one moves the activation (so a
`torch.flatten` or a residual addition in the user's `forward` needs nothing from them); every
batch norm takes the statistics group of its segment's style; every parameter's gradient is
summed over the ranks its style replicates it on. State-dict keys stay the original's;
`full_state_dict()` gathers the shards back into the original layout.

    grid ranks: rank = c * Pr + r                  one mesh per distinct grid of the plan
    input rows  -> [segment 0: style 0] -> pre-hook: redistribute(style 0 -> style 1) -> ...
    parameters of segment k: gradients summed over style k's grad_group
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridpar.core.halo import tile
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via, even_split
from hybridpar.runtime.comm.grid import ProcessGrid
from hybridpar.runtime.parallel import apply
from hybridpar.runtime.parallel.batchnorm import BNSwitch
from hybridpar.runtime.parallel.domain import join
from hybridpar.runtime.parallel.dropout import SameRandom
from hybridpar.runtime.parallel.engine import Engine
from hybridpar.runtime.parallel.kinds import runtime_style
from hybridpar.runtime.parallel.model import ModelSplit
from hybridpar.runtime.parallel.reducers import make_reducer
from hybridpar.runtime.parallel.sharded import shard_states

__all__ = ["HybridParallel"]


class HybridParallel(Engine):
    """A model executing a ParallelPlan on this rank. Like DDP, it wraps the (changed in place)
    model as `.module`; the per-step contract is Engine's. `layout`: the plan resolved against
    this model (hybridpar.runtime.parallel.layout.resolve; `parallelize` resolves it)."""

    kind = "hybridpar"

    def build(self, model: nn.Module) -> None:
        plan, options, ledger = self.plan, self.options, self.ledger
        layout, device = self.layout, self.device
        self.module = model
        self.ctx = apply.context(plan, layout, options, ledger, device)
        self.world = self.ctx.grids.world
        # every segment's style applies itself, in the same order on every rank (groups are made)
        self.styles = [runtime_style(s, self.ctx) for s in layout.segments]
        apply.shard(model, layout, self.styles)
        self._hooks = apply.redistributions(model, layout, self.ctx)
        apply.dropouts(model, layout, self.styles, self.ctx, options.seed, lambda: self.step)
        self.random: SameRandom | None = None
        if any(s.replicated for s in self.styles):
            self.random = SameRandom(options.seed, [s.random_key for s in self.styles])
            self._hooks += self.random.attach(model, layout.entries)
        self.bn_switch = BNSwitch.of(plan, options, self.world, ledger, device)
        if plan.choices.bn != "local":
            apply.global_batchnorm(model, layout, self.styles, ledger, self.bn_switch)
        self.rounds = apply.handoff_rounds(model, layout, self.ctx)  # every module is final
        self.variable = next((r for r in self.rounds if r.variable), None)
        """the hand-off whose head steps per round (variable batch), if any"""
        skip = {id(p) for p in self.variable.head_params} if self.variable else set()
        if plan.choices.shard_states:  # their sums are FSDP2's
            skip |= shard_states(model, layout, self.styles, ledger)
        self.reducer = make_reducer(plan.choices, options)
        self.sync = apply.grad_sync(
            model, layout, self.styles, self.reducer, self.ctx, frozenset(skip)
        )
        if self.reducer.host:  # Sekiyama's Algorithm 5: parameters sent once, at the start
            apply.broadcast_parameters(model, ledger, self.sync)
        if self.reducer.worker is not None:  # let the thread end with the engine
            weakref.finalize(self, self.reducer.worker.stop)

    @property
    def order(self) -> list[int] | None:  # type: ignore[override]
        return self.ctx.grids.order

    @property
    def why_not_hosts(self) -> str:  # type: ignore[override]
        return self.ctx.grids.why_not_hosts

    # --- per step ------------------------------------------------------------------------------

    @property
    def input_grid(self) -> ProcessGrid:
        return self.styles[0].grid

    @property
    def output_grid(self) -> ProcessGrid:
        return self.styles[-1].grid

    def split(self, sizes: list[int]) -> None:
        self.ctx.rows.sizes = sizes

    def input_rows(self, n: int) -> slice:
        return self.input_grid.rows(even_split(n, self.plan.procs))

    def output_rows(self, n: int) -> slice:
        return self.output_grid.rows(even_split(n, self.plan.procs))

    def input_band(self) -> tuple | None:
        """The rows (lo, hi) of the images this rank feeds where the first layer splits them by
        height (on tiles its rows and columns ((lo, hi), (first, last + 1))); None: whole."""
        first, shape = self.layout.segments[0], self.layout.trace.in_shape
        if first.kind != "domain" or len(shape) not in (3, 4):
            return None
        return tile(shape[1:], first.pr, first.pw, self.input_grid.r)

    def output_band(self) -> tuple | None:
        """The rows (or the tile) of the dense outputs (and targets) this rank holds."""
        last, shape = self.layout.segments[-1], self.layout.trace.out_shape
        if last.kind != "domain" or len(shape) not in (3, 4):
            return None
        return tile(shape[1:], last.pr, last.pw, self.output_grid.r)

    def _counted(self, out: torch.Tensor) -> torch.Tensor:
        """The bands of a dense prediction joined first, within the model group (its first
        rank sends the whole images); else as the engine's."""
        if self.output_band() is None:
            return super()._counted(out)
        grid, last = self.output_grid, self.layout.segments[-1]
        via = Via(grid.model_group, term=Term.METRICS)
        whole = join(out, self.layout.trace.out_shape[1:], last.pr, last.pw, via)
        return whole if grid.r == 0 else whole[:0]

    @property
    def counts_outputs(self) -> bool:
        """Model-group replicas hold the same outputs: only r = 0 counts them in the metrics
        (the bands of a split image are each one rank's)."""
        return self.output_grid.r == 0 or self.output_band() is not None

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if self.training and self.sync.pending():
            raise RuntimeError(
                "the last backward's gradients were never summed: call finish_backward() after "
                "backward() and before optimizer.step() (or use hybridpar.HybridTrainer)"
            )
        sizes = self.ctx.rows.sizes
        if sizes is None:
            raise RuntimeError("call set_batch(n) with the global batch size before each forward")
        want = self.input_grid.rows(sizes)
        if x.shape[0] != want.stop - want.start:
            n = sum(sizes)
            raise ValueError(
                f"this rank feeds {want.stop - want.start} of the {n} examples "
                f"(x[model.input_rows({n})]), got {x.shape[0]}"
            )
        if self.random is not None:
            self.random.step = self.step
        return self.module(x, *args, **kwargs)

    def finish_backward(self) -> float:
        wait = self.sync.wait()
        self.step += 1
        return wait

    @property
    def exposed_s(self) -> float:
        return self.sync.exposed_s

    # --- state ---------------------------------------------------------------------------------

    @functools.cached_property
    def _splits(self) -> dict[str, ModelSplit]:
        """Split parameter name -> its layer's split (fixed once the plan is applied), under
        every name of a module registered twice (the state dict has each)."""
        return {
            f"{n}.{k}": m.hybridpar_split
            for n, m in self.module.named_modules(remove_duplicate=False)
            if isinstance(getattr(m, "hybridpar_split", None), ModelSplit)
            for k in m.hybridpar_split.names
        }

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict, shards gathered (collective: call on every rank)."""
        gathered: dict[int, dict[str, torch.Tensor]] = {}
        for s in self._splits.values():  # each split once, in the same order on every rank
            if id(s) not in gathered:
                gathered[id(s)] = s.full()
        full = {n: gathered[id(s)][n.rpartition(".")[2]] for n, s in self._splits.items()}
        return {k: full[k] if k in full else _whole(v) for k, v in self.module.state_dict().items()}

    def distributed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A split layer's shard as a DTensor view (Shard(0) over its model group, replicated
        over its batch group); a replicated tensor as itself."""
        split = self._splits.get(name)
        return split.as_dtensor(t) if split is not None else t

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the original model's state_dict: each rank keeps its shards."""
        local = dict(state)
        for k, split in self._splits.items():
            local[k] = split.shard(state[k])
        for k, v in self.module.state_dict().items():  # sharded states: this rank's shards
            if isinstance(v, DTensor):
                local[k] = distribute_tensor(state[k].to(v.dtype), v.device_mesh, v.placements)
        self.module.load_state_dict(local)

    def reducer_states(self) -> dict[int, object]:
        return {b.index(): st for st, b in self.sync.buckets}


def _whole(v: torch.Tensor) -> torch.Tensor:
    """A copy of a state tensor, whole (a sharded state's shards gathered: collective)."""
    return v.full_tensor() if isinstance(v, DTensor) else v.clone()
