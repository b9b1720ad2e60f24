"""What the trace follows for the domain style beside the dataflow (core.analysis's recorder):
values a global pooling made whole, bands whose rows a permute moved off dim 2, the calls in a
module's own forward that are layers of their own (sites: core.operations' `call`, global
poolings), and the functions that mix rows (core.rows). The recorder hands it every torch
function called outside a leaf (`function`) and every leaf's spec (`leaf`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from hybridpar.core import ops
from hybridpar.core.halo import TILED
from hybridpar.core.leaves import LayerSpec
from hybridpar.core.operations import pooling
from hybridpar.core.rows import (
    DIMS_READ,
    column_blocker,
    function_blocker,
    global_pool,
    moved_rows,
    permuted_blocker,
)

__all__ = ["Bands"]


def _tensors_in(out) -> bool:
    return isinstance(out, torch.Tensor) or (
        isinstance(out, tuple | list) and any(isinstance(t, torch.Tensor) for t in out)
    )


Key = tuple[int, int]


class Bands:
    """The domain style's view of one traced forward; `key` names a value (the recorder's)."""

    def __init__(self, key: Callable[[torch.Tensor], Key]) -> None:
        self.key = key
        self.blocked: list[tuple[int, str]] = []  # (time, why) of functions that mix rows
        self.sites: list[tuple[int, LayerSpec]] = []  # calls that are layers of their own
        self.owner: Callable[[], str] = lambda: ""  # the module whose own forward runs now
        self.site_counts: dict[tuple[str, Callable], int] = {}
        self.whole: set[Key] = set()  # values a global pooling made whole
        self.rowdim: dict[Key, int] = {}  # bands whose rows a permute moved off dim 2
        # per leaf running: None, or for a module of no known operation and no state of its
        # own (MONAI's ChannelPad), why the functions its forward calls mix rows: none, and it
        # keeps rows apart
        self.inside: list[list[str] | None] = []

    def enter(self, module: nn.Module) -> None:
        stateless = next(iter([*module.parameters(False), *module.buffers(False)]), None) is None
        self.inside.append([] if stateless and ops.operation_of(module) is None else None)

    def leave(self) -> list[str] | None:
        return self.inside.pop()

    def inner(self, func, args, kwargs, out) -> None:
        """A torch function inside such a module: why it mixes rows (or columns), if it does."""
        if _tensors_in(out):
            why = function_blocker(func, args, kwargs) or column_blocker(func, args)
            if why:
                self.inside[-1].append(why)

    def inputs(self, xs: list[torch.Tensor]) -> tuple[list[bool], list[int]]:
        """Per activation of a call (read before the call's outputs get their keys): whether it
        is whole, and the dim that holds its rows."""
        return [self.key(x) in self.whole for x in xs], [self.rows_at(x) for x in xs]

    def made_whole(self, ys: list[torch.Tensor]) -> None:
        self.whole.update(self.key(y) for y in ys)

    def rows_at(self, x: torch.Tensor) -> int:
        """The dim of `x` that holds the image's rows (2 unless a permute moved them)."""
        return self.rowdim.get(self.key(x), 2)

    def place(self, ys: list[torch.Tensor], at: int) -> None:
        for y in ys:
            if at == 2:
                self.rowdim.pop(self.key(y), None)
            else:
                self.rowdim[self.key(y)] = at

    def function(self, func, args, kwargs, out, outs: list, seen: tuple, t: int) -> None:
        """A torch function called outside a leaf at time t: a site, a whole value's function,
        a global pooling, a permute of a band, or a function that keeps rows apart or not."""
        whole, at = seen
        k = self.count(func)
        off = [a for a in at if a != 2]  # a permuted band's rows are elsewhere
        op = ops.site_operation(func) if isinstance(out, torch.Tensor) and not off else None
        spec = None
        if op is not None and (op.bands == "resample" or not (whole and all(whole))):
            spec = self.site(func, k, args, kwargs, out, all(whole), op=op)
        if spec is not None:  # a layer of its own (not a pad of other dims than the rows)
            self.sites.append((t, spec))
            return
        if whole and all(whole):  # a whole value's function: whole too
            self.made_whole(outs)
            return
        how = global_pool(func, args, kwargs) if not off else ""
        if how and k is not None and isinstance(out, torch.Tensor):  # a global pooling
            self.sites.append((t, self.site(func, k, args, kwargs, out, how=how)))
            self.made_whole(outs)
            return
        moved = moved_rows(func, args, kwargs, at[0]) if at else None
        if moved is not None:  # the rows move to another dim, none mixes with another
            self.place(outs, moved)
            self.blocked.append((t, column_blocker(func, args)))
            return
        why = function_blocker(func, args, kwargs) or column_blocker(func, args)
        name = getattr(func, "__name__", "")
        if why and whole[:1] == [True] and name == "expand_as":
            why = ""  # a whole value broadcast to the band
        if off and (why or name in DIMS_READ or ops.site_operation(func)):
            why = f"{name} of a permuted band"  # it would read the rows as dim 2
        elif off:
            self.place(outs, off[0])  # element by element: the rows stay where they are
        if why:
            self.blocked.append((t, why))

    def count(self, func: Callable) -> int | None:
        """k of this call of a function a style may take in its owner's forward (core.ops.SITES:
        every call counts, as install_site counts them); None for other functions."""
        if not ops.site_key(func):
            return None
        at = (self.owner(), func)
        k = self.site_counts[at] = self.site_counts.get(at, -1) + 1
        return k

    def site(self, func, k: int, args: tuple, kwargs: dict | None, out, spread=False, how="",
             op=None) -> LayerSpec | None:  # fmt: skip
        """A call in a module's own forward that is a layer of its own (an F.interpolate,
        `spread` of a whole value; an F.pixel_shuffle: core.operations' `call`), or a global
        pooling (`how`): core.ops.site_name, the domain style takes that call."""
        x = args[0] if args else (kwargs or {}).get("input")
        shapes = dict(in_shape=tuple(x.shape[1:]), out_shape=tuple(out.shape[1:]))
        name = ops.site_name(self.owner(), func, k)
        if how:
            return LayerSpec(name, "pool", func.__name__, **shapes, op="global_pool",
                             rows=("global", how))  # fmt: skip
        fields, why = op.call(func, args, kwargs or {}, *shapes.values())
        if fields is None:
            return None
        if spread and fields.get("rows", ())[:1] == ("resample",):
            fields["rows"] = ("spread", fields["rows"][1])
        return LayerSpec(name, op.kind, func.__name__, **shapes, **fields, op=op.name,
                         blocker=why)  # fmt: skip

    def leaf(self, spec: LayerSpec, module: nn.Module, seen: tuple, ndim: int, outs) -> LayerSpec:
        """A leaf's spec as the domain style sees it, from what its input was (`seen`)."""
        whole, at = seen[0][:1] == [True], (seen[1] or [2])[0]
        return self._permuted(self._whole(spec, module, whole, outs), module, at, ndim, outs)

    def _whole(self, spec: LayerSpec, module: nn.Module, whole: bool, outs) -> LayerSpec:
        """A leaf on a whole value runs unchanged (whole, or an upsampling of it to bands:
        spread); a global pooling of bands makes its value whole."""
        op = ops.operation_of(module)
        global_ = op is not None and op.bands == "global"
        indices = getattr(module, "return_indices", False)
        how = pooling(op, module.output_size, indices) if global_ else ""
        if whole:
            spread = spec.rows[:1] == ("resample",)
            if not spread:
                self.made_whole(outs)
            rows = ("spread", spec.rows[1]) if spread else spec.rows
            return replace(spec, blocker="", whole=not spread, rows=rows)
        if how:
            self.made_whole(outs)
            return replace(spec, blocker="", op="global_pool", rows=("global", how))
        return spec

    def _permuted(self, spec: LayerSpec, module: nn.Module, at: int, ndim: int, outs) -> LayerSpec:
        """A leaf on a band whose rows a permute moved (dim `at`): a layer norm or a Linear over
        the channels runs on it unchanged, the rows staying at `at`; a layer norm or Linear over
        the rows is refused wherever they are."""
        over = isinstance(module, nn.LayerNorm | nn.Linear)  # over its input's last dims
        if spec.whole or ndim < 3 or (at == 2 and not (over and spec.blocker)):  # (C, H, W)
            return spec
        self.place(outs, at)
        where = "over the columns" if at == 2 else "on a permuted band"
        why = permuted_blocker(module, at, ndim) or f"{TILED}{spec.type} {where}"
        return replace(spec, blocker=why, permuted=at % ndim)
