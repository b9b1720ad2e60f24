"""CUDA's device rules, checked on the CPU (issue 38).

On a CPU-only machine every tensor lives on the CPU, so code that builds an index with
`torch.arange(n)` and uses it on the model's activations runs fine here and crashes on a GPU
("Expected all tensors to be on the same device"). `DeviceRules` makes that visible on the CPU: a
torch function mode that tags every tensor made on the host (a factory call whose device is not
taken from a tensor, `.cpu()`, `.to("cpu")`, pinned buffers) and everything computed only from
such tensors, and records a violation where

- an operation mixes a host-made tensor of one or more dimensions with a tensor that came from
  the inputs (on a GPU: a device mismatch; a 0-dim host tensor is allowed there, as CUDA does);
- a collective gets a host-made tensor while the group's backend for the inputs' device is not
  the host's (under NCCL: "No backend type associated with device type cpu");
- gloo's point-to-point (`isend`/`irecv`, which read and write host memory only: on a GPU,
  "writev ... Bad address") gets a tensor that came from the inputs instead of a host buffer;
- a kernel is called without an argument its CUDA version requires (the batch-norm backward's
  save_mean and save_invstd: "save_mean->defined() INTERNAL ASSERT FAILED" on a GPU).

Data made before the mode is entered (the model, the batches) counts as the inputs'. Use it
around the whole run, parallelize included: `with DeviceRules() as rules: ...; rules.check()`.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_TAG = "_hp_host_made"

FACTORIES = {
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.eye,
    torch.from_numpy,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.frombuffer,
}
# the result takes its device from the first tensor alone (indexing a device tensor with host
# indices is allowed on CUDA, and so is a copy between devices)
FOLLOWS_SELF = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
    torch.Tensor.copy_,
}
TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory}
NO_CHECK = {torch.Tensor.to, torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.tolist}
P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


def host_made(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _tag(out: object) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            with contextlib.suppress(AttributeError, RuntimeError):  # a subclass without __dict__
                setattr(t, _TAG, True)


def _host_device(d: object) -> bool:
    """A device argument that names the host itself: None, 'cpu' or 'cpu:0' spelt as a string.
    A torch.device object is taken to come from a tensor's `.device` (the rule's way)."""
    return d is None or (isinstance(d, str) and d.startswith("cpu"))


class DeviceRules(TorchFunctionMode):
    """Records every breach of CUDA's device rules in `violations` (where, and the stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self._saved: dict[str, object] = {}

    # --- tensors ----------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            out = func(*args, **kwargs)
            if _host_device(kwargs.get("device")) or kwargs.get("pin_memory"):
                _tag(out)
            return out
        if func in TO_HOST:
            out = func(*args, **kwargs)
            if out is args[0]:  # on a GPU .cpu() is a copy: make it one here too
                out = out.clone()
            _tag(out)
            return out
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        why = _kernel_contract(func, args)
        if why:
            self._violate(why)
        if isinstance(kwargs.get("device"), str) and kwargs["device"].startswith("cpu"):
            out = func(*args, **kwargs)  # zeros_like(x, device="cpu"), x.new_zeros(..., device=)
            _tag(out)
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if not tensors or func in NO_CHECK:
            return out
        if func in FOLLOWS_SELF:
            if host_made(tensors[0]) and out is not tensors[0]:
                _tag(out)
            return out
        hosts = [t for t in tensors if host_made(t)]
        if hosts and len(hosts) == len(tensors):
            _tag(out)
        elif any(t.dim() > 0 for t in hosts):
            shapes = [tuple(t.shape) for t in hosts if t.dim() > 0]
            self._violate(f"{_name(func)} mixes host-made tensors {shapes} with device tensors")
        return out

    def _to(self, args, kwargs):
        out = torch.Tensor.to(*args, **kwargs)
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, str) and target.startswith("cpu"):
            if out is args[0]:
                out = out.clone()
            _tag(out)
        elif isinstance(target, torch.Tensor):
            if host_made(target) and out is not args[0]:
                _tag(out)
            elif not host_made(target) and host_made(out):  # onto the inputs' device: a copy
                out = out.clone() if out is args[0] else out
                object.__setattr__(out, _TAG, False)
        elif isinstance(target, torch.device):  # onto the inputs' device (a GPU's copy)
            if host_made(out):
                out = out.clone() if out is args[0] else out
                object.__setattr__(out, _TAG, False)
        elif host_made(args[0]) and out is not args[0]:
            _tag(out)  # a dtype change keeps the device
        return out

    # --- collectives ------------------------------------------------------------------------

    def __enter__(self):
        for name in (*P2P, *COLLECTIVES):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        # `loss.backward()` is itself a torch function, and a mode is off inside its own
        # handler: the rules go back on around autograd's engine (custom backwards, hooks)
        engine = self._saved["engine"] = torch.autograd._engine_run_backward

        def run_backward(*args, **kwargs):
            with _Again(self):
                return engine(*args, **kwargs)

        torch.autograd._engine_run_backward = run_backward
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd._engine_run_backward = self._saved.pop("engine")
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return super().__exit__(*exc)

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            group = kwargs.get("group")
            if name in P2P:
                gloo = _backend_for(group, tensors[0]) == "gloo"
                if gloo and not all(host_made(t) for t in tensors):
                    self._violate(f"gloo's {name} given a device tensor (host memory only)")
            elif any(host_made(t) and t.numel() for t in tensors):
                self._violate(f"{name} given a host-made tensor, not one on the inputs' device")
            return fn(*args, **kwargs)

        return call

    def _violate(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        ours = [
            f for f in stack if "/hybridpar/" in f.filename and "device_rules" not in f.filename
        ]
        where = ours[-1] if ours else stack[-1]
        self.violations.append(f"{what} at {where.filename.split('src/')[-1]}:{where.lineno}")

    def check(self) -> None:
        """Raise with every distinct violation recorded."""
        seen = sorted(set(self.violations))
        assert not seen, "CUDA's device rules broken:\n  " + "\n  ".join(seen)


class _Again(TorchFunctionMode):
    """The rules again, for what autograd runs inside `backward` (custom backwards, hooks)."""

    def __init__(self, rules: DeviceRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.rules.__torch_function__(func, types, args, kwargs)


def _kernel_contract(func, args) -> str:
    """What a CUDA kernel asks of its arguments that the CPU's does not."""
    name = str(func)
    if name.startswith("aten.native_batch_norm_backward") and (args[5] is None or args[6] is None):
        # Normalization.cu: save_mean->defined() INTERNAL ASSERT, in eval mode too
        return "native_batch_norm_backward without save_mean / save_invstd (CUDA asserts them)"
    return ""


def _backend_for(group, t: torch.Tensor) -> str:
    """The backend that carries `t`'s device on `group`: 'gloo' or 'nccl'."""
    name = dist.get_backend(group)
    if ":" not in name:
        return name
    pairs = dict(p.split(":") for p in name.split(","))
    return pairs.get(t.device.type, name)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))


READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values into Python (`float(t)`, `t.item()`, `t.tolist()`, ...)
    that hybridpar's own code makes: on a GPU each one waits for every kernel queued before it."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/hybridpar/" in f.filename]
            if frames:
                self.where.append(f"{frames[-1].filename.split('src/')[-1]}:{frames[-1].lineno}")
        return func(*args, **(kwargs or {}))
