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
only), and each segment `A..B` of an nn.Sequential's children (run as one, by the Sequential's
forward), runs its forward under torch's non-reentrant `torch.utils.checkpoint`, which keeps its
input and recomputes its forward in backward. The recompute sees what the forward saw: the random
state (torch restores it; hybridpar's dropout masks are a function of the step and the example),
and every batch norm's running statistics are put back after it, so they are updated once per
step as without checkpointing. Collectives inside a checkpointed module run again in the
recompute, on every rank in the same backward order, and so do the hooks of the modules inside a
segment (the plan's layout changes at the entries of its segments, a user's hook): once in the
forward and once in the recompute, as a module's own code would. The ledger books the recomputed
collectives under the term `recompute` (bytes the plan does not predict, shown apart). Only a
hand-off sent in rounds cannot be recomputed (its rounds step the head themselves).
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
    overlaps another in part, and with the plan's `layout`, a plan with a hand-off sent in
    rounds. `hybridpar train` asks it before any rank starts."""
    if patterns and layout is not None and layout.handoffs:
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
    module of its own runs its forward under a checkpoint; a segment of an nn.Sequential's
    children runs under one checkpoint from the Sequential's forward, so that every module in it
    is called once, its hooks included (and once more in the recompute)."""
    out = []
    segments: dict[str, list[list[str]]] = {}  # Sequential -> its checkpointed runs
    for run in matching(model, patterns, layout):
        mods = [model.get_submodule(n) for n in run]
        for m in mods:
            m.hybridpar_wrapped = True  # compiled inside only (compile_plain)
        if len(run) > 1:
            segments.setdefault(run[0].rpartition(".")[0], []).append(run)
        else:
            context = functools.partial(_contexts, mods, ledger)
            mods[0].forward = functools.partial(
                checkpoint, mods[0].forward, use_reentrant=False, context_fn=context
            )
        out.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}")
    for parent, runs in segments.items():
        _checkpoint_children(model.get_submodule(parent), runs, ledger)
    return out


def _contexts(mods: list[nn.Module], ledger: Ledger | None):
    return contextlib.nullcontext(), _recomputing(mods, ledger)


def _checkpoint_children(seq: nn.Sequential, runs: list[list[str]], ledger: Ledger | None) -> None:
    """`seq`'s forward with each run of its children (full names) under one checkpoint."""
    kids = list(seq._modules)
    spans = {kids.index(r[0].rpartition(".")[2]): kids.index(r[-1].rpartition(".")[2]) + 1
             for r in runs}  # fmt: skip

    def run_span(x, a: int, b: int):
        for m in list(seq._modules.values())[a:b]:
            x = m(x)
        return x

    def forward(x):
        mods, i = list(seq._modules.values()), 0
        while i < len(mods):
            if i in spans:
                a, b = i, spans[i]
                context = functools.partial(_contexts, mods[a:b], ledger)
                x = checkpoint(run_span, x, a, b, use_reentrant=False, context_fn=context)
                i = b
                continue
            x = mods[i](x)
            i += 1
        return x

    seq.forward = forward
    seq.hybridpar_wrapped = True


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
