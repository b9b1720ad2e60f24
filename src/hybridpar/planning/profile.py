"""The compute profile of a model on this machine, for the planner on a calibrated host or, written
by `hybridpar profile`, for a plan on any cluster (`plan --compute FILE`).

A rank of a P-rank job on a host with C cores runs with max(1, C // P) threads (the launcher sets
it) and shares the cores with the other ranks. The profile times, in this process with that many
threads, the median of training iterations of the model (forward, loss, backward) at each batch a
rank runs (B / Pc for every grid), settled (hybridpar.core.timing), splits it over the leaf layers
by hooks (each leaf's median iteration; the hooks' own overhead is taken out by scaling the leaves
to the iteration measured without them), and times the trainer's optimizer step on the model's
own parameters, per parameter element, settled and bounded by a copy's speed. The planner then
prices every style from what a rank runs under it (planning.cost.compute.ProfileModel), each rank
slowed by the one price of oversubscription: its share of the cores (ranks x threads / cores).

Profiles are cached per model, input shape, thread count and device under the cache folder and
extended with the sample counts a later plan needs; one measured another way or on other cores is
measured again.
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import warnings
from pathlib import Path

from hybridpar.core.cluster import Cluster, cache_dir, cache_write, contention, rank_threads
from hybridpar.core.operations import pair
from hybridpar.core.progress import Phase
from hybridpar.core.splits import slowest_batch
from hybridpar.core.timing import Recheck, Settled, clock, settle
from hybridpar.planning.cost.compute import ProfileModel

__all__ = [
    "as_model",
    "hook_timers",
    "job_counts",
    "load_profile",
    "measure_profile",
    "no_inplace",
    "planning_compute",
    "profile_compute",
    "recheck",
    "write_profile",
]

# how an iteration's time is taken; a cached profile taken another way is measured again
METHOD = "settled medians, per leaf, alone; the trainer's optimizer on the model's own parameters"
FORMAT = "hybridpar-profile/2"


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
    # the median iteration, as `hybridpar validate` and the report measure a run (the fastest
    # of several is low for having been chosen)
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
            k, st = pair(m.kernel_size), pair(m.stride or m.kernel_size)
            pad, dil = pair(m.padding), pair(getattr(m, "dilation", 1))
            seen[name] = (m, Window(k[0], st[0], pad[0], dil[0], x[2]), x[1], x[3])
    return seen


def _busiest_band(window, pr: int) -> tuple[int, int, int, int, int]:
    """The rows a domain layer's busiest rank computes on (Pr ranks): (padding above, halo rows
    above, its own rows read, halo rows below, padding below), from core.halo's geometry;
    the busiest reads the most rows, then receives the most halo rows."""
    best = None
    for p in window.parts(pr):
        (a, b), (o0, o1), (lo, hi) = p.held, p.out, p.reads
        if o0 >= o1:
            continue
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
    kw = pair(module.kernel_size)[1]
    sw = pair(module.stride or module.kernel_size)[1]
    pw = pair(module.padding)[1]
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

    from hybridpar.core.ops import is_plain
    from hybridpar.core.splits import chunk_sizes

    def pick(m) -> bool:  # a subclass's own forward may read its whole weight: not cut here
        ungrouped = isinstance(m, nn.Conv2d) and m.groups == 1
        return (ungrouped or isinstance(m, nn.Linear)) and is_plain(m)

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
    `net`'s parameters, each with a gradient: what the profile times. (torch.optim.SGD with weight decay allocates a gradient-sized temporary per step,
    whose page faults depend on the allocator's history; the trainer never pays them.)"""
    import torch

    from hybridpar.core.optim import KrizhevskySGD

    ps = [p for p in net.parameters() if p.requires_grad]
    for p in ps:
        p.grad = torch.randn_like(p)
    return KrizhevskySGD(ps, lr=1e-9), sum(p.numel() for p in ps)


# the words an element of the optimizer's step moves (v *= mu: 2; v -= lr g, v -= lr wd w,
# w += v: 3 each) against a copy's 2, and how many times that traffic at the speed of a copy
# measured beside it a step may take before it is measured again
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


def _path(model: str, shape: tuple[int, ...], threads: int, device: str, amp: str) -> Path:
    from hybridpar.core.zoo import file_label

    dims = "x".join(map(str, shape))
    where = "" if device == "cpu" else f"-{device}"
    where += "" if amp == "none" else f"-{amp}"
    return cache_dir() / "profiles" / f"{file_label(model)}-{dims}-t{threads}{where}.json"


