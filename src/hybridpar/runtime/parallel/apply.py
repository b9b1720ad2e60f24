"""How HybridParallel applies a resolved plan to a model on this rank, step by step: the grids,
each segment's style sharding its layers, the redistributions at segment entries, global batch
norm over each style's statistics group, and the gradient synchroniser over each style's
gradient group. Every step that makes process groups runs in the same order on every rank."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpar.core import handoff, ops
from hybridpar.core.errors import ConfigError
from hybridpar.core.halo import tile
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import get_codec
from hybridpar.runtime.comm.grid import GridSet
from hybridpar.runtime.comm.group import pg_of
from hybridpar.runtime.comm.host import leader_groups
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import rounds
from hybridpar.runtime.parallel.batchnorm import BNSwitch, convert_global_batchnorm
from hybridpar.runtime.parallel.dropout import Where, replace_dropouts
from hybridpar.runtime.parallel.kinds import move, runtime_style
from hybridpar.runtime.parallel.layout import Layout
from hybridpar.runtime.parallel.redistribute import Move
from hybridpar.runtime.parallel.reducers import Reducer
from hybridpar.runtime.parallel.styles import BuildContext, ParallelStyle
from hybridpar.runtime.parallel.sync import GradSync

__all__ = [
    "broadcast_parameters",
    "context",
    "global_batchnorm",
    "grad_sync",
    "handoff_rounds",
    "redistributions",
    "shard",
]


def context(
    plan: ParallelPlan,
    layout: Layout,
    options: RuntimeOptions,
    ledger: Ledger | None,
    device: torch.device,
) -> BuildContext:
    """The grids of every segment's style (one per distinct Pc), with the groups that move
    activations between them and the job's timeout, and the plan's codec."""
    pcs = [s.pc for s in layout.segments] + [plan.procs]
    moves = [(a.pc, b.pc) for _, a, b in layout.moves()]
    timeout = datetime.timedelta(seconds=options.timeout_s) if options.timeout_s else None
    grids = GridSet(pcs, moves, device.type, timeout, options.shared_memory, plan.placement)
    codec = get_codec(plan.choices.codec, options.block) if plan.choices.codec != "none" else None
    return BuildContext(grids, plan.choices, options, ledger, codec=codec, device=device)


class _AsTraced:
    """F.interpolate to the size the trace saw where the call names a size: a size read from a
    band of rows (torchvision's heads read the input's at the top of their forward) is a
    band's, and the call runs on a whole image (a layout after the bands)."""

    def __init__(self, size: tuple[int, ...]) -> None:
        self.size = size

    def __call__(self, x, size=None, *args, **kwargs):
        return F.interpolate(x, self.size if size is not None else None, *args, **kwargs)


def shard(model: nn.Module, layout: Layout, styles: list[ParallelStyle]) -> None:
    """Every module of every layer becomes its style's module for this rank (a split layer its
    shard, a domain convolution or pooling its band's)."""
    done: set[str] = set()
    banded = any(s.kind == "domain" for s in layout.segments)
    traced = {s.name: s.out_shape[1:] for s in layout.trace.specs}
    for x in layout.layers:
        for name in x.members:
            if name in done:  # a module called twice (shared weights) is one module
                continue
            done.add(name)
            owner, site, _ = name.partition(":")  # a function's call in a module's own forward
            if site:
                style = styles[x.segment]
                _, func, k = ops.site_func(name)
                if banded and style.kind != "domain" and func is F.interpolate:
                    ops.install_site(model.get_submodule(owner), func, k, _AsTraced(traced[name]))
                style.site(name, model.get_submodule(owner), x)
                continue
            old = model.get_submodule(name)
            new = styles[x.segment].shard(name, old, x)
            if new is not old:  # under every name of the module (a module registered twice)
                ops.swap_module(model, old, new)


