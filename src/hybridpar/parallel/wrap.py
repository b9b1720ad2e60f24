"""parallelize(model, grid, ...): run an unmodified nn.Sequential with a hybrid plan.

The runtime layout is the one of Krizhevsky (2014) generalised to Gholami's 1.5D grid (the planner's
`fc-grid` scenario): the trunk model[:tail] is batch-parallel over all P ranks, the hand-off
gathers its output over the model group (scheme (a)), and every nn.Linear of the fully-connected
tail model[tail:] becomes a ModelParallelLinear on the Pr x Pc grid. Pr = 1 is pure batch
parallelism through the same code. Module names, and so state_dict keys, stay those of the
original model; `full_state_dict()` gathers the shards back into the original's layout.
"""

from __future__ import annotations

import copy
import functools
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.comm.codecs import Codec
from hybridpar.comm.grid import ProcessGrid
from hybridpar.comm.hooks import ReducerState, allreduce_hook, compressed_hook, host_hook
from hybridpar.comm.host import HostReducer, HostState
from hybridpar.comm.ledger import Ledger
from hybridpar.models import fc_tail_start
from hybridpar.parallel.batchnorm import BNSwitch, convert_global_batchnorm
from hybridpar.parallel.handoff import HandOff
from hybridpar.parallel.linear import ModelParallelLinear
from hybridpar.parallel.sync import GradSync

__all__ = ["HybridParallel", "parallelize"]


