"""nn.Module + input shape -> the ordered list of its layers, with the sizes the cost model needs,
and where in the forward the activation layout may change.

The model runs once on the meta device (no memory, no arithmetic), with forward hooks on every
module recording per-sample shapes and a TorchFunctionMode recording the dataflow between them
(`torch.flatten`, residual additions, slicing: whatever the user's `forward` does). Shapes are per
sample: the batch dimension is dropped.

Where a layout can change. The runtime changes the layout of an activation (e.g. gathers the
examples of a batch group before a model-parallel layer) in a forward pre-hook, which rewrites the
input of one module call. That is sound only at a *clean cut*: a module called once whose first
tensor argument is the only activation alive at that point of the forward (produced before, used
after), and whose every later use lies inside that call. In a residual block the block's entry is
a clean cut and its first convolution is not (the shortcut keeps the input alive past it), so a
layout change for the block happens at the block, and the layers inside it share one layout: the
planner gives a residual block one style. Layers between two clean cuts form a *segment*.

A layer is a leaf module or a module of a class torch knows (hybridpar.core.operations: a batch norm
that runs activation and dropout children in its own forward is one); its children are traced as
leaves inside it, and whether its forward applies its own operation to its input (what a style
swaps) is recorded. A layer subclass whose forward computes its weight (a standardising
convolution) is checked for what a model split needs (`ops.why_not_split`).

Where a layout may not change. A forward that reads the batch size (`b = x.shape[0]`) and uses
it later (`pos.expand(b, -1)`) breaks if a rank holds another number of examples in between. The
trace runs the forward once more with another batch from each clean cut on (all at once; one cut
at a time where that fails): a cut where the forward does not follow is *pinned*, and no plan
changes the batch groups there (hybridpar.core.rules.why_not_move).

FLOPs count one multiply-add as 2 and leave biases out, the convention of Krizhevsky's footnote 4
(a 4096x512 slice of a fully-connected layer is "4096 x 512 x 2 FLOPs per sample").
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from hybridpar.core import ops
from hybridpar.core.bands import Bands
from hybridpar.core.errors import ConfigError
from hybridpar.core.leaves import LayerSpec, leaf_spec
from hybridpar.core.live import held_at_once

__all__ = ["LayerSpec", "Trace", "analyze", "trace"]


@dataclass
class Trace:
    """What one traced forward pass showed: the leaf calls in order (with their segments),
    how often each module ran, and in which segments each parameter was used."""

    specs: list[LayerSpec]
    calls: dict[str, int] = field(default_factory=dict)
    param_segments: dict[str, set[int]] = field(default_factory=dict)
    out_shape: tuple[int, ...] = ()  # the model's output per sample (one tensor; else ())
    in_shape: tuple[int, ...] = ()  # the model's input per sample

    def segment_modules(self) -> dict[str, set[int]]:
        """Leaf module name -> the segments it ran in."""
        out: dict[str, set[int]] = {}
        for s in self.specs:
            out.setdefault(s.name, set()).add(s.segment)
        return out


class _Recorder(TorchFunctionMode):
    """The dataflow of one forward pass. A leaf module call is one op; the torch functions called
    outside leaves (flatten, add, slicing, ...) are ops too. Every tensor is keyed by (id, version):
    an in-place op or a module that returns its input starts a new version, so the uses of the
    value after it are not uses of the value before it."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0
        self.on = False
        self.in_leaf = 0
        self.version: dict[int, int] = {}
        self.produced: dict[tuple[int, int], int] = {}
        self.last_use: dict[tuple[int, int], float] = {}
        self.grad: set[tuple[int, int]] = set()  # values that depend on a parameter
        self.keep: list[torch.Tensor] = []  # holds every tensor so ids are never reused
        self.params: dict[int, str] = {}  # id of a parameter tensor -> its name
        self.sizes: dict[str, int] = {}  # parameter name -> its elements
        self.param_times: dict[str, list[int]] = {}
        self.bands = Bands(self.key)  # what the domain style needs to know of the values
        self.watches: list[ops.Matcher] = []  # the layers running: their operation on their input

    def key(self, x: torch.Tensor) -> tuple[int, int]:
        return id(x), self.version.get(id(x), 0)

    def use(self, xs: list[torch.Tensor], t: float) -> bool:
        """Record uses at time t; True when any input depends on a parameter."""
        grad = False
        for x in xs:
            name = self.params.get(id(x))
            if name is not None:
                self.param_times.setdefault(name, []).append(int(t))
                grad = True
                continue
            k = self.key(x)
            self.last_use[k] = max(self.last_use.get(k, -1), t)
            grad = grad or k in self.grad
        return grad

    def produce(self, ys: list[torch.Tensor], t: int, grad: bool) -> None:
        for y in ys:
            if id(y) in self.params:
                continue
            if (id(y), self.version.get(id(y), 0)) in self.produced:
                self.version[id(y)] = self.version.get(id(y), 0) + 1
            k = self.key(y)
            self.produced[k] = t
            if grad:
                self.grad.add(k)
            self.keep.append(y)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for w in self.watches:
            w.is_op(func, args)
        out = func(*args, **(kwargs or {}))
        for w in self.watches:
            w.passed(func, args, out)
        if self.on and self.in_leaf and self.bands.inside and self.bands.inside[-1] is not None:
            self.bands.inner(func, args, kwargs, out)  # a module hybridpar does not know
        if self.on and not self.in_leaf:
            outs = _tensors(out)
            if outs:  # metadata (size, dim, shape) produces no tensor and is no data use
                t = self.t
                self.t += 1
                ins = _tensors((args, kwargs))
                seen = self.bands.inputs([x for x in ins if id(x) not in self.params])
                self.produce(outs, t, self.use(ins, t))
                self.bands.function(func, args, kwargs, out, outs, seen, t)
        return out


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _Calls:
    """Module hooks that record, around the recorder's dataflow, every module call (its name,
    enter and exit time, the key of its first tensor argument and that argument's elements per
    example) and every leaf's spec."""

    def __init__(self, model: nn.Module, rec: _Recorder) -> None:
        self.model, self.rec = model, rec
        self.names = {m: n for n, m in model.named_modules()}
        leaves = {
            m
            for m in model.modules()
            if (next(m.children(), None) is None or ops.own_op(m) is not None) and m is not model
        }
        self.leaves = leaves or {model}
        self.split: dict[str, tuple[nn.Module, tuple[int, ...]]] = {}  # to check: why_not_split
        self.specs: list[tuple[int, LayerSpec]] = []  # (time, spec)
        self.calls: list[list] = []  # [name, enter time, exit time, first argument's key, elements]
        self.stack: list[int] = []

    def _leaf(self, module: nn.Module) -> bool:
        return module in self.leaves and module is not self.model

    def pre(self, module: nn.Module, args: tuple) -> None:
        rec, ins = self.rec, _tensors(args)
        if module is self.model:
            rec.on = True
            rec.produce(ins, -1, False)
        first = ins[0] if ins else None
        # inside a layer no layout changes: its children are no cut
        key = rec.key(first) if first is not None and not rec.in_leaf else None
        elements = math.prod(first.shape[1:]) if first is not None else 0
        self.calls.append([self.names[module], rec.t, None, key, elements])
        self.stack.append(len(self.calls) - 1)
        if self._leaf(module):
            t = rec.t
            rec.t += 1
            grad = rec.use(ins, t)
            own = rec.use(list(module.parameters(recurse=False)), t)
            op = ops.own_op(module)
            watch = ops.Matcher(first, op) if op is not None and first is not None else None
            if watch is not None:
                rec.watches.append(watch)
            seen = rec.bands.inputs([first] if first is not None else [])
            rec.bands.enter(module)
            module._hybridpar_call = (t, grad, own, watch, seen)
            rec.in_leaf += 1

    def post(self, module: nn.Module, args: tuple, output: object) -> None:
        rec = self.rec
        self.calls[self.stack.pop()][2] = rec.t
        outs = _tensors(output)
        if self._leaf(module):
            rec.in_leaf -= 1
            t, grad, own, watch, seen = module.__dict__.pop("_hybridpar_call")
            inside = rec.bands.leave()
            if watch is not None:
                rec.watches.remove(watch)
            rec.produce(outs, t, grad or own)
            if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                shapes = (tuple(args[0].shape[1:]), tuple(output.shape[1:]))
                name = self.names[module]
                spec = leaf_spec(name, module, *shapes)
                if inside == []:  # no function its forward called mixed rows (or columns)
                    spec = replace(spec, blocker="")
                spec = rec.bands.leaf(spec, module, seen, len(args[0].shape), outs)
                why = watch.why_not() if watch is not None else ""
                self.specs.append((t, replace(spec, input_grad=grad, own=why)))
                splits = ("conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "linear")
                if spec.op in splits and not why and not ops.is_plain(module):
                    self.split[name] = (module, shapes[0])
        if module is self.model:
            rec.use(outs, math.inf)
            rec.on = False


# a model with at most this many elements of state and of input per sample is traced on zeros
# on the CPU instead of on meta tensors: there it is quick, while the first call of a meta
# kernel written in Python imports torch._dynamo, in every command that plans
SMALL_STATE, SMALL_INPUT = 4_000_000, 3 * 64 * 64


def _trace_device(dtype: torch.dtype, input_shape: tuple[int, ...], state: int) -> str:
    small = state <= SMALL_STATE and math.prod(input_shape) <= SMALL_INPUT
    return "cpu" if small and dtype in (torch.float32, torch.float64) else "meta"


def trace(model: nn.Module, input_shape: tuple[int, ...] | list[int], memory: bool = True) -> Trace:
    """Run `model` once for two inputs of `input_shape` (per sample, no batch dim) and return its
    leaf calls, segments and parameter uses (and, with `memory`, what autograd keeps for
    backward: one more forward): on meta tensors, where a 100-million-parameter model
    costs nothing, or on zeros on the CPU for a small one (`SMALL_STATE`, `SMALL_INPUT`). The
    model itself is not modified."""
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or any(s <= 0 for s in input_shape):
        raise ConfigError(
            f"input shape {input_shape} must be positive sizes per sample, e.g. 3,224,224"
        )
    rec = _Recorder()
    hooks = _Calls(model, rec)
    rec.bands.owner = lambda: hooks.calls[hooks.stack[-1]][0] if hooks.stack else ""
    handles = []
    for m in model.modules():
        handles += [m.register_forward_pre_hook(hooks.pre), m.register_forward_hook(hooks.post)]
    try:
        x, state = _blank(model, input_shape, rec)
        with rec, torch.no_grad():
            try:
                out = ops.call_with(model, state, x)
            except (RuntimeError, ValueError) as exc:  # e.g. a norm left with one pixel
                raise ConfigError(
                    f"cannot run {type(model).__name__} on input shape {input_shape}: "
                    f"{str(exc).splitlines()[0]}"
                ) from exc
    finally:
        for h in handles:
            h.remove()
    traced = _segments(_timed(model, hooks, rec), hooks.calls, rec, _seqs(model), _dense(out, rec))
    traced.out_shape = tuple(out.shape[1:]) if isinstance(out, torch.Tensor) else ()
    traced.in_shape = input_shape
    cuts = [s.entry for s in traced.specs if s.entry]
    batched = isinstance(out, torch.Tensor) and out.dim() > 0 and out.shape[0] == 2
    pinned = _pinned(model, state, x, cuts, batched)
    saved = _saved(model, state, x, hooks.leaves) if memory else {}
    live = held_at_once(model, state, x, hooks.leaves) if memory else {}
    traced.specs = [
        replace(
            s,
            pinned=pinned.get(s.entry or "", ""),
            saved=saved.get(s.name, 0.0),
            live=live.get(s.name, (0.0, 0.0)),
        )
        for s in traced.specs
    ]
    return traced


def _blank(model: nn.Module, input_shape: tuple[int, ...], rec: _Recorder) -> tuple:
    """(two inputs, the model's state) of the trace: zeros on the CPU or meta tensors, one per
    tensor in every slot that holds it (a tied weight's two modules read one), in their layouts
    (a channels-last weight stays channels-last); the recorder told which are parameters."""
    floats = (p.dtype for p in model.parameters() if p.is_floating_point())
    dtype = next(floats, torch.get_default_dtype())  # a float64 model reads float64
    tensors = [*model.named_parameters(), *model.named_buffers()]  # each tensor once
    device = _trace_device(dtype, input_shape, sum(v.numel() for _, v in tensors))
    meta = device == "meta"  # nothing to fill there; zeros on the CPU (no garbage)
    blank, blank_like = (torch.empty, torch.empty_like) if meta else (torch.zeros, torch.zeros_like)
    x = blank((2, *input_shape), device=device, dtype=dtype)
    blanks = {
        id(v): blank_like(v, device=device).requires_grad_(v.requires_grad) for _, v in tensors
    }
    rec.params = {id(blanks[id(v)]): k for k, v in tensors if v.requires_grad}
    rec.sizes = {k: v.numel() for k, v in tensors if v.requires_grad}
    return x, {k: blanks[id(v)] for k, v in ops.state_slots(model).items()}


def _seqs(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.Sequential)}


