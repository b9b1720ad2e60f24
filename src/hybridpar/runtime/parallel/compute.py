"""What an engine does to each rank's compute once the plan is applied: torch.compile and
activation checkpointing (RuntimeOptions.compile; the plan's choice activation_checkpointing, which
the planner prices), for either engine.

Compiling: every largest part of the model that is plain torch (no hybridpar module in it, no
hook on it: hybridpar's collectives, hand-offs, halos, global batch norms and counter-based
dropouts live in such modules and hooks) is compiled in place (`torch.compile`): a module, or a
run of consecutive children of an nn.Sequential as one function. The collectives stay eager,
outside every compiled region, and the user's model class is untouched. A part of one operation
(a lone convolution between two collectives) is left eager: nothing to fuse, and each compiled
part costs its guards and wrappers on every call (measured: docs/runtime.md). Checkpointed
modules are compiled inside only (what is plain in them).

Checkpointing: each module whose name matches one of the patterns (`fnmatch`, outermost match
only), and each segment `A..B` of an nn.Sequential's children (run as one), runs its forward under
torch's non-reentrant `torch.utils.checkpoint`, which keeps its input and recomputes its forward
in backward. The recompute sees what the forward saw: the random state
(torch restores it; hybridpar's dropout masks are a function of the step and the example), and
every batch norm's running statistics are put back after it, so they are updated once per step as
without checkpointing. Collectives inside a checkpointed module run again in the recompute, on
every rank in the same backward order; the ledger books them under the term `recompute` (bytes
the plan does not predict, shown apart).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from hybridpar.core.errors import ConfigError
from hybridpar.runtime.comm.ledger import Ledger

__all__ = ["checkpoint_modules", "compile_plain", "matching"]


def matching(model: nn.Module, patterns: tuple[str, ...], layout=None) -> list[list[str]]:
    """What `patterns` checkpoint, each a run of sibling modules recomputed as one: the outermost
    modules a glob matches (a run of one each), or a segment `A..B` of a Sequential's children
    from A to B. A one-line error: a pattern matching nothing, a segment that is not one or that
    overlaps another in part, and with the plan's `layout`, a segment that crosses the entry of
    a plan segment (its hooks would run twice) or a hand-off sent in rounds."""
    handoffs, entries = (layout.handoffs, layout.hooked()) if layout else ({}, set())
    if patterns and handoffs:
        raise ConfigError(
            "--activation-checkpointing cannot recompute a hand-off sent in rounds "
            "(--handoff b or c); use --handoff a"
        )
    names = [n for n, _ in model.named_modules() if n]
    top = ", ".join(n for n, _ in model.named_children())
    runs: list[list[str]] = []
    for pat in patterns:
        if ".." in pat:
            runs.append(_segment(model, pat))
            continue
        hits = [[n] for n in names if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise ConfigError(
                f"--activation-checkpointing pattern {pat!r} matches no module; "
                f"the model's top-level modules are: {top}"
            )
        runs += hits
    runs = [r for i, r in enumerate(runs) if r not in runs[:i]]
    for r in runs:
        inside = [n for n in r[1:] if n in entries]
        if inside:
            raise ConfigError(
                f"--activation-checkpointing segment {r[0]}..{r[-1]} crosses the entry of a "
                f"plan segment at {inside[0]}, which the runtime hooks (a layout change, or the "
                f"random state of a style split over model groups); end it before {inside[0]}"
            )
    out = []
    for r in runs:  # what lies inside another run is recomputed with it
        others = [o for q in runs if q is not r for o in q]
        under = [any(n == o or n.startswith(o + ".") for o in others) for n in r]
        if any(under) and not all(under):
            raise ConfigError(
                f"--activation-checkpointing: {r[0]}..{r[-1]} overlaps another segment in part; "
                "make them disjoint or nested"
            )
        if not all(under):
            out.append(r)
    return out


def _segment(model: nn.Module, pat: str) -> list[str]:
    a, _, b = pat.partition("..")
    parent, _, _ = a.rpartition(".")
    try:
        container = model.get_submodule(parent) if parent else model
    except AttributeError:
        container = None
    kids = [
        f"{parent}.{n}" if parent else n for n, _ in (container or nn.Module()).named_children()
    ]
    wrong = a not in kids or b not in kids or kids.index(a) > kids.index(b)
    if wrong or type(container).forward is not nn.Sequential.forward:
        raise ConfigError(
            f"--activation-checkpointing segment {pat!r}: A..B names two children of one "
            f"nn.Sequential, first and last (e.g. 0..12 of a Sequential model)"
        )
    return kids[kids.index(a) : kids.index(b) + 1]


@contextlib.contextmanager
def _recomputing(run: list[nn.Module], ledger: Ledger | None):
    """Around a recompute: the batch norms' running statistics as they were before it, and its
    collectives booked as `recompute`."""
    saved = [
        (b, b.clone())
        for top in run
        for m in top.modules()
        if isinstance(m, _BatchNorm)
        for b in m.buffers()
    ]
    was = ledger.recomputing if ledger is not None else False
    if ledger is not None:
        ledger.recomputing = True
    try:
        yield
    finally:
        if ledger is not None:
            ledger.recomputing = was
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_hooks)


def _as_one(mods: list[nn.Module], wrap) -> None:
    """Run sibling modules `mods` (consecutive children of an nn.Sequential) as one function,
    `wrap`ped: the first module's forward runs them all, the others pass their input on when the
    Sequential calls them (their own forward runs inside the first's)."""
    inside = [False]

    def forward(*args, first=mods[0].forward, rest=mods[1:], **kw):
        inside[0] = True
        try:
            x = first(*args, **kw)
            for m in rest:
                x = m(x)
        finally:
            inside[0] = False
        return x

    def passing(x, own):
        return own(x) if inside[0] else x

    mods[0].forward = wrap(forward)
    for m in mods[1:]:
        m.forward = functools.partial(passing, own=m.forward)
    for m in mods:
        m.hybridpar_wrapped = True  # what compile_plain leaves alone


def checkpoint_modules(
    model: nn.Module, patterns: tuple[str, ...], layout, ledger: Ledger | None
) -> list[str]:
    """Activation checkpointing of what `patterns` match (`matching`); returns their names. A
    segment runs as one (`_as_one`) under one checkpoint; no module after its first may carry a
    hook (the entry of a plan segment, where activations move: end the segment before it)."""
    out = []
    for run in matching(model, patterns, layout):
        mods = [model.get_submodule(n) for n in run]
        late = [n for n, m in zip(run[1:], mods[1:], strict=True) if _hooked(m)]
        if len(run) > 1 and mods[0]._forward_hooks:  # it would see the segment's output
            late.insert(0, run[0])
        if late:  # a hook of the user's, or one `matching` could not see (no layout)
            raise ConfigError(
                f"--activation-checkpointing segment {run[0]}..{run[-1]} crosses a hook at "
                f"{late[0]} (it would run twice); end the segment before {late[0]}"
            )
        contexts = functools.partial(
            lambda mods: (contextlib.nullcontext(), _recomputing(mods, ledger)), mods
        )
        _as_one(
            mods,
            lambda f, c=contexts: functools.partial(
                checkpoint, f, use_reentrant=False, context_fn=c
            ),
        )
        out.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}")
    return out