class HybridParallel(nn.Module):
    def __init__(self, model: nn.Sequential, grid: ProcessGrid, ledger: Ledger | None = None,
                 tail: int | None = None, layer_of: dict[str, str] | None = None,
                 bucket_bytes: int = 4 * 2**20, seed: int = 0, bn: str = "local",
                 bn_switch: BNSwitch | None = None, codec: Codec | None = None,
                 compress: frozenset[str] = frozenset(), error_feedback: bool = False,
                 reducer: str = "process-group") -> None:  # fmt: skip
        super().__init__()
        self.grid, self.ledger, self.seed = grid, ledger, seed
        if tail is None:
            tail = fc_tail_start(model) if grid.pr > 1 else len(model)
        self.tail = tail
        self.layer_of = layer_of or {}
        children = list(model.named_children())
        first_linear = next((n for n, m in children[tail:] if isinstance(m, nn.Linear)), None)
        modules: OrderedDict[str, nn.Module] = OrderedDict()
        for i, (name, m) in enumerate(children):
            if i >= tail and isinstance(m, nn.Linear):
                m = ModelParallelLinear.from_linear(m, grid.model_group, ledger, self._layer(name))
            else:
                m = copy.deepcopy(m)
            modules[name] = m
        self.model = nn.Sequential(modules)
        if bn not in ("local", "global", "adaptive"):
            raise ValueError(f"bn must be local, global or adaptive, got {bn!r}")
        switch = (bn_switch or BNSwitch()) if bn == "adaptive" else None
        self.bn_switch = switch
        if bn != "local":  # batch norm over the ranks that split the examples of its layer
            for i, (name, m) in enumerate(self.model.named_children()):
                group = grid.world if i < tail else grid.batch_group
                new = convert_global_batchnorm(m, group, ledger=ledger, switch=switch,
                                               layer_of=self.layer_of, prefix=name)  # fmt: skip
                if new is not m:
                    self.model.add_module(name, new)
        self.handoff = HandOff(grid.model_group, ledger, self._layer(first_linear or ""))
        self.has_dropout = any(isinstance(m, nn.Dropout) for m in list(self.model)[tail:])
        self.step = 0
        # the trunk is replicated over the world; the tail (shards and anything else) over the batch group
        trunk = [(self._param_layer(n), p) for i, (cn, c) in enumerate(self.model.named_children()) if i < tail
                 for n, p in ((f"{cn}.{k}", v) for k, v in c.named_parameters())]  # fmt: skip
        tail_params = [(self._param_layer(n), p) for i, (cn, c) in enumerate(self.model.named_children()) if i >= tail
                       for n, p in ((f"{cn}.{k}", v) for k, v in c.named_parameters())]  # fmt: skip
        hook, state = allreduce_hook, ReducerState
        if codec is not None and codec.name != "none" and "grads" in compress:
            hook = compressed_hook
            state = functools.partial(ReducerState, codec=codec, error_feedback=error_feedback)
        if codec is not None and codec.name != "none" and "activations" in compress:
            self.handoff.codec = codec
            for m in self.model:
                if isinstance(m, ModelParallelLinear):
                    m.codec = codec
        if reducer == "host":
            if hook is not allreduce_hook:
                raise ValueError(
                    "the host reducer sums float32 in shared memory: use codec none for grads"
                )
            if (
                grid.pr > 1
            ):  # the leaders' group of a sub-group cannot be created by its ranks alone
                raise ValueError("the host reducer runs with pure batch parallelism (grid 1xP)")
            hook = host_hook
            state = _host_state
            self._broadcast_parameters()  # Algorithm 5: parameters broadcast once, at the start
        elif reducer != "process-group":
            raise ValueError(f"reducer must be process-group or host, got {reducer!r}")
        self.sync = GradSync(
            [(grid.world, trunk), (grid.batch_group, tail_params)],
            ledger,
            bucket_bytes,
            hook,
            state,
        )

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Rank 0's parameters and buffers to every rank, logged outside any training step."""
        step, self.ledger.step = (self.ledger.step, -1) if self.ledger else (0, 0)
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            t0 = time.perf_counter()
            dist.broadcast(t.data, src=0)
            if self.ledger is not None:
                self.ledger.record("broadcast", self.grid.world_size, t.numel() * t.element_size(),
                                   time.perf_counter() - t0, "param_broadcast")  # fmt: skip
        if self.ledger is not None:
            self.ledger.step = step

    def _layer(self, module_name: str) -> str:
        return self.layer_of.get(module_name, module_name)

    def _param_layer(self, param_name: str) -> str:
        module = param_name.rsplit(".", 1)[0]
        return self.layer_of.get(module, module)

    @property
    def input_replicated(self) -> bool:
        """True when the very first layer is model-parallel: each rank then reads the B/Pc examples
        of its batch group directly, and there is no hand-off."""
        return self.tail == 0

    def set_batch(self, sizes: list[int]) -> None:
        """Rows per rank (all P of them, in rank order) for the coming step."""
        g = self.grid
        self.handoff.set_sizes(sizes[g.c * g.pr : (g.c + 1) * g.pr])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, m in enumerate(self.model):
            if i == self.tail:
                if not self.input_replicated:
                    x = self.handoff(x)
                if self.training and self.has_dropout and self.grid.pr > 1:
                    # replicas in a model group must draw the same dropout masks
                    return self._tail_same_rng(x)
            x = m(x)
        return x

    def _tail_same_rng(self, x: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + self.step * 1_009 + self.grid.c)
            for m in list(self.model)[self.tail :]:
                x = m(x)
        return x

    def finish_backward(self) -> float:
        """Wait for the gradient sums; returns the exposed wait in seconds."""
        self.step += 1
        return self.sync.wait()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict, shards gathered (collective: call on every rank)."""
        out: dict[str, torch.Tensor] = {}
        for name, m in self.model.named_children():
            if isinstance(m, ModelParallelLinear):
                w, b = m.full()
                out[f"{name}.weight"] = w
                if b is not None:
                    out[f"{name}.bias"] = b
            else:
                for k, v in m.state_dict().items():
                    out[f"{name}.{k}"] = v.clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, m in self.model.named_children():
            if isinstance(m, ModelParallelLinear):
                m.load_full(state[f"{name}.weight"], state.get(f"{name}.bias"))
            else:
                m.load_state_dict(
                    {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(f"{name}.")}
                )


def _host_state(group: dist.ProcessGroup, average: bool, ledger: Ledger | None) -> HostState:
    return HostState(HostReducer(group, ledger), average=average, ledger=ledger)


def parallelize(
    model: nn.Sequential, grid: ProcessGrid, ledger: Ledger | None = None, **kwargs
) -> HybridParallel:
    """Hybrid-parallel copy of `model` on `grid`; the caller's model is not modified."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed to be initialised")
    return HybridParallel(model, grid, ledger, **kwargs)
