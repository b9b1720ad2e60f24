"""parallelize(model, plan): run an unmodified nn.Module of any shape with a ParallelPlan.

The shape of torch's `parallelize_module`, for hybrid plans: the model is changed in place by
module name and its class and `forward` are untouched. Layers with a model style become this
rank's shard (ModelParallelLinear / ModelParallelConv2d); a forward pre-hook at the entry of each
segment whose layout differs from the previous one moves the activation (so a `torch.flatten` or a
residual addition in the user's `forward` needs nothing from them); every batch norm takes the
statistics group of its segment's layout; every parameter's gradient is summed over the ranks that
replicate it, derived from where it is used. State-dict keys stay the original's;
`full_state_dict()` gathers the shards back into the original layout.

    grid ranks: rank = c * Pr + r                  one mesh per distinct grid of the plan
    input rows  -> [segment 0: layout Pc0] -> pre-hook: redistribute Pc0 -> Pc1 -> [segment 1] ...
    parameters of segment k: gradients summed over the batch group of grid (P / Pc_k, Pc_k)
"""

from __future__ import annotations

import functools
import hashlib
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpar.choices import DEFAULT_BLOCK
from hybridpar.errors import ConfigError
from hybridpar.plan import ParallelPlan, Term
from hybridpar.runtime.comm import small
from hybridpar.runtime.comm.codecs import Codec, get_codec
from hybridpar.runtime.comm.collectives import even_split
from hybridpar.runtime.comm.grid import GridSet, ProcessGrid
from hybridpar.runtime.comm.hooks import ReducerState, allreduce_hook, compressed_hook, host_hook
from hybridpar.runtime.comm.host import HostReducer, HostState
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.comm.worker import CommWorker
from hybridpar.runtime.parallel.batchnorm import BNSwitch, convert_global_batchnorm
from hybridpar.runtime.parallel.layout import Layout, resolve
from hybridpar.runtime.parallel.model import ModelParallel, ModelParallelConv2d, ModelParallelLinear
from hybridpar.runtime.parallel.redistribute import Redistribute, StepRows
from hybridpar.runtime.parallel.sync import GradSync

__all__ = ["HybridParallel", "parallelize"]


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class _SameRandom:
    """Replicas in a model group compute the same activations, so they must draw the same random
    numbers (dropout masks). At each segment's entry the generator is seeded from (seed, step,
    segment, batch group) where the layout is replicated (Pr > 1) and from the rank where it is
    not; the caller's generator state is restored after the forward. Dropout then depends on the
    step only, whatever P and the grid."""

    def __init__(self, seed: int, layout: Layout, grids: GridSet, rows: StepRows) -> None:
        self.seed, self.rows, self.saved = seed, rows, None
        rank = dist.get_rank()
        self.keys = [grids.grid(s.pc).c if s.pr > 1 else 1_000 + rank for s in layout.segments]
        self.step = 0

    def enter(self, seg: int) -> None:
        torch.manual_seed(
            (self.seed * 1_000_003 + self.step * 1_009 + seg * 10_007 + self.keys[seg]) % 2**63
        )

    def start(self, module: nn.Module, args: tuple) -> None:
        self.saved = torch.get_rng_state()
        self.saved_cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        self.enter(0)

    def stop(self, module: nn.Module, args: tuple, output: object) -> None:
        torch.set_rng_state(self.saved)
        if self.saved_cuda is not None:
            torch.cuda.set_rng_state(self.saved_cuda)