def _autocast(device: str, amp: str):
    """The trainer's autocast for `amp` on `device` (none: off), which the profile times under,
    without the cache of cast weights: the trainer enters autocast every step, so it casts its
    weights every step, where one context around the whole profile would cast them once."""
    import torch

    return torch.autocast(device, dtype=torch.bfloat16, enabled=amp == "bf16", cache_enabled=False)


@contextlib.contextmanager
def _measuring(model: str, shape: tuple[int, ...], threads: int, device: str, amp: str = "none"):
    """The model on `device` with this process on `threads` threads, under the trainer's
    autocast for `amp`: where the profile measures, and where a check measures it again."""
    import torch

    from hybridpar.core.models import build_any

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        net = build_any(model, shape, None).to(device)
        with _autocast(device, amp):
            yield net
    finally:
        torch.set_num_threads(before)


def recheck(path: Path, repeats: int = 5) -> list[Recheck]:
    """The optimizer step and every iteration of the cached profile at `path`, measured again
    as the profile measured them (threads, device); [] for a profile that does not say how it
    was measured (an older release's)."""
    data = json.loads(Path(path).read_text())
    how = data.get("measured")
    if not isinstance(how, dict) or "update_s" not in data:
        return []
    shape = tuple(how["shape"])
    out = []
    with _measuring(how["model"], shape, how["threads"], how["device"], how["amp"]) as net:
        for n, old in sorted(data["iteration"].items(), key=lambda kv: int(kv[0])):
            _, now = _measure_count(net, shape, int(n), repeats, how["device"], leaves=False)
            spread = max(old.get("s_spread", 0.0), now.spread)
            out.append(Recheck(f"iteration at {n} samples", str(path), old["s"], now.value, spread))
        now = _measure_update(net, repeats, how["device"])
        spread = max(data.get("update_s_spread", 0.0), now.spread)
        out.append(Recheck("update_s", str(path), data["update_s"], now.value, spread))
    return out


def _fresh(cores: int, P: int, calibration: float | None = None) -> dict:
    return {
        "format": FORMAT,
        "machine": platform.node(),
        "method": METHOD,
        "calibration": calibration,  # the host's calibrated FLOP/s: a new calibration re-measures
        "cores": cores,
        "procs": P,
        "per_count": {},
        "bands": {},
        "splits": {},
        "iteration": {},  # {samples: the settled iteration (hybridpar.core.timing.Settled.fields)}
    }


def _cached(path: Path, cores: int, P: int, calibration: float) -> dict:
    """The cached profile, or a fresh one where there is none or it was measured otherwise (by
    another method, on other cores, before the host's latest calibration)."""
    fresh = _fresh(cores, P, calibration)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return fresh
    keys = ("method", "cores", "calibration")
    if any(data.get(k) != fresh[k] for k in keys) or not all(
        isinstance(data.get(k), dict) for k in _TABLES
    ):
        return fresh
    return data


_TABLES = ("per_count", "bands", "splits", "iteration")


def measure_profile(
    data: dict,
    model: str,
    shape: tuple[int, ...],
    counts: list[int],
    bands: list[tuple[int, int]] = (),
    repeats: int = 5,
    threads: int = 1,
    device: str = "cpu",
    amp: str = "none",
) -> bool:
    """Measure into the profile `data` what it lacks: each of `counts`' iteration and leaves
    (`_measure_count`), each (Pr, samples) of `bands` the band shares of its windows and the
    split shares of its layers (`_measure_bands`, `_measure_splits`), and the optimizer's step,
    announced as it goes (core.progress). True where something was measured."""
    missing = sorted({int(n) for n in counts} - {int(k) for k in data["per_count"]})
    shares, splits = data["bands"], data["splits"]
    unbanded = sorted({(int(pr), int(n)) for pr, n in bands} - {_key(k) for k in shares})
    unsplit = sorted({(int(pr), int(n)) for pr, n in bands} - {_key(k) for k in splits})
    if not (missing or unbanded or unsplit or "update_s" not in data):
        return False
    data["measured"] = {"model": model, "shape": list(shape), "threads": threads}
    data["measured"].update(device=device, amp=amp)
    parts = len(missing) + len(unbanded) + len(unsplit) + 1
    what = f"compute profile of {model} on {device} ({', '.join(map(str, counts))} samples)"
    with _measuring(model, shape, threads, device, amp) as net, Phase(what, parts, 2.0) as phase:
        for n in missing:
            data["per_count"][str(n)], whole = _measure_count(net, shape, n, repeats, device)
            data["iteration"][str(n)] = whole.fields("s")
            phase.tick()
        for pr, n in unbanded:
            shares[f"{pr}x{n}"] = _measure_bands(net, shape, pr, n, 2 * repeats, device)
            phase.tick()
        for pr, n in unsplit:
            splits[f"{pr}x{n}"] = _measure_splits(net, shape, pr, n, 2 * repeats, device)
            phase.tick()
        if "update_s" not in data:
            data.update(_measure_update(net, repeats, device).fields("update_s"))
        phase.tick()
    return True


