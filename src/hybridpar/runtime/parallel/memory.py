"""What a training step holds on one rank, counted from the tensors themselves rather than the
allocator's pages: its parameters, their gradients, the optimizer's state, and what autograd
keeps for the backward pass (each storage once, the parameters' aside), counted as the forward
saves it. The planner predicts the same sum (planning.cost.memory.kept: the same tensors, traced
whole); the resident peak (VmHWM) or the CUDA allocator's peak, beside it in the report, adds
the allocator's pages, the libraries and the data. `peak_bytes` measures a call's peak as torch's
own MemTracker does: what the planner's peak (plan.memory_bytes) predicts."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Kept", "peak_bytes", "state_bytes"]


class Kept:
    """While entered, counts the bytes of every storage a forward saves for backward."""

    def __init__(self, model: nn.Module) -> None:
        self.skip = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):  # a sharded one gathered for its layer (FSDP2)
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in self.skip:
            self.seen.add(ptr)  # a view of a larger tensor (a rank's rows of the batch): its own
            self.bytes += min(storage.nbytes(), t.numel() * t.element_size())
        return t

    def __enter__(self) -> Kept:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, their gradients and the optimizer's state."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    state = [_local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(g.numel() * g.element_size() for g in grads),
        "optimizer": sum(v.numel() * v.element_size() for v in state),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t` (a sharded state's DTensor: its shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def peak_bytes(fn, *tracked) -> int:
    """The most bytes of tensors held at once while `fn()` runs (on its busiest device), as
    torch.distributed._tools.mem_tracker.MemTracker counts them: each storage once, `tracked`
    modules' and optimizers' parameters, gradients and states included."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        fn()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