def redistributions(model: nn.Module, layout: Layout, ctx: BuildContext) -> list:
    """A forward pre-hook at each segment entry where the layout changes, and at the model's
    input when the first segment's layout is not the input's (the input comes in whole, split
    by examples over the first style's batch groups); returns the handles."""
    first = layout.segments[0]
    moves = list(layout.moves())
    if first.layout != Style.model(first.pr, first.pc).layout:
        moves.insert(0, (0, Style.model(first.pr, first.pc), first))
    hooks = []
    for k, src, dst in moves:
        first = layout.first_layer(k)
        m = Move(ctx.grids, ctx.rows, ctx.ledger, first, ctx.activation_codec)
        m.size = layout.size_before(k)
        if k == 0 and len(layout.trace.in_shape) in (3, 4):
            m.fed = layout.trace.in_shape[1:]
        x = layout.entry_layer(k)
        m.whole = k > 0 and x.entry_whole
        m.fused = k > 0 and handoff.fused(x, src, dst, ctx.choices.activations_encoded)
        if m.fused:  # the split layer leaves dX partial; the hand-off reduce-scatters it
            model.get_submodule(layout.entries[k]).hybridpar_split.partial_dx = True
        if layout.handoff(k).scheme != "a":  # sent in rounds: handoff_rounds installs it
            continue
        hook = move(src, dst, m)
        hooks.append(model.get_submodule(layout.entries[k]).register_forward_pre_hook(hook))
    return hooks


def handoff_rounds(model: nn.Module, layout: Layout, ctx: BuildContext) -> list[rounds.Rounds]:
    """Krizhevsky's schemes (b) and (c) where the plan names them: the head of each such hand-off
    runs in rounds (rounds.py); with variable batch the last one steps its head per round. After
    every module is replaced (dropout, batch norm), in segment order on every rank (each makes
    its group)."""
    variable = ctx.options.variable_batch
    if variable:
        why = handoff.why_not_variable_batch(layout.handoffs, layout.segments)
        if why:
            raise ConfigError(why)
    out = []
    last = max(layout.handoffs, default=None)
    for k, src, dst in layout.moves():
        h = layout.handoff(k)
        if h.scheme == "a":
            continue
        first = layout.first_layer(k)
        x = layout.entry_layer(k)
        fused = handoff.fused(x, src, dst, ctx.choices.activations_encoded)
        later = [layout.entries[j] for j, _, _ in layout.moves() if j > k]  # layout changes
        var = variable and k == last
        m = Move(ctx.grids, ctx.rows, ctx.ledger, first, ctx.activation_codec, fused=fused)
        r = rounds.Rounds(m, src.pc, dst.pc, h, var)
        rounds.install(model, layout.entries[k], later, r)
        if var and later:  # the head must end the model (why_not_variable_batch said so)
            raise ConfigError("--variable-batch: the layers after the hand-off must end the model")
        out.append(r)
    return out


def dropouts(
    model: nn.Module,
    layout: Layout,
    styles: list[ParallelStyle],
    ctx: BuildContext,
    seed: int,
    step: Callable[[], int],
) -> list[str]:
    """Counter-based dropout (runtime/parallel/dropout.py) in place of every nn.Dropout and
    nn.Dropout2d: each told which global examples (and, split by height, which rows) its rank's
    activation holds, so its masks are the slices of the ones one process draws."""
    specs = {s.name: s for s in layout.trace.specs}

    def where_of(name: str) -> Where:
        spec = specs.get(name)
        style = styles[spec.segment if spec is not None else 0]
        grid = style.grid

        def first_example() -> int | torch.Tensor:
            if ctx.rows.examples is not None:  # inside a hand-off round (rounds.py)
                return ctx.rows.examples
            return grid.rows(ctx.rows.sizes).start

        if spec is None or style.spec.layout[0] != "dom" or len(spec.in_shape) < 2:
            return Where(step, first_example)
        box = tile(spec.in_shape[1:], grid.pr, style.spec.pw, grid.r)
        first = tuple(a for a, _ in box) if style.spec.pw > 1 else box[0]
        return Where(step, first_example, first, tuple(spec.in_shape))

    return replace_dropouts(model, seed, where_of)