def as_model(data: dict, local: int, source: str) -> ProfileModel:
    """The ProfileModel of a profile's tables for a job with `local` ranks on the profiled host:
    each slowed down as they share its cores (`contention`: the one price of oversubscription)."""
    cores = int(data["cores"])
    threads = int(data.get("measured", {}).get("threads", rank_threads(cores, local)))
    return ProfileModel(
        _read(data["per_count"], int),
        bands=_read(data["bands"], _key),
        splits=_read(data["splits"], _key),
        update_s=float(data["update_s"]),
        contention=contention(cores, local, threads),
        source=source,
    )


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
    `counts`, and for each (Pr, samples) in `bands` the band shares of its windows and the split
    shares of its layers, cached; None where the cluster is not this host (no `cores`: priced by
    FLOPs). On a GPU (`cores`: the GPUs) a rank runs one thread."""
    if cluster.cores is None:
        return None
    gpu = device != "cpu"
    threads = 1 if gpu else rank_threads(cluster.cores, cluster.local(P))
    path = _path(model, shape, threads, device, amp)
    data = _cached(path, cluster.cores, cluster.local(P), cluster.flops)
    if measure_profile(data, model, shape, counts, bands, repeats, threads, device, amp):
        cache_write(path, data)
    return as_model(data, cluster.local(P), str(path))


def job_counts(P: int, B: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The sample counts a rank of a P-rank job on global batch B is timed by (its largest batch
    group's over the grids: core.splits.slowest_batch) and the (Pr, samples) of its bands."""
    from hybridpar.planning.search import grids

    shapes = [(pr, slowest_batch(B, pr, pc) // pc) for pr, pc in grids(P, B)]
    return sorted({n for _, n in shapes}), sorted({(pr, n) for pr, n in shapes if pr > 1})


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
    counts, bands = job_counts(P, B)
    where = "cuda" if device == "cuda" else "cpu"
    return profile_compute(cluster, model, shape, P, counts, bands=bands, device=where, amp=amp)


def write_profile(
    model: str, shape: tuple[int, ...], P: int, B: int, path: Path, repeats: int = 5
) -> ProfileModel:
    """`hybridpar profile`: `model`'s profile for a P-rank job on global batch B, its ranks
    sharing this machine's cores as they would share a host's, written to `path` for
    `plan --compute` on any cluster."""
    import os

    cores = os.cpu_count() or 1
    threads = rank_threads(cores, P)
    counts, bands = job_counts(P, B)
    data = _fresh(cores, P)
    measure_profile(data, model, shape, counts, bands, repeats, threads)
    cache_write(path, data)
    return as_model(data, P, str(path))


def load_profile(path: str | Path) -> ProfileModel:
    """`plan --compute FILE`: a profile `hybridpar profile` wrote, for a job on any cluster, its
    ranks' compute as measured for the job it was made for (`procs` ranks sharing its host's
    `cores`); a file of an older form (a per-sample table) is refused in one line."""
    from hybridpar.core.config import read_json
    from hybridpar.core.errors import ConfigError

    how = "make one with `hybridpar profile --model M --procs P --batch B --out FILE`"
    data = read_json(path, "compute profile", how)
    if isinstance(data, dict) and "per_sample_s" in data:
        raise ConfigError(
            f"compute profile {str(path)!r} is a per-sample table (per_sample_s), which is no "
            f"longer read; {how}"
        )
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"compute profile {str(path)!r} is not a hybridpar profile; {how}")
    try:
        return as_model(data, int(data["procs"]), str(path))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"compute profile {str(path)!r} is malformed ({exc.__class__.__name__}); {how}"
        ) from None


def _read(tables: dict, key) -> dict:
    """Cached tables {key: {leaf: [forward, backward]}} as numbers, each key read by `key`."""
    return {
        key(k): {x: (float(v[0]), float(v[1])) for x, v in t.items()} for k, t in tables.items()
    }


def _key(k: str) -> tuple[int, int]:
    """(Pr, samples) of a band table's key "PRxN"."""
    pr, n = k.split("x")
    return int(pr), int(n)