def _plain(m: nn.Module) -> bool:
    ours = type(m).__module__.startswith("hybridpar.runtime.") or hasattr(m, "hybridpar_wrapped")
    return not _hooked(m) and not ours and all(_plain(c) for c in m.children())


def _ops(mods: list[nn.Module]) -> int:
    return sum(1 for top in mods for m in top.modules() if not list(m.children()))


def compile_plain(model: nn.Module, backend: str) -> list[str]:
    """torch.compile every largest plain-torch part of `model` in place: a module, or a run of an
    nn.Sequential's consecutive children (as one, `_as_one`), with at least two operations to
    fuse (a lone convolution compiled costs its guards and gains nothing); returns their names."""
    out: list[str] = []

    def compiled(names: list[str], mods: list[nn.Module]) -> None:
        if _ops(mods) < 2:
            return
        # not nn.Module.compile: in torch 2.13 a module compiled so runs eager
        if len(mods) == 1:
            mods[0].forward = torch.compile(mods[0].forward, backend=backend)
        else:
            _as_one(mods, lambda f: torch.compile(f, backend=backend))
        out.append(names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}")

    def walk(prefix: str, m: nn.Module) -> None:
        if _plain(m):
            return compiled([prefix or "(model)"], [m])
        kids = [(f"{prefix}.{n}" if prefix else n, c) for n, c in m.named_children()]
        if type(m).forward is not nn.Sequential.forward:
            for name, c in kids:
                walk(name, c)
            return
        run: list = []
        for name, c in [*kids, ("", None)]:  # runs of plain children, compiled as one
            if c is not None and _plain(c):
                run.append((name, c))
                continue
            if run:
                compiled([n for n, _ in run], [c for _, c in run])
                run = []
            if c is not None:
                walk(name, c)

    walk("", model)
    # twins share a code object (every Conv2d's forward) and Dynamo compiles it once per shape,
    # up to its recompile limit per code object; beyond it a part would run eager, unsaid
    limits = torch._dynamo.config
    limits.recompile_limit = max(limits.recompile_limit, 8 + 2 * len(out))
    return out