def global_batchnorm(
    model: nn.Module,
    layout: Layout,
    styles: list[ParallelStyle],
    ledger: Ledger | None,
    bn_switch: BNSwitch | None,
) -> None:
    """Every batch norm (any subclass: its own forward stays) over its segment style's statistics
    group, the groups made in segment order on every rank."""
    norms = [
        (name, m, layout.module_segment[name])
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and name in layout.module_segment
    ]
    # a batch norm of a pooled value (whole on every rank of a domain layout's model group):
    # statistics over the ranks holding other examples alone (a batch style's group)
    whole = {n for x in layout.layers for n in x.unchanged}
    groups: dict[tuple[Style, bool], object] = {}
    for name, _, seg in sorted(norms, key=lambda n: n[2]):
        key = (layout.segments[seg], name in whole)
        if key not in groups:  # collective: same groups, same order, everywhere
            st = styles[seg]
            groups[key] = ParallelStyle.bn_group(st) if key[1] else st.bn_group()
    for name, m, seg in norms:
        group = groups[layout.segments[seg], name in whole]
        convert_global_batchnorm(
            m, group, ledger=ledger, switch=bn_switch, layer_of=layout.layer_of, prefix=name
        )


def grad_sync(
    model: nn.Module,
    layout: Layout,
    styles: list[ParallelStyle],
    reducer: Reducer,
    ctx: BuildContext,
    skip: frozenset[int] = frozenset(),
) -> GradSync:
    """Each parameter's gradient summed over the grad group of the style it is used in (a
    parameter no forward uses is replicated everywhere, like a batch layer's); `skip`: ids of
    parameters stepped elsewhere (a variable batch's head, on one model group: nothing to sum)."""
    unused = runtime_style(Style.batch(ctx.grids.world_size), ctx)
    by_key: dict[tuple, tuple[ParallelStyle, list]] = {}
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        seg = layout.param_segment.get(name)
        style = styles[seg] if seg is not None else unused
        named = (layout.layer_of_param(name), p)
        by_key.setdefault(style.grad_key, (style, []))[1].append(named)
    pairs = []
    for (_, pc), (style, named) in sorted(by_key.items()):
        group = style.grad_group
        if reducer.own_groups:  # the reducer's thread: a twin of the key's group, not the
            group = ctx.grids.grad_group(pc)  # style's own grid (domain sums over all P ranks)
        pairs.append((group, named))
    if reducer.host:  # every gradient group's leaders, made by every rank in one order
        reducer.leaders = host_leaders([g for g, _ in pairs], ctx.grids.timeout)
    return GradSync(pairs, ctx.ledger, ctx.options.bucket_bytes, reducer.hook, reducer.state)


def host_leaders(groups: list, timeout) -> dict:
    """The leaders' group (one rank per host) of every group whose sibling this rank holds:
    each rank's gradient groups, gathered, so that every rank makes every leaders' group."""
    mine = [tuple(dist.get_process_group_ranks(pg_of(g))) for g in groups]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    ordered = []
    for i in range(len(mine)):  # the i-th gradient group of every rank: siblings, in rank order
        ordered += sorted({ranks[i] for ranks in every})
    return leader_groups([list(r) for r in ordered], timeout)


@torch.no_grad()
def broadcast_parameters(model: nn.Module, ledger: Ledger | None, sync: GradSync) -> None:
    """Sekiyama's Algorithm 5, sending the parameters once: each parameter from the first rank
    of its gradient group to the rest of it (a shard only to the ranks that hold the same shard),
    every buffer from rank 0 to every rank; logged outside any training step."""
    step, ledger_step = (ledger.step, -1) if ledger else (0, 0)
    if ledger is not None:
        ledger.step = ledger_step
    sent = []
    for group, named in sync.pairs:
        pg = pg_of(group)
        src = min(dist.get_process_group_ranks(pg))
        sent += [(p, pg, src) for _, p in named]
    sent += [(b, dist.group.WORLD, 0) for b in model.buffers()]
    for t, pg, src in sent:
        t0 = time.perf_counter()
        dist.broadcast(t.data, src=src, group=pg)
        if ledger is not None:
            size, took = t.numel() * t.element_size(), time.perf_counter() - t0
            ledger.record("broadcast", dist.get_world_size(pg), size, took, Term.PARAM_BROADCAST)
    if ledger is not None:
        ledger.step = step
