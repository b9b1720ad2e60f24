"""What a forward pass in evaluation holds at once (core.analysis's last run of the model): every
tensor a torch function returns is counted by its storage from its birth until the last tensor
on that storage is gone, the input included, parameters and buffers left out (a function mode,
as the trace's own: a dispatch mode would import torch._dynamo, seconds of every plan); per leaf
module, the most held while it runs (and the functions after it, before the next leaf). It is
what an inference's peak is made of: the skip connections a U-Net keeps for its decoder, an
output and the input it is computed from. On the meta device it costs nothing at any size."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from hybridpar.core import ops

__all__ = ["held_at_once", "peak_of"]


class _Held(TorchFunctionMode):
    """Bytes held by the tensors operations returned, now and at most per leaf (`per`)."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.now, self.current = start, ""
        self.per: dict[str, int] = {}
        self.before: dict[str, int] = {}  # held as the leaf starts (its input among it)
        self.storages: dict[int, list[int]] = {}  # storage -> [bytes, tensors on it]
        self.tensors: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in self.tensors:
                key = t.untyped_storage()._cdata
                entry = self.storages.setdefault(key, [t.untyped_storage().nbytes(), 0])
                self.now += entry[0] if entry[1] == 0 else 0
                entry[1] += 1
                self.tensors.add(id(t))
                weakref.finalize(t, self._gone, id(t), key)
        self.per[self.current] = max(self.per.get(self.current, 0), self.now)
        return out

    def enter(self, leaf: str) -> None:
        self.current = leaf
        self.before.setdefault(leaf, self.now)

    def _gone(self, tensor: int, key: int) -> None:
        self.tensors.discard(tensor)
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.storages[key]


def held_at_once(
    model: nn.Module, state: dict, x: torch.Tensor, leaves: set
) -> dict[str, tuple[float, float]]:
    """Leaf -> (what a forward in evaluation mode holds as it starts, the most it holds while it
    runs), per sample, in elements of the input's type (the model's modules put in evaluation
    mode for it, then back)."""
    names = {m: n for n, m in model.named_modules()}
    modes = {m: m.training for m in model.modules()}
    track = _Held(x.untyped_storage().nbytes())
    handles = [m.register_forward_pre_hook(lambda m, a: track.enter(names[m])) for m in leaves]
    try:
        model.eval()
        with torch.no_grad(), track:
            ops.call_with(model, state, x)
    except Exception:  # a forward that cannot run here: nothing known
        return {}
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    n = x.element_size() * len(x)
    return {k: (track.before.get(k, v) / n, v / n) for k, v in track.per.items() if k}


def peak_of(fn) -> int:
    """The most bytes the tensors operations return while `fn()` runs hold at once (each storage
    once; what existed before, parameters included, left out). Unlike torch's MemTracker it
    takes a module called more than once in a call (a sliding window's)."""
    track = _Held(0)
    with torch.no_grad(), track:
        fn()
    return max(track.per.values(), default=0)
