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

import datetime
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpar.errors import ConfigError
from hybridpar.plan import ParallelPlan, Style
from hybridpar.runtime.comm.codecs import get_codec
from hybridpar.runtime.comm.collectives import even_split
from hybridpar.runtime.comm.grid import GridSet, ProcessGrid
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.batchnorm import BNSwitch, LossPlateau, convert_global_batchnorm
from hybridpar.runtime.parallel.dropout import SameRandom
from hybridpar.runtime.parallel.engine import Engine
from hybridpar.runtime.parallel.kinds import runtime_style
from hybridpar.runtime.parallel.layout import Layout
from hybridpar.runtime.parallel.model import ModelParallel
from hybridpar.runtime.parallel.redistribute import move
from hybridpar.runtime.parallel.reducers import make_reducer
from hybridpar.runtime.parallel.styles import BuildContext, ParallelStyle
from hybridpar.runtime.parallel.sync import GradSync
from hybridpar.terms import Term

__all__ = ["HybridParallel"]


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class HybridParallel(Engine):
    """A model executing a ParallelPlan on this rank. Like DDP, it wraps the (changed in place)
    model as `.module`; the per-step contract is Engine's. `layout`: the plan resolved against
    this model (hybridpar.runtime.parallel.layout.resolve; `parallelize` resolves it)."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        layout: Layout,
        options: RuntimeOptions,
        device: str,
        ledger: Ledger | None = None,
    ) -> None:
        super().__init__()
        if plan.engine != "hybridpar":
            raise ConfigError("a plan with engine ddp runs under torch DDP, not HybridParallel")
        self.plan, self.layout, self.options, self.ledger = plan, layout, options, ledger
        self.module = model
        self.ctx = _context(plan, layout, options, ledger, device)
        self.world = self.ctx.grids.world
        self.styles = [runtime_style(s, self.ctx) for s in layout.segments]
        # parameters no forward uses: replicated everywhere, like a batch layer's
        self.unused = runtime_style(Style.batch(plan.procs), self.ctx)
        self._shard()
        self._hooks = self._redistributions()
        self.random: SameRandom | None = None
        if any(s.replicated for s in self.styles):
            self.random = SameRandom(options.seed, [s.random_key for s in self.styles])
            self._hooks += self.random.attach(model, layout.entries)
        self.bn_switch = (
            self._switch(plan, options, device) if plan.choices.bn == "adaptive" else None
        )
        if plan.choices.bn != "local":
            self._global_batchnorm()
        self.reducer = make_reducer(plan.choices, options)
        self.sync = self._grad_sync()
        if self.reducer.host:  # Sekiyama's Algorithm 5: parameters sent once, at the start
            self._broadcast_parameters()
        if self.reducer.worker is not None:  # let the thread end with the engine
            weakref.finalize(self, self.reducer.worker.stop)

    # --- building: each segment's style applies itself -------------------------------------------

    def _shard(self) -> None:
        """Every weighted layer becomes its style's module for this rank (a split layer its shard)."""
        for x in self.layout.layers:
            old = self.module.get_submodule(x.name)
            new = self.styles[x.segment].shard(x.name, old, self.layout.layer_of[x.name])
            if new is not old:
                _set(self.module, x.name, new)

    def _redistributions(self) -> list:
        """A forward pre-hook at each segment entry where the layout changes."""
        hooks = []
        for k, src, dst in self.layout.moves():
            layer = self.layout.first_layer(k)
            hook = move(src, dst, self.ctx.grids, self.ctx.rows, self.ledger, layer,
                        self.ctx.activation_codec)  # fmt: skip
            at = self.module.get_submodule(self.layout.entries[k])
            hooks.append(at.register_forward_pre_hook(hook))
        return hooks

    def _switch(self, plan: ParallelPlan, options: RuntimeOptions, device: str) -> BNSwitch:
        switch = BNSwitch(
            options.bn_max_batch,
            LossPlateau(options.bn_window, options.bn_threshold),
            group=self.world,
            ledger=self.ledger,
            device=device,
        )
        switch.start(plan.batch)  # BZ: the global batch (Liu et al. section 5)
        return switch

    def _global_batchnorm(self) -> None:
        """Every batch norm over its segment style's statistics group (a twin of the batch group:
        statistics never queue behind gradient buckets), built in segment order on every rank."""
        norms = [
            (name, m, self.layout.module_segment[name])
            for name, m in self.module.named_modules()
            if isinstance(m, _BatchNorm) and name in self.layout.module_segment
        ]
        groups = {}
        for seg in sorted({seg for _, _, seg in norms}, key=lambda k: self.layout.segments[k]):
            key = self.layout.segments[seg]
            if key not in groups:  # collective: the same groups in the same order everywhere
                groups[key] = self.styles[seg].bn_group()
        for name, m, seg in norms:
            new = convert_global_batchnorm(
                m,
                groups[self.layout.segments[seg]],
                ledger=self.ledger,
                switch=self.bn_switch,
                layer_of=self.layout.layer_of,
                prefix=name,
            )
            _set(self.module, name, new)

    def _grad_sync(self) -> GradSync:
        """Each parameter's gradient summed over the grad group of the style it is used in."""
        by_key: dict[tuple, tuple[ParallelStyle, list]] = {}
        for name, p in self.module.named_parameters():
            seg = self.layout.param_segment.get(name)
            style = self.styles[seg] if seg is not None else self.unused
            module = name.rpartition(".")[0]
            named = (self.layout.layer_of.get(module, module), p)
            by_key.setdefault(style.grad_key, (style, []))[1].append(named)
        pairs = []
        for _, (style, named) in sorted(by_key.items()):
            group = style.grad_group
            if self.reducer.own_groups:  # the reducer's thread: groups nobody else uses
                group = self.ctx.grids.grad_group(style.spec.pc)
            pairs.append((group, named))
        r = self.reducer
        return GradSync(pairs, self.ledger, self.options.bucket_bytes, r.hook, r.state)

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Rank 0's parameters and buffers to every rank, logged outside any training step."""
        step, self.ledger.step = (self.ledger.step, -1) if self.ledger else (0, 0)
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            t0 = time.perf_counter()
            dist.broadcast(t.data, src=0)
            if self.ledger is not None:
                size = t.numel() * t.element_size()
                took = time.perf_counter() - t0
                self.ledger.record("broadcast", self.plan.procs, size, took, Term.PARAM_BROADCAST)
        if self.ledger is not None:
            self.ledger.step = step

    # --- per step ------------------------------------------------------------------------------

    @property
    def input_grid(self) -> ProcessGrid:
        return self.styles[0].grid

    @property
    def output_grid(self) -> ProcessGrid:
        return self.styles[-1].grid

    def set_batch(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"set_batch takes the global batch size, a positive int; got {n!r}")
        self.ctx.rows.sizes = even_split(n, self.plan.procs)

    def input_rows(self, n: int) -> slice:
        return self.input_grid.rows(even_split(n, self.plan.procs))

    def output_rows(self, n: int) -> slice:
        return self.output_grid.rows(even_split(n, self.plan.procs))

    @property
    def counts_outputs(self) -> bool:
        """Model-group replicas hold the same outputs: only r = 0 counts them in the metrics."""
        return self.output_grid.r == 0

    @property
    def metrics_group(self):
        return self.output_grid.batch_group

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

    def _split(self) -> dict[str, ModelParallel]:
        return {n: m for n, m in self.module.named_modules() if isinstance(m, ModelParallel)}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict, shards gathered (collective: call on every rank)."""
        full = {f"{n}.{k}": v for n, m in self._split().items() for k, v in m.full().items()}
        return {k: full[k] if k in full else v.clone() for k, v in self.module.state_dict().items()}

    def distributed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A split layer's shard as a DTensor view (Shard(0) over its model group, replicated
        over its batch group); a replicated tensor as itself."""
        owner, _, _ = name.rpartition(".")
        m = self.module.get_submodule(owner)
        return m.as_dtensor(t) if isinstance(m, ModelParallel) else t

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the original model's state_dict: each rank keeps its shards."""
        local = dict(state)
        for n, m in self._split().items():
            for k, _ in m.named_parameters():
                local[f"{n}.{k}"] = m.shard(state[f"{n}.{k}"])
        self.module.load_state_dict(local)

    def reducer_states(self) -> dict[int, object]:
        return {b.index(): st for st, b in self.sync.buckets}


def _context(
    plan: ParallelPlan, layout: Layout, options: RuntimeOptions, ledger: Ledger | None, device: str
) -> BuildContext:
    """The grids of every segment's style (one per distinct Pc), with the groups that move
    activations between them and the job's timeout, and the plan's codec."""
    pcs = [s.pc for s in layout.segments] + [plan.procs]
    moves = [(a.pc, b.pc) for _, a, b in layout.moves()]
    timeout = datetime.timedelta(seconds=options.timeout_s) if options.timeout_s else None
    grids = GridSet(pcs, moves, device, timeout, shm=options.shared_memory)
    codec = get_codec(plan.choices.codec, options.block) if plan.choices.codec != "none" else None
    return BuildContext(grids, plan.choices, options, ledger, codec=codec)
