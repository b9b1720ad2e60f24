"""The same dropout masks on the ranks that compute the same activations.

Replicas in a model group (a layout with Pr > 1) compute the same activations, so they must draw
the same random numbers (dropout masks). At each segment's entry the generator is seeded from
(seed, step, segment, the style's random key: the batch group where the layout is replicated,
the rank where it is not); the caller's generator state is restored after the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["SameRandom"]


class SameRandom:
    def __init__(self, seed: int, keys: Sequence[int]) -> None:
        self.seed, self.keys = seed, list(keys)
        self.step = 0
        self.saved: torch.Tensor | None = None
        self.saved_cuda: torch.Tensor | None = None

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

    def attach(self, model: nn.Module, entries: dict[int, str]) -> list:
        """Hooks on `model` (its forward) and on each segment's entry module; returns them."""
        hooks = [
            model.register_forward_pre_hook(self.start),
            model.register_forward_hook(self.stop),
        ]
        for k, at in entries.items():
            if k:
                hook = functools.partial(lambda seg, _m, _a: self.enter(seg), k)
                hooks.append(model.get_submodule(at).register_forward_pre_hook(hook))
        return hooks
