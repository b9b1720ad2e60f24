"""The compute profile of a model on this machine, for the planner on a calibrated host.

A rank of a P-rank job on a host with C cores runs with max(1, C // P) threads (the launcher sets
it) and shares the cores with the other ranks. The profile times, in this process with that many
threads, the median of training iterations of the model (forward, loss, backward) at each batch a
rank runs (B / Pc for every grid), settled (hybridpar.core.timing), splits it over the leaf layers by
hooks (each leaf's median iteration; the hooks' own overhead is taken out by scaling the leaves to
the iteration measured without them), and times the trainer's optimizer step on the model's own
parameters, per parameter element, settled and bounded by a copy's speed. It measures beside
the host's other ranks: as many processes as the ranks that run at once on the host's cores
(`busy_ranks`) run the same thing meanwhile, since they share its memory bandwidth and caches
(a memory-bound step beside another takes up to twice as long). Where ranks outnumber the
cores, it also times the iteration with as many processes to a core (`_crowd`): each switch
evicts the other's data, so a rank takes more than its share of the core (`_crowding`). The
planner then prices every style from what a rank runs under it
(planning.cost.compute.ProfileModel), with that slowdown of ranks sharing cores. Every
iteration a rank's compute is scaled to is measured again after the rest, and a third time
where the two passes disagree (`_passes`): the median of passes apart, not one settled batch.

Profiles are cached per model, input shape, thread count and neighbours under the cache folder
and extended with the sample counts a later plan needs; a new calibration of the host measures
them again.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
import warnings
from pathlib import Path

from hybridpar.core.cluster import Cluster, cache_dir, cache_write, contention, rank_threads
from hybridpar.core.progress import Phase
from hybridpar.core.timing import Recheck, Settled, clock, settle, steady_malloc
from hybridpar.planning.cost.compute import ProfileModel

__all__ = ["hook_timers", "no_inplace", "planning_compute", "profile_compute", "recheck"]

# how an iteration's time is taken; a cached profile taken another way is measured again
METHOD = (
    "settled medians, per leaf, beside the host's other ranks; the trainer's optimizer on the "
    "model's own parameters; iterations in passes apart"
)
# two passes of an iteration further apart than this: a third one, and the median of the three
AGREE = 0.10


def no_inplace(model) -> None:
    """Turn off in-place activations (full backward hooks refuse them)."""
    for m in model.modules():
        if hasattr(m, "inplace"):
            m.inplace = False


def hook_timers(model, device="cpu") -> tuple[dict[str, list[float]], dict[str, list[float]], list]:
    """Hooks timing every leaf's forward and backward on `device`: (forward s, backward s, the
    handles)."""
    leaves = {m: n for n, m in model.named_modules() if next(m.children(), None) is None and n}
    fwd: dict[str, list[float]] = {n: [] for n in leaves.values()}
    bwd: dict[str, list[float]] = {n: [] for n in leaves.values()}
    starts: dict[tuple[str, str], float] = {}

    def start(n: str, what: str):
        return lambda *_: starts.__setitem__((n, what), clock(device))

    def stop(n: str, what: str, into: dict[str, list[float]]):
        return lambda *_: into[n].append(clock(device) - starts[(n, what)])

    handles = []
    for m, n in leaves.items():
        handles += [
            m.register_forward_pre_hook(start(n, "f")),
            m.register_forward_hook(stop(n, "f", fwd)),
            m.register_full_backward_pre_hook(start(n, "b")),
            m.register_full_backward_hook(stop(n, "b", bwd)),
        ]
    return fwd, bwd, handles


def _iteration(model, x, y) -> None:
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y) if out.dim() == 2 else out.float().square().mean()
    loss.backward()


def _measure_count(
    model, shape, n: int, repeats: int, device="cpu", leaves: bool = True
) -> tuple[dict[str, tuple[float, float]], Settled]:
    """({leaf: (forward s, backward s)} of one iteration on n samples ({} where not `leaves`),
    the iteration settled (hybridpar.core.timing.settle) without hooks); the leaves sum to that
    iteration (their remainder, loss and autograd glue, is spread over them in proportion)."""
    import torch

    x = torch.randn(n, *shape, device=device)
    with torch.no_grad():
        out = model(x[:1])
    y = torch.randint(0, out.shape[-1], (n,), device=device)
    no_inplace(model)
    _iteration(model, x, y)  # warm up

    def batch() -> list[float]:
        ts = []
        for _ in range(repeats):
            t0 = clock(device)
            _iteration(model, x, y)
            ts.append(clock(device) - t0)
        return ts

    whole = settle(batch)
    if not leaves:
        return {}, whole
    fwd, bwd, handles = hook_timers(model, device)
    try:
        with warnings.catch_warnings():  # the first layer's input needs no gradient: fine here
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for _ in range(repeats):
                _iteration(model, x, y)
    finally:
        for h in handles:
            h.remove()
    # a module called several times per iteration (shared weights) counts every call
    per = {k: (_median_iteration(fwd[k], repeats), _median_iteration(bwd[k], repeats)) for k in fwd}
    total = sum(f + b for f, b in per.values())
    # the median iteration, as `hybridpar validate` and the report measure a run: the fastest
    # of five was 2-10 % below the median of alexnet-owt, resnet20 and digits-wide on this
    # 2-core machine, and every plan was predicted low
    scale = whole.value / total if total > 0 else 1.0
    return {k: (f * scale, b * scale) for k, (f, b) in per.items()}, whole


def _median_iteration(calls: list[float], repeats: int) -> float:
    """A leaf's seconds in the median of `repeats` iterations, from its calls in order (the same
    number in each). The mean lets one stalled call stand for all, and the planner then routes
    around a layer that is no slower than its twins."""
    if not calls:
        return 0.0
    k, extra = divmod(len(calls), repeats)
    if extra or not k:  # calls that do not split into iterations: their mean per iteration
        return sum(calls) / repeats
    return statistics.median(sum(calls[i * k : (i + 1) * k]) for i in range(repeats))


def _calls(model, x, pick) -> list[tuple[str, object, tuple[int, ...]]]:
    """(name, module, its input's shape) of every call of a module `pick` takes, in the order of
    one forward of x (no_grad, in eval mode: the shapes only, no batch statistics)."""
    import torch

    calls: list = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, name=name: calls.append((name, mod, tuple(args[0].shape)))
        )
        for name, m in model.named_modules()
        if pick(m)
    ]
    training = model.training
    try:
        with torch.no_grad():
            model.eval()
            model(x)
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    return calls


def _windows(model, shape: tuple[int, ...]) -> dict[str, tuple]:
    """{leaf: (module, Window, input channels, input width)} of every 2-d convolution (zero
    padding) and max or average pooling, in forward order: the layers the domain style runs on
    a band of rows."""
    import torch
    from torch import nn

    from hybridpar.core.halo import Window

    def pick(m) -> bool:
        conv = isinstance(m, nn.Conv2d) and m.padding_mode == "zeros"
        pool = isinstance(m, (nn.MaxPool2d, nn.AvgPool2d))
        return (conv or pool) and not isinstance(m.padding, str)

    seen: dict[str, tuple] = {}
    for name, m, x in _calls(model, torch.zeros(1, *shape), pick):
        if len(x) == 4:  # its last call's input
            k, st = _pair(m.kernel_size), _pair(m.stride or m.kernel_size)
            pad, dil = _pair(m.padding), _pair(getattr(m, "dilation", 1))
            seen[name] = (m, Window(k[0], st[0], pad[0], dil[0], x[2]), x[1], x[3])
    return seen


def _pair(v) -> tuple[int, int]:
    """A module's (height, width) argument from an int or a pair."""
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _busiest_band(window, pr: int) -> tuple[int, int, int, int, int]:
    """The rows a domain layer's busiest rank computes on (Pr ranks): (padding above, halo rows
    above, its own rows read, halo rows below, padding below), from core.halo's geometry;
    the busiest reads the most rows, then receives the most halo rows."""
    from hybridpar.core.halo import bands

    ins, outs = bands(window.h_in, pr), bands(window.h_out, pr)
    best = None
    for (a, b), (o0, o1) in zip(ins, outs, strict=True):
        if o0 >= o1:
            continue
        lo, hi = window.reads(o0, o1)
        rows = (
            max(0, -lo),
            max(0, a - max(lo, 0)),
            max(0, min(hi, b) - max(lo, a)),
            max(0, min(hi, window.h_in) - b),
            max(0, hi - window.h_in),
        )
        key = (sum(rows), rows[1] + rows[3])
        if best is None or key > best[0]:
            best = (key, rows)
    return best[1] if best else (0, 0, 0, 0, 0)


def _band_ratio(
    module, window, c: int, w: int, n: int, pr: int, needs_dx: bool, repeats: int, device="cpu"
) -> tuple[float, float]:
    """How much of its whole-image (forward, backward) time a convolution or pooling takes on
    the busiest rank's band of `pr`, on n examples: the runtime's call on band and halo (the
    received rows copied in and joined, the height padding as rows of fill, the gradients of the
    rows sent added back to the band's) against the module on whole images, timed the same way
    here. Small maps are not split evenly by work: resnet20's 8 x 8 maps in 2 bands read 6 rows
    each, and a convolution's cost per row grows as its rows shrink."""
    import torch
    from torch import nn

    top_pad, top, own, bottom, bottom_pad = _busiest_band(window, pr)
    fill = float("-inf") if isinstance(module, nn.MaxPool2d) else 0.0
    compute = _on_rows(module, window)

    def whole() -> tuple[float, float]:
        x = torch.randn(n, c, window.h_in, w, device=device, requires_grad=needs_dx)
        t0 = clock(device)
        y = module(x)
        t1 = clock(device)
        y.backward(torch.ones_like(y))
        return t1 - t0, clock(device) - t1

    def band() -> tuple[float, float]:
        x = torch.randn(n, c, own, w, device=device, requires_grad=needs_dx)
        halos = [torch.randn(n, c, h, w, device=device) for h in (top, bottom) if h]
        t0 = clock(device)
        got = [h.clone().requires_grad_(needs_dx) for h in halos]  # out of the shared segment
        pieces = [*got]
        pieces.insert(1 if top else 0, x)
        if top_pad:
            pieces.insert(0, x.new_full((n, c, top_pad, w), fill))
        if bottom_pad:
            pieces.append(x.new_full((n, c, bottom_pad, w), fill))
        y = compute(torch.cat(pieces, dim=2) if len(pieces) > 1 else x)
        t1 = clock(device)
        y.backward(torch.ones_like(y))
        if needs_dx and got:  # the rows sent come back as gradients, added to the band's
            k = min(own, got[0].shape[2])
            g = x.grad.clone()
            g[:, :, :k] += got[0].grad[:, :, :k]
        return t1 - t0, clock(device) - t1

    if own <= 0:
        return 0.0, 0.0
    module.zero_grad(set_to_none=True)
    wf, wb = _medians(whole, repeats)
    bf, bb = _medians(band, repeats)
    module.zero_grad(set_to_none=True)
    return (bf / wf if wf > 0 else 1.0 / pr), (bb / wb if wb > 0 else 1.0 / pr)


def _on_rows(module, window):
    """The convolution or pooling as the runtime computes it on a band's rows (their height
    already padded, the width padded as the module does)."""
    from torch import nn
    from torch.nn import functional as F

    if isinstance(module, nn.Conv2d):
        wp = (0, module.padding[1])
        st, dil, g = module.stride, module.dilation, module.groups
        return lambda rows: F.conv2d(rows, module.weight, module.bias, st, wp, dil, g)
    kw = _pair(module.kernel_size)[1]
    sw = _pair(module.stride or module.kernel_size)[1]
    pw = _pair(module.padding)[1]
    pool = F.max_pool2d if isinstance(module, nn.MaxPool2d) else F.avg_pool2d
    return lambda rows: pool(rows, (window.kernel, kw), (window.stride, sw), (0, pw))


def _medians(run, repeats: int) -> tuple[float, float]:
    """The median (forward, backward) seconds of `repeats` calls of `run`, after one warm-up."""
    run()
    fs, bs = zip(*(run() for _ in range(repeats)), strict=True)
    return statistics.median(fs), statistics.median(bs)


def _measure_bands(
    model, shape, pr: int, n: int, repeats: int, device="cpu"
) -> dict[str, tuple[float, float]]:
    """{leaf: (forward, backward) share of its time} on the busiest rank of `pr` bands, n
    examples (`_band_ratio`); the first window computes no input gradient, as the profile's own
    iterations (the model's input has none)."""
    out, first = {}, True
    for name, (module, window, c, w) in _windows(model, shape).items():
        out[name] = _band_ratio(module, window, c, w, n, pr, not first, repeats, device)
        first = False
    return out


def _measure_splits(
    model, shape, pr: int, n: int, repeats: int, device="cpu"
) -> dict[str, tuple[float, float]]:
    """{leaf: (forward, backward) share of its time} of every linear layer and ungrouped
    convolution on the rank of `pr` that holds the most output units (torch.chunk's split,
    core.splits.chunk_sizes, as the model style lays them out), on n examples (`_split_ratio`;
    the first layer computes no input gradient, as in the profile's iterations). A small
    layer's time does not fall with its units: resnet20's 16-channel convolutions at 8 examples
    took as long forward with half of them, where 1/Pr priced half."""
    import torch
    from torch import nn

    from hybridpar.core.splits import chunk_sizes

    def pick(m) -> bool:
        ungrouped = isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.groups == 1
        return ungrouped or isinstance(m, nn.Linear)

    inputs: dict[str, tuple] = {}
    for name, m, x in _calls(model, torch.zeros(n, *shape, device=device), pick):
        inputs.setdefault(name, (m, x))  # its first call's input
    return {
        name: _split_ratio(module, x, chunk_sizes(module.weight.shape[0], pr)[0], i > 0, repeats)
        for i, (name, (module, x)) in enumerate(inputs.items())
    }


def _split_ratio(module, x_shape, k: int, dx: bool, repeats: int) -> tuple[float, float]:
    """(forward, backward) time of `module` with the first k of its output units' weights over
    its time whole, on inputs of `x_shape` (with an input gradient where `dx`): medians of
    `repeats` calls of each, taken in turn."""
    import torch
    from torch.func import functional_call

    w = module.weight
    device = w.device

    def run(units: int) -> tuple[float, float]:
        params = {"weight": w[:units].detach().requires_grad_()}
        if module.bias is not None:
            params["bias"] = module.bias[:units].detach().requires_grad_()
        x = torch.randn(x_shape, device=device, requires_grad=dx)
        t0 = clock(device)
        y = functional_call(module, params, (x,))
        t1 = clock(device)
        y.backward(torch.ones_like(y))
        return t1 - t0, clock(device) - t1

    run(w.shape[0]), run(k)  # warm up
    whole, part = zip(*((run(w.shape[0]), run(k)) for _ in range(repeats)), strict=True)
    (wf, wb), (pf, pb) = (map(statistics.median, zip(*t, strict=True)) for t in (whole, part))
    share = k / w.shape[0]
    return (pf / wf if wf > 0 else share), (pb / wb if wb > 0 else share)


def _stepper(net):
    """The trainer's optimizer (hybridpar.core.optim.KrizhevskySGD: in place, no temporaries) over
    `net`'s parameters, each with a gradient: what the profile times and its neighbours run
    beside it. (torch.optim.SGD with weight decay allocates a gradient-sized temporary per step,
    whose page faults depend on the allocator's history; the trainer never pays them.)"""
    import torch

    from hybridpar.core.optim import KrizhevskySGD

    ps = [p for p in net.parameters() if p.requires_grad]
    for p in ps:
        p.grad = torch.randn_like(p)
    return KrizhevskySGD(ps, lr=1e-9), sum(p.numel() for p in ps)


# the words an element of the optimizer's step moves (v *= mu: 2; v -= lr g, v -= lr wd w,
# w += v: 3 each) against a copy's 2, and how many times that traffic at the speed of a copy
# measured beside it a step may take before it is measured again (docs/validate.md)
STEP_WORDS, STEP_BOUND = 11, 4.0


def _measure_update(net, repeats: int = 5, device="cpu") -> Settled:
    """Seconds per parameter element of the trainer's optimizer step over `net`'s parameters on
    `device` (`_stepper`), settled (hybridpar.core.timing.settle): a batch slower than STEP_BOUND x
    its memory traffic at the speed of a copy does not count."""
    import torch

    opt, n = _stepper(net)
    m = min(n, 1 << 22)
    a, b = torch.randn(m, device=device), torch.empty(m, device=device)

    def copy_s() -> float:
        ts = []
        for _ in range(3):
            t0 = clock(device)
            b.copy_(a)
            ts.append(clock(device) - t0)
        return statistics.median(ts) / m

    def batch() -> list[float]:
        ts = []
        for _ in range(repeats):
            t0 = clock(device)
            opt.step()
            ts.append((clock(device) - t0) / n)
        return ts

    opt.step()  # the velocities' first allocation
    copy_s()
    bound = STEP_BOUND * STEP_WORDS / 2 * copy_s()
    try:
        return settle(batch, bound=bound)
    finally:
        net.zero_grad(set_to_none=True)


def _path(
    model: str,
    shape: tuple[int, ...],
    threads: int,
    busy: int = 1,
    device: str = "cpu",
    amp: str = "none",
) -> Path:
    from hybridpar.core.zoo import file_label

    dims = "x".join(map(str, shape))
    beside = f"-b{busy}" if busy > 1 else ""
    where = "" if device == "cpu" else f"-{device}"
    where += "" if amp == "none" else f"-{amp}"
    return cache_dir() / "profiles" / f"{file_label(model)}-{dims}-t{threads}{beside}{where}.json"


def _autocast(device: str, amp: str):
    """The trainer's autocast for `amp` on `device` (none: off), which the profile times under,
    without the cache of cast weights: the trainer enters autocast every step, so it casts its
    weights every step, where one context around the whole profile would cast them once."""
    import torch

    return torch.autocast(device, dtype=torch.bfloat16, enabled=amp == "bf16", cache_enabled=False)


def busy_ranks(cores: int, local: int, threads: int) -> int:
    """How many of a host's `local` ranks of `threads` threads run at once: all of them, up to
    the cores they fill (the rest wait for a core: the contention factor prices that)."""
    return max(1, min(local, cores // threads))


UPDATE = -1  # a neighbour's phase: the optimizer's step (a positive phase: the model at that count)


def _neighbour(model: str, shape: tuple[int, ...], threads: int, amp: str) -> None:
    """A neighbour of the profile (`python -m hybridpar.planning.profile`): runs what the profile
    measures over and over, as the host's other ranks would beside it. Each line on stdin is the
    next phase (the model's training iteration at that many samples, or `UPDATE`: the optimizer's
    step), acknowledged on stdout once running. The profile kills it when done; end of input (the
    profile gone) ends it too."""
    import sys
    import threading

    import torch

    from hybridpar.core.models import build_any

    steady_malloc()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = build_any(model, shape, None)
    no_inplace(net)
    opt = None  # built at the first step it runs: its first build imports torch._dynamo
    phase = [None]

    def read() -> None:
        for line in sys.stdin:
            phase[0] = int(line)
        phase[0] = 0

    threading.Thread(target=read, daemon=True).start()
    print("ready", flush=True)
    current, x, y = None, None, None
    while True:
        p = phase[0]
        if p == 0:
            return
        if p is None:
            time.sleep(0.001)
            continue
        if p != current:
            if p < 0 and opt is None:
                opt, _ = _stepper(net)
            if p > 0:
                x = torch.randn(p, *shape)
                with torch.no_grad():
                    classes = net(x[:1]).shape[-1]
                y = torch.randint(0, classes, (p,))
            current = p
            print(p, flush=True)
        if p > 0:
            with _autocast("cpu", amp):
                _iteration(net, x, y)
        else:
            opt.step()


class _Neighbours:
    """`busy - 1` processes that keep the host's other cores doing what the profile measures
    (`_neighbour`): ranks that share a host share its memory bandwidth and caches, so a step
    streamed beside another takes longer than alone, as the ranks of a job step their optimizers
    together. Plain subprocesses: multiprocessing would run the caller's main module again in
    each."""

    def __init__(
        self, model: str, shape: tuple[int, ...], threads: int, busy: int, amp: str = "none"
    ) -> None:
        self.spec, self.busy, self.amp = (model, shape, threads), busy, amp
        self.procs: list = []
        self.phase: int | None = None

    def __enter__(self) -> _Neighbours:
        import subprocess
        import sys

        model, shape, threads = self.spec
        args = [model, "x".join(map(str, shape)), str(threads), self.amp]
        for _ in range(self.busy - 1):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "hybridpar.planning.profile", *args],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            # what this process's first optimizer imports (1.4 s here), while the neighbours start
            import torch._dynamo  # noqa: F401

            for p in self.procs:
                self._expect(p, "ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    @staticmethod
    def _expect(p, what: str, timeout_s: float = 120.0) -> None:
        """Read the neighbour's lines until it says `what` (a model may print lines of its own)."""
        import select

        deadline, line = time.monotonic() + timeout_s, ""
        while line != what:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = p.stdout.readline() if ready else ""
            if not line:  # end of output (the neighbour died) or out of time
                raise RuntimeError(
                    f"compute profile: a neighbour process did not say {what!r} "
                    f"(exit {p.poll()}); try again, or plan by FLOPs with a cluster preset"
                )
            line = line.strip()

    def run(self, phase: int) -> None:
        """Every neighbour doing `phase` before this returns (they acknowledge a change)."""
        if phase == self.phase:
            return
        self.phase = phase
        for p in self.procs:
            p.stdin.write(f"{phase}\n")
            p.stdin.flush()
        for p in self.procs:
            self._expect(p, str(phase))

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()  # it holds nothing but its own memory; an exit would take a second
        for p in self.procs:
            p.wait()
            with contextlib.suppress(OSError):
                p.stdin.close()
            p.stdout.close()


@contextlib.contextmanager
def _measuring(
    model: str, shape: tuple[int, ...], threads: int, busy: int, device: str, amp: str = "none"
):
    """(the model on `device`, its neighbours) with this process on `threads` threads, under the
    trainer's autocast for `amp`: where the profile measures, and where a check measures it
    again."""
    import torch

    from hybridpar.core.models import build_any

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    steady_malloc()  # as the ranks allocate (runtime.launcher)
    try:
        torch.manual_seed(0)
        net = build_any(model, shape, None).to(device)
        with _Neighbours(model, shape, threads, busy, amp) as beside, _autocast(device, amp):
            yield net, beside
    finally:
        torch.set_num_threads(before)


def recheck(path: Path, repeats: int = 5) -> list[Recheck]:
    """The optimizer step and every iteration of the cached profile at `path`, measured again
    as the profile measured them (threads, neighbours, device); [] for a profile that does not
    say how it was measured (an older release's)."""
    data = json.loads(Path(path).read_text())
    how = data.get("measured")
    if not isinstance(how, dict) or "update_s" not in data:
        return []
    shape = tuple(how["shape"])
    out = []
    how_else = (how["threads"], how["busy"], how["device"], how.get("amp", "none"))

    def again(quantity: str, old: dict, now: Settled) -> Recheck:
        spread = max(old.get("s_spread", 0.0), now.spread)
        return Recheck(quantity, str(path), old["s"], now.value, spread)

    with _measuring(how["model"], shape, *how_else) as (net, b):
        for n, old in sorted(data["iteration"].items(), key=lambda kv: int(kv[0])):
            b.run(int(n))
            _, now = _measure_count(net, shape, int(n), repeats, how["device"], leaves=False)
            out.append(again(f"iteration at {n} samples", old, now))
        for k in sorted({pr for pr, _ in map(_key, data.get("crowded", {}))}):
            for n, now in _crowd(net, sorted(_counts(data["crowded"], k)), repeats, b, k):
                old = data["crowded"][f"{k}x{n}"]
                out.append(again(f"iteration at {n} samples, {k} ranks to a core", old, now))
        b.run(UPDATE)
        now = _measure_update(net, repeats, how["device"])
        spread = max(data.get("update_s_spread", 0.0), now.spread)
        out.append(Recheck("update_s", str(path), data["update_s"], now.value, spread))
    return out


def _load(path: Path, cluster: Cluster) -> dict:
    """The cached profile, or a fresh one when there is none or the host was calibrated again."""
    fresh = {
        "calibration": cluster.flops,
        "machine": platform.node(),
        "method": METHOD,
        "per_count": {},
        "bands": {},
        "splits": {},
        "iteration": {},  # {samples: the settled iteration (hybridpar.core.timing.Settled.fields)}
        "crowded": {},  # {"KxN": the same with K ranks to a core (`_crowd`)}
    }
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return fresh
    if data.get("calibration") != cluster.flops or data.get("method") != METHOD:
        return fresh
    if not all(isinstance(data.get(k), dict) for k in ("per_count", "iteration", "bands")):
        return fresh
    if not isinstance(data.setdefault("splits", {}), dict):  # none before 2026-11-27
        return fresh
    if not isinstance(data.setdefault("crowded", {}), dict):  # none in older profiles
        return fresh
    return data


def profile_compute(
    cluster: Cluster,
    model: str,
    shape: tuple[int, ...],
    P: int,
    counts: list[int],
    repeats: int = 5,
    bands: list[tuple[int, int]] = (),
    device: str = "cpu",
    amp: str = "none",
) -> ProfileModel | None:
    """The ProfileModel of `model` for a P-rank job on `device` of this calibrated host, under
    the trainer's autocast for `amp` (bf16 kernels for --amp bf16), at the sample counts
    `counts`, and for each (Pr, samples) in `bands` the band shares of its windows
    (`_measure_bands`) and the split shares of its linear layers and convolutions
    (`_measure_splits`); None where the cluster is not this host (no `cores`: priced by
    FLOPs). On a GPU (`cores`: the GPUs) the ranks that share one take turns: no neighbours."""
    if cluster.cores is None:
        return None
    local = cluster.local(P)  # the ranks that share one host's cores (or GPUs)
    gpu = device != "cpu"
    threads = 1 if gpu else rank_threads(cluster.cores, local)
    busy = 1 if gpu else busy_ranks(cluster.cores, local, threads)
    path = _path(model, shape, threads, busy, device, amp)
    data = _load(path, cluster)
    missing = sorted({int(n) for n in counts} - {int(k) for k in data["per_count"]})
    shares, splits, crowded = data["bands"], data["splits"], data["crowded"]
    unbanded = sorted({(int(pr), int(n)) for pr, n in bands} - {_key(k) for k in shares})
    unsplit = sorted({(int(pr), int(n)) for pr, n in bands} - {_key(k) for k in splits})
    slower = contention(cluster.cores, local, threads)  # a rank's time over its time alone
    k = math.ceil(slower)  # the most ranks one core runs in turn
    uncrowded = sorted({int(n) for n in counts if k > 1 and not gpu} - _counts(crowded, k))
    if missing or unbanded or unsplit or uncrowded or "update_s" not in data:
        data["measured"] = {"model": model, "shape": list(shape), "threads": threads}
        data["measured"].update(busy=busy, device=device, amp=amp)
        parts = 2 * len(missing) + len(unbanded) + len(unsplit) + len(uncrowded) + 1
        what = f"compute profile of {model} on {device} ({', '.join(map(str, counts))} samples)"
        with (
            _measuring(model, shape, threads, busy, device, amp) as (net, beside),
            Phase(what, total=parts, every_s=2.0) as phase,
        ):
            first = {}
            for n in missing:
                beside.run(n)
                data["per_count"][str(n)], first[n] = _measure_count(net, shape, n, repeats, device)
                phase.tick()
            for pr, n in unbanded:
                beside.run(n)
                shares[f"{pr}x{n}"] = _measure_bands(net, shape, pr, n, 2 * repeats, device)
                phase.tick()
            for pr, n in unsplit:
                beside.run(n)
                splits[f"{pr}x{n}"] = _measure_splits(net, shape, pr, n, 2 * repeats, device)
                phase.tick()
            if "update_s" not in data:
                beside.run(UPDATE)
                data.update(_measure_update(net, repeats, device).fields("update_s"))
            phase.tick()
            for n, whole in _crowd(net, uncrowded, repeats, beside, k):
                crowded[f"{k}x{n}"] = whole.fields("s")
                phase.tick()

            def alone(n: int) -> Settled:
                beside.run(n)
                return _measure_count(net, shape, n, repeats, device, leaves=False)[1]

            for n, entry in _passes(missing, alone, first).items():
                phase.tick()
                data["iteration"][str(n)] = entry
                scale = entry["s"] / first[n].value  # the leaves sum to the iteration
                leaves = data["per_count"][str(n)]
                leaves.update({x: (f * scale, b * scale) for x, (f, b) in leaves.items()})
        cache_write(path, data)
    return ProfileModel(
        _read(data["per_count"], int),
        bands=_read(shares, _key),
        splits=_read(splits, _key),
        update_s=float(data["update_s"]),
        contention=slower,
        crowding=_crowding(data, k, counts),
        source=str(path),
    )


def _passes(counts: list[int], measure, first: dict[int, Settled]) -> dict[int, dict]:
    """Each count's iteration (`measure(n)`: Settled) in passes: `first`, measured already, a
    second over every count after the rest of the profile, and a third where the two differ by
    more than AGREE; the cache's entry of each, with the median of its passes. A slow minute of
    the machine then has to last through two of three passes to set a price (docs/validate.md;
    the crowded iterations are measured once)."""
    runs = {n: [first[n].value, measure(n).value] for n in counts}
    for n, v in runs.items():
        if abs(v[1] / v[0] - 1) > AGREE:
            v.append(measure(n).value)
    return {
        n: first[n].fields("s") | {"s": statistics.median(v), "s_passes": v}
        for n, v in runs.items()
    }


def _crowd(net, counts: list[int], repeats: int, beside: _Neighbours, k: int):
    """(n, the settled iteration at n samples) for each of `counts`, with k times as many
    processes running the model as the profile measured beside (`beside`): the cores time-shared
    as the ranks of a job with up to `k` ranks to a core share them."""
    if not counts:
        return
    model, shape, threads = beside.spec
    with _Neighbours(model, shape, threads, (k - 1) * beside.busy + 1, beside.amp) as more:
        for n in counts:
            beside.run(n)
            more.run(n)
            yield n, _measure_count(net, shape, n, repeats, leaves=False)[1]


def _crowding(data: dict, k: int, counts) -> dict[int, float]:
    """{n: how much more than k times its iteration a rank's iteration at n samples takes with k
    ranks to a core} for each of `counts` measured (their caches evicted at every switch, beyond
    the share of the core the contention prices; the working set, and so the loss, depends on
    the count): the crowded iteration over k times the iteration beside the busy ranks, at
    least 1 (time-sharing never speeds work up); {} where not measured (a GPU, a core to each
    rank)."""
    return {
        n: max(1.0, data["crowded"][f"{k}x{n}"]["s"] / (k * data["iteration"][str(n)]["s"]))
        for n in sorted({int(n) for n in counts})
        if f"{k}x{n}" in data["crowded"] and str(n) in data["iteration"]
    }


def planning_compute(
    cluster: Cluster,
    model: str,
    shape: tuple[int, ...],
    P: int,
    B: int,
    device: str = "cpu",
    amp: str = "none",
) -> ProfileModel | None:
    """The compute model a plan for P ranks and global batch B is priced with on `cluster`: a
    profile of `model` at every batch a rank can run (B / Pc over the grids), timed on the job's
    device (cuda: a GPU, synchronised) of a calibrated host and in its precision (`amp`); None
    (FLOPs at the cluster's rate) elsewhere."""
    from hybridpar.planning.search import grids

    shapes = grids(P, B)
    bands = sorted({(pr, B // pc) for pr, pc in shapes if pr > 1})
    counts = sorted({B // pc for _, pc in shapes})
    where = "cuda" if device == "cuda" else "cpu"
    return profile_compute(cluster, model, shape, P, counts, bands=bands, device=where, amp=amp)


def _read(tables: dict, key) -> dict:
    """Cached tables {key: {leaf: [forward, backward]}} as numbers, each key read by `key`."""
    return {
        key(k): {x: (float(v[0]), float(v[1])) for x, v in t.items()} for k, t in tables.items()
    }


def _key(k: str) -> tuple[int, int]:
    """(Pr, samples) of a band table's key "PRxN" (a crowded iteration's: (ranks to a core, N))."""
    pr, n = k.split("x")
    return int(pr), int(n)


def _counts(table: dict, first: int) -> set[int]:
    """The sample counts of `table`'s keys "FIRSTxN"."""
    return {n for pr, n in map(_key, table) if pr == first}


if __name__ == "__main__":  # a neighbour of a profile (`_Neighbours`)
    import sys

    shape = tuple(int(d) for d in sys.argv[2].split("x"))
    _neighbour(sys.argv[1], shape, int(sys.argv[3]), sys.argv[4])
