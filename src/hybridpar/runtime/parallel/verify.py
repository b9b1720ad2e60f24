"""A plan that checks itself (issue 71): before the first step, each rank runs one forward and
backward of the plan on a small copy of the problem and compares it with the same step in one
process, which it computes itself.

The copy: the model as given, deep-copied in float64; the batch and the image shrunk to the
smallest the plan's styles still take (the image halved while the plan re-resolved for that size,
with the same styles and grids, runs, and every window stays narrower than what it slides over;
the batch the largest Pc of the plan); a random batch, its targets what the loss compares. The plan runs with its styles, grids, reducer, batch norms and
hand-offs; lossy choices (a codec, bf16) are left out, since they are not exact by design, and
batch norm is global (local statistics are not one process's by design).

The comparison: the mean loss, every leaf module's output (forward hooks on both runs: this rank's
examples of the one process's, its band or tile where it holds one), every parameter's gradient
(its shard where the plan splits it) and every running statistic after the step, in float64 at a
relative tolerance of 1e-6. The
first module that differs, in forward order, is named with its style, in one line, before any
real data is touched: the errors of code nobody here wrote become refusals.

Nothing of the run to come is touched: the copies are the check's own, as are its ledger and its
optimizer (a step of rate 0), and torch's random state is put back. A forward that draws torch's
own random numbers (beside dropout, whose masks are counter-based on every rank and in one
process alike) cannot be drawn alike by one process: the check says so and is skipped.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridpar.core.analysis import trace
from hybridpar.core.errors import ConfigError
from hybridpar.core.halo import bands
from hybridpar.core.plan import ParallelPlan
from hybridpar.core.splits import group_rows
from hybridpar.runtime.comm.collectives import even_split
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import losses
from hybridpar.runtime.parallel.dropout import counter_dropout
from hybridpar.runtime.parallel.layout import Layout, resolve

__all__ = ["Checked", "check_plan"]

RTOL = 1e-6


@dataclass(frozen=True)
class Checked:
    """What the check ran and found: `skipped` says why it could not compare ("" when it did)."""

    batch: int
    shape: tuple[int, ...]
    seconds: float
    skipped: str = ""

    def __str__(self) -> str:
        size = "x".join(map(str, self.shape))
        if self.skipped:
            return f"plan check skipped: {self.skipped}"
        return (
            f"plan checked against one process on a float64 copy ({self.batch} x {size}): "
            f"passed in {self.seconds:.2f} s"
        )


def check_plan(
    model: nn.Module,
    plan: ParallelPlan,
    layout: Layout,
    loss,
    options: RuntimeOptions,
    trainer: type,
) -> Checked:
    """Run the check (collective: every rank calls it, before parallelizing `model`, which it
    leaves as it was) with `trainer` (HybridTrainer) on the copy; raise a one-line ConfigError
    naming the first module that differs."""
    if isinstance(loss, losses.Joined):  # its targets (classes? values?) are the user's to know
        why = "a loss of your own (run on the joined outputs) is not checked on random targets"
        return Checked(plan.batch, tuple(layout.trace.in_shape), 0.0, why)
    t0 = time.perf_counter()
    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        found = _smallest(model, plan, layout, loss, options)
        if isinstance(found, str):
            return Checked(plan.batch, tuple(layout.trace.in_shape), 0.0, found)
        return _compare(model, *found, loss, trainer, options, t0)
    finally:
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state_all(gpu)


def _shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-example shapes to try, smallest first: the image's sides halved k times (ceil), the
    shape itself last."""
    if len(shape) < 3:
        return [shape]
    out: list[tuple[int, ...]] = []
    for k in range(6, 0, -1):
        s = (shape[0], *(-(-d // 2**k) for d in shape[1:]))
        if s not in out and s != shape:
            out.append(s)
    return [*out, shape]


def _smallest(model: nn.Module, plan: ParallelPlan, layout: Layout, loss, options):
    """The smallest copy the plan runs on and one process's step of it: (the plan and layout
    for it, the batch, the one process's outputs and gradients); or why there is none. Every
    rank tries the same sizes in the same order and finds the same one (nothing collective)."""
    choices = plan.choices.with_(codec="none", amp="none", bn="global")
    # the least batch that gives every batch group of every layout an example
    least = next(
        b
        for b in range(max(s.pc for s in layout.segments), plan.batch + 1)
        if b == plan.batch or all(min(group_rows(b, s.pr, s.pc)) for s in layout.segments)
    )
    batches = [plan.batch] if layout.handoffs else sorted({least, plan.batch})
    why = "no smaller copy runs"
    full = tuple(layout.trace.in_shape)
    for batch in batches:
        for shape in [s for s in _shapes(full) if _high(layout, s[1] / full[1])]:
            small = replace(
                plan, batch=batch, input_shape=shape, choices=choices, predicted=[], totals={}
            )
            small.memory_bytes = small.held_bytes = None
            try:
                traced = trace(model, shape, memory=False)
                small_layout = resolve(model, small, shape, plan.procs, traced)
            except ConfigError as exc:
                why = str(exc)
                continue
            if shape != layout.trace.in_shape and not _roomy(small_layout):
                continue
            try:  # one process's step: a size the model itself cannot take is passed over
                reference = _reference(model, small_layout, loss, options)
            except (RuntimeError, ValueError) as exc:
                why = (str(exc).splitlines() or [type(exc).__name__])[0]
                continue
            if isinstance(reference, str):
                return reference
            return (small, small_layout, *reference)
    return f"the plan does not run on a copy with global batch norm and no codec ({why})"


def _high(layout: Layout, scale: float) -> bool:
    """Whether the activations of every layer split by height would still have a row per part
    at `scale` times the height (a quick look before the trace that decides it)."""
    for x in layout.layers:  # the heights core.rules' domain rule reads
        s = layout.styles[x.name]
        whole = x.name in x.unchanged or len(x.x_shape) < 3
        heights = [] if whole else [x.x_shape[1], x.y_shape[1]]
        heights += [w.size_out for w in x.windows]
        heights += [w.size_in for w in x.windows if not w.whole_in]
        if s.kind == "domain" and heights and min(heights) * scale < s.pr // s.pw:
            return False
    return True


def _roomy(layout: Layout) -> bool:
    """Whether every window (a convolution's, a pooling's) is narrower than what it slides over:
    on a smaller copy a window covering all of it gives every pixel the same value, and a batch
    norm of such a channel normalises a constant (a ReLU after it then flips on rounding)."""
    for s in layout.trace.specs:
        if s.kernel is None or s.kind not in ("conv", "pool") or s.rows[:1] == ("transposed",):
            continue
        dilation = s.dilation or (1,) * len(s.kernel)
        sides = zip(s.in_shape[1:], s.kernel, dilation, strict=False)
        if any(k > 1 and side < d * (k - 1) + 2 for side, k, d in sides):
            return False
    return True


def _reference(model: nn.Module, layout: Layout, loss, options):
    """(the batch, one process's outputs of each leaf module and gradients) of the copy's step;
    why it cannot be drawn alike where the forward draws torch's random numbers."""
    shape, batch = tuple(layout.trace.in_shape), layout.plan.batch
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    x, y = _batch(shape, batch, tuple(layout.trace.out_shape), loss, device)
    ref = counter_dropout(_copy64(model), options.seed)
    ref.train()
    seen = _Outputs(ref, _leaves(layout))
    before = torch.get_rng_state()
    try:
        value = loss(ref(x), y)
        value.backward()
    finally:
        seen.remove()
    if not torch.equal(before, torch.get_rng_state()):
        return _RANDOM
    grads = {n: q.grad for n, q in ref.named_parameters()}
    grads.update({n: b for n, b in ref.named_buffers() if b.is_floating_point()})
    return (x, y), seen.calls, value.detach(), grads


def _copy64(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose floating parameters and buffers are float64 copies (each
    made once, whatever shares it), the rest copied as it is."""
    memo: dict[int, object] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and id(t) not in memo:
            new = t.detach().to(torch.float64, copy=True)
            memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(model, memo)


def _leaves(layout: Layout) -> set[str]:
    return {m for x in layout.layers for m in x.members if ":" not in m}


def _batch(shape: tuple[int, ...], n: int, out: tuple[int, ...], loss, device) -> tuple:
    """A random global batch of `n` examples of `shape`, and targets of outputs `out` per
    example: class indices, or values where the loss compares values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((n, *shape), generator=g, dtype=torch.float64)
    func, _ = losses._parts(loss)
    if func in losses._PER_ELEMENT:
        y = torch.rand((n, *out), generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, max(out[0], 1), (n, *out[1:]), generator=g)
    return x.to(device), y.to(device)


class _Outputs:
    """Every leaf module's outputs in call order (forward hooks), by the module's first name."""

    def __init__(self, model: nn.Module, names: set[str]) -> None:
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.handles = [
            m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n in names
        ]

    def _hook(self, name: str):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                self.calls.append((name, out.detach().clone()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _compare(model, plan, layout, data, want, value, grads, loss, trainer, options, t0):
    """The plan's step of the copy against one process's; a ConfigError where it differs."""
    shape, batch = tuple(layout.trace.in_shape), plan.batch
    x, y = data
    # the plan: a copy of its own, its own ledger and a step that changes nothing
    quiet = replace(options, compile=False, variable_batch=False)
    par = _copy64(model)
    inner = trainer(
        par, plan, _standstill, loss, quiet, layout=layout, input_shape=shape, verify=False
    )
    got = _Outputs(inner.model.module, _leaves(layout))
    try:
        got_value = inner.step(x, y)
    finally:
        got.remove()
    items = _outputs(inner, want, got.calls, batch)
    items.append(("the loss", "", torch.tensor(got_value, dtype=torch.float64), value))
    items += _grads(inner, grads)
    _agree(items, plan, shape)
    return Checked(batch, shape, time.perf_counter() - t0)


_RANDOM = (
    "the forward draws torch's own random numbers (beside dropout), which one process cannot "
    "draw alike; pass --no-verify (verify=False) to silence this"
)


def _standstill(params):
    return torch.optim.SGD(params, lr=0.0)


def _outputs(inner, want: list, got: list, n: int) -> list[tuple]:
    """(what, style, this rank's output, the one process's part of it) for each call of a leaf
    module both runs made as often."""
    engine, layout = inner.model, inner.model.layout
    count_w: dict[str, int] = {}
    count_g: dict[str, int] = {}
    for name, _ in want:
        count_w[name] = count_w.get(name, 0) + 1
    for name, _ in got:
        count_g[name] = count_g.get(name, 0) + 1
    later = [(name, t) for name, t in got if count_g[name] == count_w.get(name)]
    mine = {}
    for name, t in later:
        mine.setdefault(name, []).append(t)
    items, k = [], {}
    for name, full in want:
        if name not in mine:
            continue
        i = k[name] = k.get(name, -1) + 1
        style, part = _part(engine, layout, name, full, mine[name][i], n)
        items.append((f"{name}'s output", style, mine[name][i], part))
    return items


def _part(engine, layout: Layout, name: str, full: torch.Tensor, local: torch.Tensor, n: int):
    """(the style of `name`'s layer, the part of the one process's output `full` this rank
    holds: its examples, and where `local` is a band (or a tile) of them, its rows and columns
    (those split: a dimension of another size each, rows first), wherever a permute put them)."""
    layer = layout.layer_of.get(name)
    spec = layout.styles.get(layer) if layer is not None else None
    styles = getattr(engine, "styles", None)
    if spec is None or styles is None:  # torch DDP: examples alone
        return str(spec or "batch"), full[engine.output_rows(n)]
    seg = next(x.segment for x in layout.layers if x.name == layer)
    grid = styles[seg].grid
    part = full[grid.rows(even_split(n, engine.plan.procs))]
    other = [d for d in range(1, part.dim()) if d < local.dim() and part.shape[d] != local.shape[d]]
    if spec.kind != "domain" or not other or len(other) > 2 or part.dim() != local.dim():
        return str(spec), part
    i, j = divmod(grid.r, spec.pw)
    cuts = [(k, parts) for k, parts in ((i, spec.pr // spec.pw), (j, spec.pw)) if parts > 1]
    for d, (k, parts) in zip(other, cuts, strict=False):
        lo, hi = bands(part.shape[d], parts)[k]
        part = part.narrow(d, lo, hi - lo)
    return str(spec), part


def _grads(inner, want: dict[str, torch.Tensor | None]) -> list[tuple]:
    """(what, style, this rank's gradient, the one process's part of it) per parameter, and
    (..., this rank's buffer, the one process's) per floating buffer (running statistics)."""
    engine, layout = inner.model, inner.model.layout
    splits = getattr(engine, "_splits", {})
    items = []
    for name, q in engine.named_parameters_for_state().items():
        full = want.get(name)
        if full is not None and name in splits:
            full = splits[name].shard(full)
        layer = layout.layer_of_param(name)
        style = str(layout.styles.get(layer, ""))
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad  # sharded states
        items.append((f"the gradient of {name}", style, grad, full))
    for name, b in engine.module.named_buffers():
        if name in want:
            layer = layout.layer_of_param(name)
            style = str(layout.styles.get(layer, ""))
            items.append((f"{name} after the step", style, b, want[name]))
    return items


def _differs(got: torch.Tensor | None, want: torch.Tensor | None) -> str:
    """Why `got` is not `want` ("" when it is, within RTOL of the largest of `want`)."""
    if got is None or want is None:
        return "" if got is None and want is None else "is missing on one side"
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)}, not {tuple(want.shape)}"
    if not got.numel():
        return ""
    scale = float(want.abs().max())
    worst = float((got.to(want) - want).abs().max())
    if worst <= RTOL * max(scale, 1e-12) + 1e-12:
        return ""
    return f"differs by {worst:.3g} (largest value {scale:.3g})"


def _agree(items: list[tuple], plan: ParallelPlan, shape: tuple[int, ...]) -> None:
    """The first item that differs on any rank (the items are in the same order everywhere),
    named in the same words on every rank."""
    mine = (len(items), "")
    for i, (what, style, got, want) in enumerate(items):
        why = _differs(got, want)
        if why:
            mine = (i, f"{what} {why}" + (f" ({style})" if style else ""))
            break
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    found = [(i, r, why) for r, (i, why) in enumerate(every) if why]
    if found:
        _, rank, why = min(found)
        size = "x".join(map(str, shape))
        raise ConfigError(
            f"the plan does not compute what one process computes: on rank {rank}, {why}, in a "
            f"check on a float64 copy ({plan.batch} x {size}); pass --no-verify (verify=False) "
            "to train anyway"
        )
