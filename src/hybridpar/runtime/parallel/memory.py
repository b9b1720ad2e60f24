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

__all__ = ["Kept", "peak_bytes", "state_bytes"]


class Kept:
    """While entered, counts the bytes of every storage a forward saves for backward."""

    def __init__(self, model: nn.Module) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
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
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(
            p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None
        ),
        "optimizer": sum(v.numel() * v.element_size() for v in state),
    }


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