class HybridParallel(nn.Module):
    """A model executing a ParallelPlan on this rank. Like DDP, it wraps the (changed in place)
    model as `.module`; per step: `set_batch(n)`, forward on `input_rows(n)` of the global batch,
    backward of a loss summed over `output_rows(n)` and divided by n, then `finish_backward()`."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        *,
        ledger: Ledger | None = None,
        input_shape: tuple[int, ...] | None = None,
        device: str = "cpu",
        bucket_bytes: int = 4 * 2**20,
        seed: int = 0,
        bn_switch: BNSwitch | None = None,
        codec_block: int | None = DEFAULT_BLOCK,
        error_feedback: bool = False,
    ) -> None:
        super().__init__()
        if plan.engine != "hybridpar":
            raise ConfigError("a plan with engine ddp runs under torch DDP, not parallelize()")
        _agree(plan)
        self.plan, self.ledger, self.seed = plan, ledger, seed
        self.layout = layout = resolve(model, plan, input_shape, dist.get_world_size())
        pcs = [s.pc for s in layout.segments] + [plan.procs]
        self.grids = GridSet(pcs, [(a, b) for _, a, b in layout.moves()], device)
        self.rows = StepRows()
        self.codec = get_codec(plan.codec, codec_block) if plan.codec != "none" else None
        acts = self.codec if "activations" in plan.compress else None
        self.module = model
        self._split(acts)
        self._hooks = [self._redistribute(k, a, b, acts) for k, a, b in layout.moves()]
        self.random = self._same_random()
        self.bn_switch = bn_switch if plan.bn == "adaptive" else None
        if plan.bn != "local":
            self._global_batchnorm(bn_switch if plan.bn == "adaptive" else None)
        self.comm_worker: CommWorker | None = None
        self.sync = self._grad_sync(bucket_bytes, error_feedback)
        if self.comm_worker is not None:  # let the thread end with the wrapper
            weakref.finalize(self, self.comm_worker.stop)

    # --- building ----------------------------------------------------------------------------

    def _split(self, codec: Codec | None) -> None:
        """Swap every layer with a model style for this rank's shard, in place."""
        for name, s in self.layout.split_layers().items():
            old = self.module.get_submodule(name)
            cls = ModelParallelLinear if isinstance(old, nn.Linear) else ModelParallelConv2d
            new = cls(
                old, self.grids.grid(s.pc).model_group, self.ledger, self.layout.layer_of[name]
            )
            new.codec, new.mesh = codec, self.grids.grid(s.pc).mesh
            new.train(old.training)
            _set(self.module, name, new)

    def _redistribute(self, seg: int, src: int, dst: int, codec: Codec | None):
        at = self.layout.entries[seg]
        layer = next(x.name for x in self.layout.layers if x.segment == seg)
        hook = Redistribute(self.grids, src, dst, self.rows, self.ledger, layer, codec)
        return self.module.get_submodule(at).register_forward_pre_hook(hook)

    def _same_random(self) -> _SameRandom | None:
        if all(s.pr == 1 for s in self.layout.segments):
            return None
        rng = _SameRandom(self.seed, self.layout, self.grids, self.rows)
        self._hooks += [
            self.module.register_forward_pre_hook(rng.start),
            self.module.register_forward_hook(rng.stop),
        ]
        for k, at in self.layout.entries.items():
            if k:
                hook = functools.partial(lambda seg, _m, _a: rng.enter(seg), k)
                self._hooks.append(self.module.get_submodule(at).register_forward_pre_hook(hook))
        return rng

    def _global_batchnorm(self, switch: BNSwitch | None) -> None:
        """Batch norm over the ranks that split the examples of its segment's layout, on a twin of
        that batch group (never behind gradient buckets), through shared memory on one host."""
        pcs = sorted(
            {
                self.layout.segments[seg].pc
                for name, m in self.module.named_modules()
                if isinstance(m, _BatchNorm)
                and (seg := self.layout.module_segment.get(name)) is not None
            }
        )
        groups = {pc: self.grids.twin_group(pc, "bn") for pc in pcs}  # collective, fixed order
        for pc in pcs:
            small.enable(groups[pc])
        for name, m in list(self.module.named_modules()):
            seg = self.layout.module_segment.get(name)
            if isinstance(m, _BatchNorm) and seg is not None:
                group = groups[self.layout.segments[seg].pc]
                new = convert_global_batchnorm(
                    m,
                    group,
                    ledger=self.ledger,
                    switch=switch,
                    layer_of=self.layout.layer_of,
                    prefix=name,
                )
                _set(self.module, name, new)

    def _grad_sync(self, bucket_bytes: int, error_feedback: bool) -> GradSync:
        """Each parameter's gradient summed over the batch group of the layout it is used in."""
        groups: dict[int, list] = {}
        for name, p in self.module.named_parameters():
            seg = self.layout.param_segment.get(name)
            pc = self.layout.segments[seg].pc if seg is not None else self.plan.procs
            module = name.rpartition(".")[0]
            groups.setdefault(pc, []).append((self.layout.layer_of.get(module, module), p))
        hook, state = allreduce_hook, ReducerState
        pairs = [(self.grids.grid(pc).batch_group, named) for pc, named in sorted(groups.items())]
        if self.codec is not None and "grads" in self.plan.compress:
            # the compressed reducer on its own thread and groups, overlapping backward
            hook, self.comm_worker = compressed_hook, CommWorker()
            state = functools.partial(
                ReducerState,
                codec=self.codec,
                error_feedback=error_feedback,
                worker=self.comm_worker,
            )
            pairs = [(self.grids.grad_group(pc), named) for pc, named in sorted(groups.items())]
        if self.plan.reducer == "host":  # resolve() checked: every layer batch, float32 grads
            hook, state = host_hook, _host_state
            self._broadcast_parameters()  # Sekiyama's Algorithm 5: parameters sent once, at the start
        return GradSync(pairs, self.ledger, bucket_bytes, hook, state)

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Rank 0's parameters and buffers to every rank, logged outside any training step."""
        step, self.ledger.step = (self.ledger.step, -1) if self.ledger else (0, 0)
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            t0 = time.perf_counter()
            dist.broadcast(t.data, src=0)
            if self.ledger is not None:
                self.ledger.record(
                    "broadcast",
                    self.plan.procs,
                    t.numel() * t.element_size(),
                    time.perf_counter() - t0,
                    Term.PARAM_BROADCAST,
                )
        if self.ledger is not None:
            self.ledger.step = step

    # --- per step ----------------------------------------------------------------------------

    @property
    def input_grid(self) -> ProcessGrid:
        return self.grids.grid(self.layout.segments[0].pc)

    @property
    def output_grid(self) -> ProcessGrid:
        return self.grids.grid(self.layout.segments[-1].pc)

    def set_batch(self, n: int) -> None:
        """The number of examples in the coming step's global batch (known to every rank)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"set_batch takes the global batch size, a positive int; got {n!r}")
        self.rows.sizes = even_split(n, self.plan.procs)

    def input_rows(self, n: int) -> slice:
        """The examples of a global batch of n that this rank feeds in."""
        return self.input_grid.rows(even_split(n, self.plan.procs))

    def output_rows(self, n: int) -> slice:
        """The examples its outputs belong to."""
        return self.output_grid.rows(even_split(n, self.plan.procs))

    @property
    def counts_outputs(self) -> bool:
        """Model-group replicas hold the same outputs: only r = 0 counts them in the metrics."""
        return self.output_grid.r == 0

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if self.training and self.sync.pending():
            raise RuntimeError(
                "the last backward's gradients were never summed: call finish_backward() after "
                "backward() and before optimizer.step() (or use hybridpar.HybridTrainer)"
            )
        if self.rows.sizes is None:
            raise RuntimeError("call set_batch(n) with the global batch size before each forward")
        want = self.input_grid.rows(self.rows.sizes)
        if x.shape[0] != want.stop - want.start:
            n = sum(self.rows.sizes)
            raise ValueError(
                f"this rank feeds {want.stop - want.start} of the {n} examples "
                f"(x[model.input_rows({n})]), got {x.shape[0]}"
            )
        return self.module(x, *args, **kwargs)

    def finish_backward(self) -> float:
        """Wait for the gradient sums; returns the exposed wait in seconds."""
        if self.random is not None:
            self.random.step += 1
        return self.sync.wait()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict, shards gathered (collective: call on every rank)."""
        split = {n: m for n, m in self.module.named_modules() if isinstance(m, ModelParallel)}
        full = {f"{n}.{k}": v for n, m in split.items() for k, v in m.full().items()}
        return {k: full[k] if k in full else v.clone() for k, v in self.module.state_dict().items()}

    def distributed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like parameter `name` (the parameter, an optimizer buffer) as
        torch.distributed.checkpoint should see it: a DTensor view for a split layer's shard, the
        tensor itself for a replicated one."""
        owner, _, _ = name.rpartition(".")
        m = self.module.get_submodule(owner)
        return m.as_dtensor(t) if isinstance(m, ModelParallel) else t

    def distributed_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict (original keys) with split layers' shards as DTensor views."""
        return {k: self.distributed(k, v) for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the original model's state_dict: each rank keeps its shards."""
        local = dict(state)
        for n, m in self.module.named_modules():
            if isinstance(m, ModelParallel):
                for k, _ in m.named_parameters():
                    local[f"{n}.{k}"] = m.shard(state[f"{n}.{k}"])
        self.module.load_state_dict(local)


def _agree(plan: ParallelPlan) -> None:
    """Every rank must run the same plan (DESIGN.md invariant 3): compare digests once."""
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    odd = [r for r, d in enumerate(every) if d != every[0]]
    if odd:
        raise ConfigError(
            f"ranks {odd} hold a different plan than rank 0; give every rank the same plan"
        )


def _host_state(group: dist.ProcessGroup, average: bool, ledger: Ledger | None) -> HostState:
    return HostState(HostReducer(group, ledger), average=average, ledger=ledger)


def parallelize(model: nn.Module, plan: ParallelPlan, **kwargs) -> HybridParallel:
    """Apply `plan` to `model` (changed in place) on this rank; see HybridParallel for the options."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed to be initialised")
    return HybridParallel(model, plan, **kwargs)
