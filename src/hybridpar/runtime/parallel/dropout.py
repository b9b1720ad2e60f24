"""Dropout masks that do not depend on P or the grid, and the same random streams on replicas.

**Counter-based dropout.** `CounterDropout` replaces `nn.Dropout` and `nn.Dropout1d/2d/3d`: each mask
element is a hash (splitmix64's finaliser, in int64 tensor arithmetic) of (seed, step, module,
global example index, global feature index), so a rank that holds examples 4..7, or rows 3..5 of
an image split by height, draws exactly the slice of the mask one process draws for the whole
batch. Training is then the same on 1, 2, 3 or 4 ranks and on any grid, and a run resumed onto
another grid goes on as the same run (the step comes from the engine's step counter, which
checkpoints keep). `counter_dropout(model, seed)` puts the same modules into a single-process
model: the oracle draws its masks the same way.

Where a mask is drawn is `Where`: the engine tells each module the first global example its rank
holds and, in a layout split by height, the first row of its band and the whole height.

**Same streams on replicas.** Random operations other than dropout modules (`F.dropout` called in
`forward`, `torch.bernoulli` in stochastic depth) still draw from torch's generator; replicas in a
model group (a layout with Pr > 1) compute the same activations, so `SameRandom` seeds the
generator at each segment's entry from (seed, step, segment, the style's random key: the batch
group where the layout is replicated, the rank where it is not), and restores the caller's
generator state after the forward. Those draws depend on the grid; dropout modules do not.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridpar.core import ops

__all__ = ["CounterDropout", "SameRandom", "Where", "counter_dropout", "uniform"]

_M64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """A 64-bit pattern as the signed int64 torch holds."""
    c &= _M64
    return c - (1 << 64) if c >= 1 << 63 else c


_K1, _K2, _GOLD = _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB), _s64(0x9E3779B97F4A7C15)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 multiplication wraps modulo 2^64."""
    z = (z ^ _srl(z, 30)) * _K1
    z = (z ^ _srl(z, 27)) * _K2
    return z ^ _srl(z, 31)


def _mix_int(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(
    seed: int, step: int, key: int, examples: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per (example, feature) pair of the broadcast of
    `examples` (int64, global example indices) and `features` (int64, global feature indices)."""
    base = _s64(_mix_int(_mix_int(_mix_int(seed) ^ step) ^ key))
    h = _mix(examples * _GOLD + base)
    h = _mix(h ^ (features * _K2 + _GOLD))
    return _srl(h, 11).to(torch.float64) * 2.0**-53


@dataclass
class Where:
    """What a rank's activation holds of the global one at a dropout module, read at each call:
    the step, the first global example (or, in a hand-off round, the global index of each), and for a layout split by height the first row of the
    band and the whole per-example shape (None: the rank holds whole examples)."""

    step: Callable[[], int]
    first_example: Callable[[], int | torch.Tensor] = lambda: 0
    first_row: int | tuple[int, int] = 0  # on tiles: the tile's first row and column
    shape: tuple[int, ...] | None = None


class CounterDropout(nn.Module):
    """nn.Dropout (elements) or nn.Dropout1d / 2d / 3d (whole channels) with counter-based
    masks."""

    def __init__(self, p: float, inplace: bool, channels: bool, key: int, seed: int, where: Where):
        super().__init__()
        self.p, self.inplace, self.channels = p, inplace, channels
        self.key, self.seed, self.where = key, seed, where

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        w, n = self.where, x.shape[0]
        e0 = w.first_example()
        if isinstance(e0, torch.Tensor):  # a hand-off round's examples (runtime/parallel/rounds)
            examples = e0.to(x.device).view(n, *[1] * (x.dim() - 1))
        else:
            examples = torch.arange(e0, e0 + n, dtype=torch.int64, device=x.device).view(
                n, *[1] * (x.dim() - 1)
            )
        local = list(x.shape[1:])
        shape = list(w.shape) if w.shape is not None else local
        offsets = [0] * len(local)
        if w.shape is not None and len(local) >= 2:
            first = w.first_row if isinstance(w.first_row, tuple) else (w.first_row,)
            offsets[1 : 1 + len(first)] = first  # (C, H, W): the band's rows (tile's columns)
        if self.channels:  # one draw per channel, broadcast over the rest
            local, shape, offsets = local[:1], shape[:1], offsets[:1]
        index = torch.zeros([1] * (1 + len(local)), dtype=torch.int64, device=x.device)
        stride = 1
        for d in reversed(range(len(local))):
            view = [1] * (1 + len(local))
            view[1 + d] = local[d]
            index = (
                index
                + (torch.arange(local[d], dtype=torch.int64, device=x.device) + offsets[d]).view(
                    view
                )
                * stride
            )
            stride *= shape[d]
        u = uniform(self.seed, w.step(), self.key, examples, index)
        keep = (u >= self.p).to(x.dtype)  # drawn where x lives: no host round trip
        if self.channels:  # (n, C): of no examples too (a batch group without any)
            keep = keep.view(n, x.shape[1], *[1] * (x.dim() - 2))
        return keep / (1 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x.mul_(0.0) if self.inplace else x * 0.0
        m = self.mask(x)
        return x.mul_(m) if self.inplace else x * m

    def extra_repr(self) -> str:
        return f"p={self.p}, counter-based{', channels' if self.channels else ''}"


def module_key(name: str) -> int:
    """A module's key in the hash: its qualified name's CRC (the same on every rank and run)."""
    return zlib.crc32(name.encode())


def replace_dropouts(model: nn.Module, seed: int, where_of: Callable[[str], Where]) -> list[str]:
    """Every nn.Dropout / Dropout1d / 2d / 3d of `model` becomes a CounterDropout (in place, under
    every name it has: keyed by its first); returns their names."""
    names = []
    for name, m in list(model.named_modules()):
        if type(m) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
            channels = type(m) is not nn.Dropout  # whole channels (of a sequence, image, volume)
            new = CounterDropout(m.p, m.inplace, channels, module_key(name), seed, where_of(name))
            new.train(m.training)
            ops.swap_module(model, m, new)
            names.append(name)
    return names


class _Count:
    """A single-process model's step: its training forwards so far."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        return self.n


def counter_dropout(model: nn.Module, seed: int = 0) -> nn.Module:
    """Put counter-based dropout into a single-process model (in place; returns it): the masks
    `hybridpar` draws on any grid with the same seed (RuntimeOptions.seed, `--seed`). The step is
    the model's count of training forwards, starting at 0 (call the model once per step)."""
    count = _Count()

    def tick(module: nn.Module, args: tuple, output: object) -> None:
        if module.training:
            count.n += 1

    replace_dropouts(model, seed, lambda name: Where(count))
    model.register_forward_hook(tick)
    return model


class SameRandom:
    def __init__(self, seed: int, keys: Sequence[int]) -> None:
        self.seed, self.keys = seed, list(keys)
        self.step = 0
        self.saved: torch.Tensor | None = None
        self.saved_cuda: torch.Tensor | None = None

    def enter(self, seg: int) -> None:
        # the generators this process draws from, not torch.manual_seed: that one also queues a
        # seeding of every lazy device kind (cuda, xpu, mtia) with a captured stack each time,
        # which would be paid at every segment of every step
        seed = (self.seed * 1_000_003 + self.step * 1_009 + seg * 10_007 + self.keys[seg]) % 2**63
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)

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
