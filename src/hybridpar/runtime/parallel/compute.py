"""What an engine does to each rank's compute once the plan is applied: torch.compile and
activation checkpointing (RuntimeOptions.compile, .activation_checkpointing), for either engine.

Compiling: every largest subtree of the model that is plain torch (no hybridpar module in it, no
hook on it: hybridpar's collectives, hand-offs, halos, global batch norms and counter-based
dropouts live in such modules and hooks) has its `forward` compiled in place (`torch.compile`), and so has
the `compute` of each of hybridpar's split layers and bands (a shard's convolution or matrix
product, between its collectives): the collectives stay eager, outside every compiled region, and
the user's model class is untouched.

Checkpointing: each module whose name matches one of the patterns (`fnmatch`, outermost match
only) runs its forward under torch's non-reentrant `torch.utils.checkpoint`, which keeps its input
and recomputes its forward in backward. The recompute sees what the forward saw: the random state
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


def matching(
    model: nn.Module, patterns: tuple[str, ...], handoffs: dict | None = None
) -> list[list[str]]:
    """What `patterns` checkpoint, each a run of sibling modules recomputed as one: the outermost
    modules a glob matches (a run of one each), or a segment `A..B` of a Sequential's children
    from A to B. A pattern matching nothing, a segment that is not one, or a plan with a hand-off
    sent in rounds (`handoffs`: the layout's) is a one-line error."""
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
        runs += [h for h in hits if h not in runs]
    inside = {n for r in runs for n in r}
    return [r for r in runs if not any(r[0].startswith(o + ".") for o in inside)]


def _segment(model: nn.Module, pat: str) -> list[str]:
    a, _, b = pat.partition("..")
    parent, _, _ = a.rpartition(".")
    container = model.get_submodule(parent) if parent else model
    kids = [f"{parent}.{n}" if parent else n for n, _ in container.named_children()]
    if type(container).forward is not nn.Sequential.forward or a not in kids or b not in kids:
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


def checkpoint_modules(
    model: nn.Module, patterns: tuple[str, ...], handoffs: dict, ledger: Ledger | None
) -> list[str]:
    """Activation checkpointing of what `patterns` match (`matching`); returns their names. A
    segment's first module runs them all under one checkpoint, the others pass their input on
    (their own forward runs inside it); no module after the first may carry a hook (the entry
    of a plan segment, where activations move: end the segment before it)."""
    out = []
    for run in matching(model, patterns, handoffs):
        mods = [model.get_submodule(n) for n in run]
        late = [n for n, m in zip(run[1:], mods[1:], strict=True) if _hooked(m)]
        if len(run) > 1 and mods[0]._forward_hooks:  # it would see the segment's output
            late.insert(0, run[0])
        if late:
            raise ConfigError(
                f"--activation-checkpointing segment {run[0]}..{run[-1]} crosses the entry of a "
                f"plan segment at {late[0]}; end it before {late[0]} or start one there"
            )
        inside = [False]
        first = mods[0].forward

        def forward(*args, first=first, rest=mods[1:], inside=inside, **kw):
            inside[0] = True
            try:
                x = first(*args, **kw)
                for m in rest:
                    x = m(x)
            finally:
                inside[0] = False
            return x

        def passing(x, own, inside=inside):
            return own(x) if inside[0] else x

        contexts = functools.partial(
            lambda mods: (contextlib.nullcontext(), _recomputing(mods, ledger)), mods
        )
        mods[0].forward = functools.partial(
            checkpoint, forward, use_reentrant=False, context_fn=contexts
        )
        for m in mods[1:]:
            m.forward = functools.partial(passing, own=m.forward)
        out.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}")
    return out


def _plain(m: nn.Module) -> bool:
    ours = type(m).__module__.startswith("hybridpar.")
    return not _hooked(m) and not ours and all(_plain(c) for c in m.children())


def compile_plain(model: nn.Module, backend: str) -> list[str]:
    """torch.compile the forward of every largest plain-torch subtree of `model` in place, and
    the `compute` of hybridpar's modules that have one; returns their names."""
    out: list[str] = []

    def walk(prefix: str, m: nn.Module) -> None:
        if _plain(m):
            if list(m.children()) or list(m.parameters()):  # a lone ReLU gains nothing
                # not nn.Module.compile: in torch 2.13 a module compiled so runs eager
                m.forward = torch.compile(m.forward, backend=backend)
                out.append(prefix or "(model)")
            return
        if type(m).__module__.startswith("hybridpar.") and hasattr(m, "compute"):
            m.compute = torch.compile(m.compute, backend=backend)  # a shard's or band's own
            out.append(f"{prefix}.compute")
        for n, c in m.named_children():
            walk(f"{prefix}.{n}" if prefix else n, c)

    walk("", model)
    # twins share a code object (every Conv2d's forward) and Dynamo compiles it once per shape,
    # up to its recompile limit per code object; beyond it a part would run eager, unsaid
    limits = torch._dynamo.config
    limits.recompile_limit = max(limits.recompile_limit, 8 + 2 * len(out))
    return out
