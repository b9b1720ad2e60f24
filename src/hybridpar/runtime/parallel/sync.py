"""Gradient synchronisation of replicated parameters, bucketed and overlapped with the backward pass.

Why our own engine and not torch DDP: in a hybrid plan one model has parameters replicated over
different groups (the conv trunk over all P ranks, each FC shard over its batch group of Pc ranks),
and the loss is scaled by 1/B once so that every gradient is a plain *sum* over the ranks that
share a parameter. DDP wraps one module with one group and averages over it. This engine does what
DDP's reducer does (buckets in reverse registration order, each launched asynchronously as soon as
its last gradient is accumulated, so communication overlaps the rest of the backward pass) for any
number of (group, parameters) pairs, and calls reducers written as DDP communication hooks, so
the reducers of `hybridpar.runtime.comm.hooks` serve both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.core.splits import buckets
from hybridpar.runtime.comm.group import Group, group_size
from hybridpar.runtime.comm.hooks import ReducerState, allreduce_hook
from hybridpar.runtime.comm.ledger import Ledger

__all__ = ["Bucket", "GradSync"]


class Bucket:
    """A flat gradient buffer for some parameters of one group; looks like torch's GradBucket."""

    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], last: bool) -> None:
        self._index, self._last = index, last
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.numel = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(
            self.numel, dtype=self.params[0].dtype, device=self.params[0].device
        )
        self.ready: set[int] = set()
        self.future: torch.futures.Future | None = None

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def pack(self, deliver: Callable[[int], None] | None = None, piece: int = 0) -> None:
        """Copy the gradients into `flat`. `deliver(k)`: called whenever the first k elements
        are written, `piece` elements at a time at most (a staged reducer sums what has arrived
        while the rest is copied)."""
        off = 0
        for p in self.params:
            n = p.numel()
            dst = self.flat[off : off + n]
            grad = None if p.grad is None else p.grad.reshape(-1)
            step = piece if deliver is not None and piece > 0 else max(n, 1)
            for a in range(0, n, step):
                b = min(n, a + step)
                if grad is None:
                    dst[a:b].zero_()
                else:
                    dst[a:b].copy_(grad[a:b])
                if deliver is not None:
                    deliver(off + b)
            off += n

    def unpack(self, result: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            piece = result[off : off + n].view_as(p)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
            off += n


Hook = Callable[[ReducerState, Bucket], torch.futures.Future]


class GradSync:
    """Sums the gradients of each parameter over the group that replicates it.

    groups: (process group, [(layer name, parameter), ...]) pairs; a group of one rank is skipped.
    Call `wait()` after `loss.backward()` and before `optimizer.step()`.
    """

    def __init__(
        self,
        groups: list[tuple[Group | dist.ProcessGroup, list[tuple[str, nn.Parameter]]]],
        ledger: Ledger | None = None,
        bucket_bytes: int = 4 * 2**20,
        hook: Hook = allreduce_hook,
        state_factory: Callable[..., ReducerState] = ReducerState,
    ) -> None:
        self.hook = hook
        self.pairs = groups  # (the group summing them, the parameters), as given
        self.buckets: list[tuple[ReducerState, Bucket]] = []
        self._handles = []
        self._owner: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket slot, param index)
        self.wait_s = 0.0
        self.exposed_s = 0.0  # last gradient produced -> all gradients summed, last step
        self._last_grad_t = 0.0
        index = 0
        for group, named in groups:
            if group_size(group) == 1:
                continue
            named = [(n, p) for n, p in named if p.requires_grad][::-1]  # as gradients arrive
            sizes = [p.numel() * p.element_size() for _, p in named]
            chunks = [[named[i] for i in run] for run in buckets(sizes, bucket_bytes)]
            state = state_factory(group=group, average=False, ledger=ledger)
            if hasattr(state, "buckets_per_step"):  # the compressed pipeline flushes per step
                state.buckets_per_step = len(chunks)
            for k, chunk in enumerate(chunks):
                b = Bucket(index, chunk, k == len(chunks) - 1)
                layers: dict[str, float] = {}
                for n, p in chunk:
                    layers[n] = layers.get(n, 0) + p.numel()
                state.bucket_layers[index] = layers
                slot = len(self.buckets)
                self.buckets.append((state, b))
                for j, (_, p) in enumerate(chunk):
                    self._owner[id(p)] = (slot, j)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._ready))
                index += 1

    def _ready(self, p: nn.Parameter) -> None:
        self._last_grad_t = time.perf_counter()
        slot, j = self._owner[id(p)]
        state, b = self.buckets[slot]
        b.ready.add(j)
        if len(b.ready) == len(b.params) and b.future is None:
            self._launch(state, b)

    def _launch(self, state: ReducerState, b: Bucket) -> None:
        """Pack the bucket and hand it to the hook. A state that can start its reduction first
        (HostState: the host reducer) gets the bucket packed straight into its shared memory, and
        sums each stage of it while the rest is packed; the hook is not called then."""
        start = getattr(state, "start_bucket", None)
        run = start(b.index(), b.numel, b.flat.device, b.flat.dtype) if start else None
        if run is None:
            b.pack()
            fut = self.hook(state, b)
        else:
            b.flat = run.buffer
            try:
                b.pack(run.deliver, run.stage)
            finally:  # whatever happened, no rank is left waiting for a stage of ours
                run.deliver(b.numel)
            fut = run.future

        def unpack(f: torch.futures.Future, b: Bucket = b) -> bool:
            # on the thread that completed the reduction, while backward goes on: a bucket's
            # parameters get no more gradient this step, so their .grad can be written now
            result = f.value()
            b.unpack(result if isinstance(result, torch.Tensor) else result[0])
            return True

        b.future = fut.then(unpack)

    def wait(self) -> float:
        """Launch buckets whose parameters got no gradient, wait for all, write the sums back.
        Returns the seconds spent waiting (communication not hidden behind the backward pass)."""
        t0 = time.perf_counter()
        for state, b in self.buckets:
            if (
                b.future is None
            ):  # unused parameters: reduce zeros so every rank runs the same collectives
                self._launch(state, b)
        for _, b in self.buckets:
            b.future.wait()  # summed and written back (or raises the reduction's error)
            b.future, b.ready = None, set()
        end = time.perf_counter()
        self.wait_s = end - t0
        self.exposed_s = end - (self._last_grad_t or t0)
        return self.wait_s

    def pending(self) -> bool:
        """Whether a backward pass has produced gradients that wait() has not summed yet."""
        return any(b.future is not None or b.ready for _, b in self.buckets)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