def _timed(model: nn.Module, hooks: _Calls, rec: _Recorder) -> list[tuple[int, LayerSpec]]:
    """Every leaf's and function call's spec in the order of the forward (a layer before its
    children), with why it cannot be split by output units and tied weights counted once."""
    counts = {c[0]: 0 for c in hooks.calls}
    for c in hooks.calls:
        counts[c[0]] += 1
    sites = [(t, _once(s, counts)) for t, s in rec.bands.sites]
    timed = sorted(hooks.specs + sites, key=lambda ts: ts[0])
    unsplit = {n: ops.why_not_split(m, shape) for n, (m, shape) in hooks.split.items()}
    tied = _tied(model)
    unsplit.update({n: why for n, (why, _, _) in tied.items()})
    return [(t, _untied(replace(s, unsplit=unsplit.get(s.name, "")), tied)) for t, s in timed]


def _dense(out: object, rec: _Recorder) -> bool:
    """The output is (N, C, H, W) on bands: its rows stay split (not a pooled whole value)."""
    return (
        isinstance(out, torch.Tensor)
        and out.dim() in (4, 5)
        and rec.key(out) not in rec.bands.whole
        and rec.bands.rows_at(out) == 2
    )


def _tied(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Module -> (why it cannot be split by output units, weight and bias elements another
    module holds first) for every module holding a parameter another module holds too (tied
    weights): a split would untie them, and the parameter is priced once, with its first
    holder (as `named_parameters` names it)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    sizes: dict[int, int] = {}
    for name, m in model.named_modules():  # a module registered twice: one holder
        for k, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((name, k))
                sizes[id(p)] = p.numel()
    out: dict[str, tuple[str, int, int]] = {}
    for i, held in holders.items():
        for j, (name, k) in enumerate(held):
            if len(held) < 2:
                break
            other = next(f"{n}.{a}" for n, a in held if n != name)
            why, w, b = out.get(name, ("", 0, 0))
            why = why or f"its {k} is also {other} (tied): a split by output units would untie it"
            if j:  # priced with its first holder
                w, b = (w, b + sizes[i]) if k == "bias" else (w + sizes[i], b)
            out[name] = (why, w, b)
    return out


def _untied(spec: LayerSpec, tied: dict[str, tuple[str, int, int]]) -> LayerSpec:
    """`spec` without the tied elements another layer holds first (`_tied`)."""
    if spec.name not in tied:
        return spec
    _, w, b = tied[spec.name]
    return replace(spec, weights=spec.weights - w, biases=spec.biases - b)


def _saved(model: nn.Module, state: dict, x: torch.Tensor, leaves: set) -> dict[str, float]:
    """Leaf -> what autograd keeps for the backward pass while it runs, per sample, in elements
    of the model's float type (an int64 index of a float32 model counts 2): one more forward with
    gradients, every tensor saved counted once (views by their base), parameters left out. What
    the forward saves between leaves goes to the leaf before it."""
    names = {m: n for n, m in model.named_modules()}
    per: dict[str, float] = {}
    current, seen, keep = [""], set(), []
    params = {id(v) for v in state.values()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in seen and id(base) not in params:
            seen.add(id(base))
            keep.append(base)
            per[current[0]] = per.get(current[0], 0.0) + base.numel() * base.element_size()
        return t

    handles = [
        m.register_forward_pre_hook(lambda m, a: current.__setitem__(0, names[m])) for m in leaves
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ops.call_with(model, state, x)
    except Exception:  # a forward that cannot run with gradients here: nothing known
        return {}
    finally:
        for h in handles:
            h.remove()
    return {k: v / x.element_size() / len(x) for k, v in per.items()}


def _once(site: LayerSpec, counts: dict[str, int]) -> LayerSpec:
    """A function's call in a module's forward is one layer where that module runs once."""
    owner = site.name.partition(":")[0]
    if counts.get(owner, 1) == 1 or site.blocker:
        return site
    return replace(
        site, blocker=f"{site.type} in {owner or 'the model'}, run {counts[owner]} times"
    )


def _pinned(
    model: nn.Module, state: dict, x: torch.Tensor, cuts: list[str], batched: bool
) -> dict[str, str]:
    """Cut module -> why the batch groups may not change there: the forward, given another number
    of examples from that cut on, fails or answers for another number (a size read before the cut
    and used after it). One run with a new batch at every cut (3, 4, ...); where it fails, one
    run per cut."""

    def run(sizes: dict[str, int]) -> str:
        def resize(module: nn.Module, args: tuple, n: int) -> tuple:
            first, *rest = args
            return (first.new_zeros((n, *first.shape[1:])), *rest)

        handles = [
            model.get_submodule(c).register_forward_pre_hook(lambda m, a, n=n: resize(m, a, n))
            for c, n in sizes.items()
        ]
        try:
            with torch.no_grad():
                out = ops.call_with(model, state, x)
        except Exception as exc:  # what the forward does with another batch: named below
            return (str(exc).splitlines() or [type(exc).__name__])[0]
        finally:
            for h in handles:
                h.remove()
        want = sizes[cuts[-1]] if cuts[-1] in sizes else max(sizes.values())
        if batched and out.shape[0] != want:
            return f"it answered for {out.shape[0]} examples, not {want}"
        return ""

    cuts = [c for c in cuts if c]
    if not cuts or not run({c: 3 + i for i, c in enumerate(cuts)}):
        return {}
    out = {}
    for c in cuts:
        why = run({c: 3})
        if why:
            out[c] = f"the forward reads the batch size before {c} and uses it after ({why[:100]})"
    return out


def _clean(call: list, rec: _Recorder, counts: dict[str, int]) -> bool:
    """A forward pre-hook on this call can change the layout of the whole forward from here on."""
    name, enter, exit_, key, _ = call
    if key is None or counts[name] != 1 or rec.last_use.get(key, -1) >= exit_:
        return False
    live = [k for k, t in rec.produced.items() if t < enter and rec.last_use.get(k, -1) >= enter]
    return live == [key]


def _segments(
    timed: list[tuple[int, LayerSpec]],
    calls: list[list],
    rec: _Recorder,
    seqs: set[str],
    dense: bool = False,
) -> Trace:
    counts: dict[str, int] = {}
    for c in calls:
        counts[c[0]] = counts.get(c[0], 0) + 1
    weighted = [t for t, s in timed if s.kind in ("conv", "linear") and s.params > 0]
    cuts: list[tuple[int, str, int, bool]] = []  # (time, module, elements, whole)
    for prev, t in itertools.pairwise(weighted):
        window = [c for c in calls if prev < c[1] <= t and _clean(c, rec, counts)]
        if window:  # the latest; among modules entered at the same time, the innermost
            best = max(reversed(window), key=lambda c: c[1])  # max keeps the first of a tie
            cuts.append((best[1], best[0], best[4], best[3] in rec.bands.whole))
            if best[3] is not None and rec.bands.rowdim.get(best[3], 2) != 2:
                rec.bands.blocked.append((best[1] - 1, "a permuted band leaves the segment"))
    times = [c[0] for c in cuts]
    specs: list[LayerSpec] = []
    opened: set[int] = set()
    first_input = calls[0][4] if calls else 0
    blockers = _blockers(timed, rec, times, dense)
    for t, s in timed:
        seg = bisect.bisect_right(times, t)
        entry, elements, whole = None, 0, False
        if seg not in opened:
            opened.add(seg)
            entry, elements, whole = ("", first_input, False) if seg == 0 else cuts[seg - 1][1:]
        specs.append(
            replace(
                s,
                segment=seg,
                entry=entry,
                entry_elements=elements,
                entry_whole=whole,
                head_in=parent if entry and (parent := entry.rpartition(".")[0]) in seqs else None,
                calls=counts.get(s.name, 1),
                blockers=blockers.get(seg, ()),
            )
        )
    param_segments = {
        name: {bisect.bisect_right(times, t) for t in ts} for name, ts in rec.param_times.items()
    }
    return Trace(_loose(specs, [t for t, _ in timed], times, rec), counts, param_segments)


def _loose(
    specs: list[LayerSpec], at: list[int], cuts: list[int], rec: _Recorder
) -> list[LayerSpec]:
    """Each parameter that no layer holds (its module runs no operation of its own: the model's
    position embedding) rides with the leaf before its first use in that segment, or the
    segment's first leaf, so that the cost model prices its gradient where the runtime sums it."""
    held = {s.name for s in specs}
    out = list(specs)
    for name, ts in sorted(rec.param_times.items()):
        owner = name.rpartition(".")[0]
        if owner in held or not specs:
            continue
        t = min(ts)
        seg = bisect.bisect_right(cuts, t)
        before = [j for j in range(bisect.bisect_right(at, t)) if out[j].segment == seg]
        i = before[-1] if before else next(j for j, s in enumerate(out) if s.segment >= seg)
        elements = rec.sizes[name]
        out[i] = replace(out[i], loose=(*out[i].loose, (name, elements)))
    return out


def _blockers(
    timed: list[tuple[int, LayerSpec]], rec: _Recorder, times: list[int], dense: bool
) -> dict[int, tuple[str, ...]]:
    """Per segment, what in it does not run on a band of rows (leaf modules and functions, in
    forward order); the last segment also hands the model's output out whole, unless it is an
    image (`dense`: the loss runs on its bands)."""
    found: dict[int, list[tuple[int, str]]] = {}
    for t, s in timed:
        if s.blocker:
            found.setdefault(bisect.bisect_right(times, t), []).append((t, s.blocker))
    for t, why in rec.bands.blocked:
        found.setdefault(bisect.bisect_right(times, t), []).append((t, why))
    last = bisect.bisect_right(times, timed[-1][0]) if timed else 0
    if not dense:
        found.setdefault(last, []).append((1 << 62, "the model's output"))
    return {seg: tuple(dict.fromkeys(w for _, w in sorted(v))) for seg, v in found.items()}


def analyze(model: nn.Module, input_shape: tuple[int, ...] | list[int]) -> list[LayerSpec]:
    """Ordered leaf layers of `model` for one input of `input_shape` (per sample, no batch dim).
    Modules called twice appear twice. See `trace` for the segments."""
    return trace(model, input_shape).specs
