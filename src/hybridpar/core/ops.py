"""A style changes the operation a layer applies to its input, not the layer.

A layer is a module whose class derives from one torch knows (nn.Conv2d, nn.Linear, a batch norm,
a pooling), however its own `forward` is written: timm's BatchNormAct2d runs its activation and
dropout children after the batch norm, ScaledStdConv2d standardises its weight and scales it by a
`gain` before the convolution. Each such class has one *own operation*, the torch function it
applies to its input (core.operations' table: F.conv2d, F.linear, F.batch_norm, the poolings,
F.conv_transpose2d, F.interpolate, F.layer_norm, F.pixel_shuffle). A
style stands in for that one call, and only where its first argument is the module's input (or
what a function in `Operation.through` made of it: a convolution pads its input first in padding modes
other than zeros); the module's forward, its other parameters and its children run as written,
and its state dict keeps every key. The standardising convolution's own F.batch_norm, on its
weight, is not its operation and is left alone.

| where                 | uses                                                                |
| --------------------- | ------------------------------------------------------------------- |
| the trace (analysis)  | `Matcher`: counts the calls of a layer's operation on its input     |
| the runtime's styles  | `install`: the module's forward runs with the operation swapped     |
| the rules (model)     | `why_not_split`: whether the forward's weight is row by row          |

The model style splits the units of a layer's weight over a model group. A forward that computes
the weight from its parameters (standardisation, a gain) runs on whole-shaped parameters whose
rows other than this rank's are filler, and the swapped operation keeps this rank's rows of what
the forward computed: exact where every row of the computed weight and bias depends on the same
row of the parameters alone, which `why_not_split` checks with vector-Jacobian products before
the planner offers the split (one pair per bit of the row index: rows that differ in a bit land on
different sides of one pair).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from hybridpar.core.operations import OPERATIONS, Operation, of_function

__all__ = [
    "SITES",
    "Matcher",
    "call",
    "call_with",
    "functions",
    "install",
    "install_site",
    "is_plain",
    "operation_of",
    "own_op",
    "site_func",
    "site_key",
    "site_name",
    "site_operation",
    "state_slots",
    "swapped_parameters",
    "units",
    "why_not_split",
]


@functools.cache
def _classes() -> tuple[tuple[type, Operation], ...]:
    """(class, operation) for every class core.operations names, resolved below torch.nn."""
    return tuple(
        (functools.reduce(getattr, c.split("."), nn), op) for op in OPERATIONS for c in op.modules
    )


def operation_of(module: nn.Module) -> Operation | None:
    """The operation `module` applies (its class or a base's in the table); None for others."""
    return _of_type(type(module))


@functools.cache
def _of_type(kind: type) -> Operation | None:
    return next((op for cls, op in _classes() if issubclass(kind, cls)), None)


def own_op(module: nn.Module) -> Operation | None:
    """The operation a style may swap in `module`'s forward; None for other modules."""
    op = operation_of(module)
    return op if op is not None and op.swap else None


@functools.cache
def functions(names: tuple[str, ...]) -> tuple[Callable, ...]:
    """torch.nn.functional's functions of these names."""
    return tuple(getattr(F, f) for f in names)


TRANSPOSED = (nn.ConvTranspose2d, nn.ConvTranspose3d)  # their weight: (in, out / groups, ...)
_CONVS = (nn.Conv2d, nn.Conv3d, *TRANSPOSED)
_BASES = (*_CONVS, nn.Linear)


def units(module: nn.Module) -> int:
    """The output units of a convolution or linear layer: what a model split splits."""
    return module.out_channels if isinstance(module, _CONVS) else module.out_features


def is_plain(module: nn.Module) -> bool:
    """Whether a convolution or linear layer computes as torch's own class does (its forward and
    the convolution's helper are the base class's): its operation reads its weight as it is."""
    base = next(b for b in _BASES if isinstance(module, b))
    return all(
        getattr(type(module), a) is getattr(base, a)
        for a in ("forward", "_conv_forward")
        if hasattr(base, a)
    )


class Matcher:
    """Which calls inside one forward are the layer's operation on its input `x`; counts them."""

    def __init__(self, x: torch.Tensor, op: Operation) -> None:
        self.op, self.hits = op, 0
        self.funcs, self.through = functions(op.functions), functions(op.through)
        self.inputs = {id(x)}
        self._keep = [x]  # ids stay unique while the forward runs

    def on_input(self, args: tuple) -> bool:
        return bool(args) and isinstance(args[0], torch.Tensor) and id(args[0]) in self.inputs

    def is_op(self, func: Callable, args: tuple) -> bool:
        """`func(*args)` is the operation on the input (counted)."""
        if func in self.funcs and self.on_input(args):
            self.hits += 1
            return True
        return False

    def passed(self, func: Callable, args: tuple, out: object) -> None:
        """After `func(*args)` returned `out`: a function of `through` on the input makes more
        input."""
        if func in self.through and self.on_input(args) and isinstance(out, torch.Tensor):
            self.inputs.add(id(out))
            self._keep.append(out)

    def why_not(self) -> str:
        """ "" when the forward applied the operation to its input exactly once."""
        if self.hits == 1:
            return ""
        return f"its forward applies {self.op.name} to its input {self.hits} times, not once"


class _Swap(TorchFunctionMode):
    def __init__(self, matcher: Matcher, to: Callable) -> None:
        super().__init__()
        self.matcher, self.to = matcher, to

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.matcher.is_op(func, args):
            return self.to(*args, **kwargs)
        through = getattr(self.to, "through", None)  # a stand-in that pads the input itself
        if through is None or func not in self.matcher.through or not self.matcher.on_input(args):
            through = func
        out = through(*args, **kwargs)
        self.matcher.passed(func, args, out)
        return out


def call(
    module: nn.Module,
    own: Callable,
    to: Callable,
    x: torch.Tensor,
    *args,
    name: str = "",
    around: Callable[[], contextlib.AbstractContextManager] | None = None,
    **kwargs,
):
    """`own(x, *args, **kwargs)` (the module's forward) with `to` standing in for the module's
    operation on its input `x`; `around` is entered while it runs. A forward that does not apply
    the operation to its input once raises (the trace refuses such a layer before:
    `Matcher.why_not`)."""
    fast = _FAST.get(getattr(own, "__func__", None))
    if fast is not None and getattr(own, "__self__", None) is module and not args and not kwargs:
        with around() if around is not None else contextlib.nullcontext():
            return to(*fast(module, x))
    op = own_op(module)
    if op is None:
        raise TypeError(f"{name}: {type(module).__name__} has no operation a style can swap")
    matcher = Matcher(x, op)
    with around() if around is not None else contextlib.nullcontext(), _Swap(matcher, to):
        y = own(x, *args, **kwargs)
    why = matcher.why_not()
    if why:
        raise RuntimeError(f"{name or type(module).__name__} ({type(module).__name__}): {why}")
    return y


def _batch_norm_args(m: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> tuple:
    """The arguments torch's own `_BatchNorm.forward` passes to its F.batch_norm (torch 2.13's,
    line for line; tests/test_subclasses.py holds it to the swapped forward): its running
    statistics' update factor, its count, whether the batch's statistics are used."""
    m._check_input_dim(x)
    factor = 0.0 if m.momentum is None else m.momentum
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        m.num_batches_tracked.add_(1)
        if m.momentum is None:  # a cumulative moving average
            factor = 1.0 / float(m.num_batches_tracked)
    batch_stats = m.training or (m.running_mean is None and m.running_var is None)
    kept = not m.training or m.track_running_stats
    rm, rv = (m.running_mean, m.running_var) if kept else (None, None)
    return x, rm, rv, m.weight, m.bias, batch_stats, factor, m.eps


# the fast path beside the swap: a forward that is torch's own, whose one call of the operation
# is known, calls the stand-in with that call's arguments, without a TorchFunctionMode around it
# (its dispatch cost 6 us of a batch norm's 45 us forward and backward here: benchmarks/global_bn)
_FAST: dict[Callable, Callable[[nn.Module, torch.Tensor], tuple]] = {
    nn.modules.batchnorm._BatchNorm.forward: _batch_norm_args,
}


def install(
    module: nn.Module,
    to: Callable,
    *,
    name: str,
    enter: Callable[[torch.Tensor], torch.Tensor] | None = None,
    around: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> None:
    """From now on `module`'s own forward runs as written with `to` standing in for its operation
    on its input (`call`); `enter` first makes the input (a collective's autograd pair). The
    module's class, parameters, children and hooks stay. Installed again, the later stands in for
    the earlier."""
    own = module.__dict__.get("hybridpar_own_forward", module.forward)

    def forward(x: torch.Tensor, *args, **kwargs):
        if enter is not None:
            x = enter(x)
        return call(module, own, to, x, *args, name=name, around=around, **kwargs)

    module.hybridpar_own_forward = own
    module.hybridpar_stand_in = to  # what stands in for the operation (a style's, to inspect)
    module.forward = forward
    module.hybridpar_wrapped = True  # runtime/parallel/compute.py compiles around it


class _Sites(TorchFunctionMode):
    """While a module's own forward runs: the k-th call of a function it makes itself (not one
    of its children's, `depth` > 0 inside them) goes to `sites[(function, k)]`."""

    def __init__(self, sites: dict, depth: list[int]) -> None:
        super().__init__()
        self.sites, self.depth, self.seen = sites, depth, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth[0] == 0 and any(f is func for f, _ in self.sites):
            k = self.seen[func] = self.seen.get(func, -1) + 1
            to = self.sites.get((func, k))
            if to is not None:
                return to(*args, **kwargs)
        return func(*args, **kwargs)


SITES: dict[str, Callable] = {
    **{f: getattr(F, f) for op in OPERATIONS if op.call for f in op.functions},
    **{k: getattr(torch, k) for k in ("mean", "sum", "amax")},
    **{f"Tensor.{k}": getattr(torch.Tensor, k) for k in ("mean", "sum", "amax")},
}
"""the functions whose calls in a module's own forward a style may take (a resampling, a
global pooling), by the name a site's name carries"""


def site_operation(func: Callable) -> Operation | None:
    """The operation whose calls of `func` in a forward are layers of their own (an
    F.interpolate, an F.pixel_shuffle; a global pooling's are found by core.rows.global_pool)."""
    op = of_function(getattr(func, "__name__", ""))
    return (
        op if op is not None and op.bands != "global" and func in functions(op.functions) else None
    )


def site_key(func: Callable) -> str:
    """`func`'s name in SITES ("" when a style never takes its calls)."""
    return next((k for k, f in SITES.items() if f is func), "")


def site_name(owner: str, func: Callable, k: int) -> str:
    """The name of the k-th call of `func` in the forward of the module `owner` ("": the model)."""
    return f"{owner}:{site_key(func)}.{k}"


def site_func(name: str) -> tuple[str, Callable, int]:
    """(owner, function, k) of a site's name (`site_name`)."""
    owner, _, call = name.partition(":")
    key, _, k = call.rpartition(".")
    return owner, SITES[key], int(k)


def install_site(module: nn.Module, func: Callable, k: int, to: Callable) -> None:
    """From now on the k-th call of `func` that `module`'s own forward makes (its children's
    calls aside) goes to `to`; the forward, its children and the other calls run as written."""
    sites = module.__dict__.get("hybridpar_sites")
    if sites is None:
        sites, depth = {}, [0]
        inner = [m for m in module.modules() if m is not module]
        for m in inner:
            m.register_forward_pre_hook(lambda *a: depth.__setitem__(0, depth[0] + 1))
            m.register_forward_hook(lambda *a: depth.__setitem__(0, depth[0] - 1))
        own = module.forward

        def forward(*args, **kwargs):
            depth[0] = 0
            with _Sites(sites, depth):
                return own(*args, **kwargs)

        module.hybridpar_sites = sites
        module.forward = forward
    sites[(func, k)] = to


# --- whether a model split of a layer's weight units is exact -------------------------------------


def why_not_split(module: nn.Module, in_shape: tuple[int, ...]) -> str:
    """ "" when the model style can split `module` (a Conv2d, Conv3d or Linear, any subclass; a
    transposed convolution as torch's own) by output units: every parameter of its own has one
    row per unit, its forward applies its operation to its input once, the weight and bias it
    hands the operation are row-by-row functions of those rows, and nothing else of its forward
    reads them. Else why not, in a few words. Checked on
    random float64 copies of the parameters on the CPU, with vector-Jacobian products."""
    if is_plain(module):
        return ""
    if isinstance(module, TRANSPOSED):  # its units are its weight's columns: not checked here
        return "a transposed convolution whose forward computes its weight does not split"
    n = units(module)
    own = dict(module.named_parameters(recurse=False))
    odd = [k for k, p in own.items() if tuple(p.shape[:1]) != (n,)]
    if odd:
        shape = tuple(own[odd[0]].shape)
        return f"its parameter {odd[0]} {shape} does not have one row per output unit ({n})"
    with torch.device("cpu"), torch.enable_grad():
        try:
            return _rows_apart(module, in_shape, n, own)
        except Exception as exc:  # anything its forward does on a random copy: name it
            return f"its forward cannot be checked ({type(exc).__name__}: {_first(exc)})"


def _first(exc: Exception) -> str:
    return (str(exc).splitlines() or [""])[0][:120]


def _rows_apart(module: nn.Module, in_shape: tuple[int, ...], n: int, own: dict) -> str:
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}  # one random copy per tensor, in each slot holding it
    for k, t in state_slots(module).items():
        if id(t) not in made and t.is_floating_point():
            v = torch.randn(t.shape, generator=g, dtype=torch.float64)
            made[id(t)] = v.requires_grad_(isinstance(t, nn.Parameter))
        elif id(t) not in made:
            made[id(t)] = torch.zeros(t.shape, dtype=t.dtype)
        state[k] = made[id(t)]
    x = torch.randn((1, *in_shape), generator=g, dtype=torch.float64)
    seen: dict[str, torch.Tensor | None] = {}
    op = own_op(module)
    assert op is not None

    def to(inp, weight, bias=None, *args, **kwargs):
        seen["weight"], seen["bias"] = weight, bias
        return functions(op.functions)[0](inp, weight.detach(), None if bias is None else bias.detach(), *args,
                           **kwargs)  # fmt: skip

    matcher = Matcher(x, op)
    with _Swap(matcher, to):
        y = call_with(module, state, x)
    why = matcher.why_not()
    if why:
        return why
    params = [state[k] for k in own]
    outs = [t for t in (y if isinstance(y, tuple | list) else [y]) if isinstance(t, torch.Tensor)]
    outs = [t.sum() for t in outs if t.requires_grad]
    beyond = torch.autograd.grad(outs, params, allow_unused=True) if outs else [None] * len(own)
    used = [k for k, d in zip(own, beyond, strict=True) if d is not None and d.abs().sum() > 0]
    if used:
        return f"its forward uses its parameter {used[0]} beyond its {op.name}"
    made = [t for t in (seen["weight"], seen["bias"]) if t is not None]
    wrong = [t for t in made if tuple(t.shape[:1]) != (n,)]
    if wrong:
        return f"the weight its {op.name} gets has {wrong[0].shape[0]} rows, not {n}"
    rows = torch.arange(n)
    for bit in range(max(1, math.ceil(math.log2(n)))):
        side = (rows >> bit) & 1 == 1
        for mine in (side, ~side):
            cot = [torch.randn(t.shape, generator=g, dtype=t.dtype) * _rows(mine, t) for t in made]
            grads = torch.autograd.grad(made, params, cot, retain_graph=True, allow_unused=True)
            for k, d in zip(own, grads, strict=True):
                if d is not None and d[~mine].abs().sum() > 0:
                    return (
                        f"the weight its {op.name} gets mixes rows of its parameter {k} (row by "
                        "row is what a split by output units needs)"
                    )
    return ""


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype).view(-1, *[1] * (like.dim() - 1))


def state_slots(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer slot of `model` once, named by its module's first name: a
    module registered under two names (MONAI's DynUNet registers its encoder twice) is one
    module with one slot per tensor; a parameter tied into two modules is in two slots."""
    out = {}
    for name, m in model.named_modules():  # a module reachable twice: once
        for k, v in [*m._parameters.items(), *m._buffers.items()]:
            if v is not None:
                out[f"{name}.{k}" if name else k] = v
    return out


def swap_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """`new` in every place of `model` that holds `old`, under each of its names."""
    for parent in model.modules():
        for child, m in list(parent._modules.items()):
            if m is old:
                setattr(parent, child, new)


def call_with(model: nn.Module, state: dict[str, torch.Tensor], *args):
    """`model(*args)` with the tensors of `state` (keys: `state_slots`') in its slots, which are
    put back after. Each slot is swapped once (torch's tie_weights swapped a module's slots once
    per name it has, and a module registered twice came back holding the stand-in tensors, no
    longer Parameters, of meta ones: issue 71)."""
    return torch.func.functional_call(model, state, args, tie_weights=False)


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """While inside, `module`'s own parameters `tensors` names read as those tensors."""
    saved = {k: module._parameters[k] for k in tensors}
    module._parameters.update(tensors)
    try:
        yield
    finally:
        module._parameters.update(saved)
