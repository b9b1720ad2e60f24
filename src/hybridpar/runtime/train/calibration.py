"""`hybridpar calibrate`: time real all-reduces on this machine, fit alpha and beta, cache them.

Each size is all-reduced `repeats` times on `nproc` local ranks (gloo on CPU); the median times are
fitted to the model the planner uses, t = 2 ceil(log p) alpha + 2 (p-1)/p n beta: beta from the
two largest sizes, alpha from the smallest (`fit_network`).
A sustained FLOP rate per process is measured with a matrix multiply at the thread count a rank
gets. The result is written to the cache as the cluster `localhost`.

Two levels. When the ranks sit on several hosts (a job under torchrun across nodes, or ranks named
onto hosts by HYBRIDPAR_HOST), each level is measured on its own: the ranks of every host
all-reduce among themselves at once (the host's alpha and beta, and its shared memory), then one
rank per host all-reduces over the network (the network's alpha and beta, one flow: the cost
model multiplies its beta by the groups that share a host's link). The file then has a second
level, `[network]` with `ranks_per_host` (hybridpar.core.cluster).

The small all-reduce through a host's shared memory (`small_alpha`) is also what the cost model
charges each time a plan's ranks meet in a blocking collective (planning.cost.sync): across
hosts, the same all-reduce over all of a job's ranks (`[network]`'s `small_alpha`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.core.choices import CODECS
from hybridpar.core.cluster import cache_write, localhost_path
from hybridpar.core.errors import ConfigError
from hybridpar.core.progress import Phase
from hybridpar.core.timing import TOL, TRIES, Recheck, Settled, clock, settle, spread
from hybridpar.planning.cost.collectives import clog2
from hybridpar.runtime.comm.codecs import time_codec
from hybridpar.runtime.comm.devices import local_gpu
from hybridpar.runtime.comm.grid import new_group
from hybridpar.runtime.comm.host import host_names
from hybridpar.runtime.launcher import launch, under_torchrun

__all__ = ["calibrate", "calibrate_in_job", "fit_network", "recheck"]

SIZES = (2**10, 2**14, 2**17, 2**20, 2**22, 2**24)  # bytes


def _time_allreduce(
    sizes: tuple[int, ...], repeats: int, device: str = "cpu", group=None, timed: bool = True
) -> dict[int, tuple[float, float]]:
    """{size: (median seconds, spread)} of an all-reduce of each size over `group` (the world
    where None), every repeat started together (a barrier of the world), in batches until every
    rank's batch has a spread of at most hybridpar.core.timing.TOL (the ranks agree on it; TRIES at
    most: then the median of every batch). A rank outside the group (`timed` False) only joins
    the barriers."""

    out = {}
    where = _rank_device(device)
    for n in sizes:
        t = torch.ones(n // 4, device=where)
        if timed:
            dist.all_reduce(t, group=group)  # warm up the connection for this size
        every: list[float] = []
        for _ in range(TRIES):
            ts = []
            # small sizes take microseconds and their spread (a rank woken late) is of the
            # same order: more repeats, and the fit weighs every size by its relative error
            for _ in range(repeats if n > 2**17 else max(repeats, 50)):
                dist.barrier()
                t0 = clock(where)
                if timed:
                    dist.all_reduce(t, group=group)
                ts.append(clock(where) - t0)
            worst = torch.tensor([spread(ts) if timed else 0.0], device=where)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank decides alike
            if worst.item() <= TOL:
                every = ts
                break
            every += ts
        out[n] = (statistics.median(every), spread(every))
    return out


def _time_levels(names: list[str], sizes: tuple[int, ...], repeats: int) -> dict:
    """The two levels of a job whose ranks sit on several hosts (`names`: each rank's host):
    every host's ranks all-reduce among themselves at once, then the first rank of each host
    all-reduces with the others' first ranks over the network. Collective over the world."""

    me, hosts = dist.get_rank(), sorted(set(names), key=names.index)
    members = {h: [r for r, n in enumerate(names) if n == h] for h in hosts}
    local = None
    for h in hosts:  # every rank creates every group, in the same order
        g = new_group(members[h], None, "hybridpar_calibrate_host", "calibrate-host", shm=True)
        if me in members[h]:
            local = g
    leaders = [members[h][0] for h in hosts]
    net = new_group(leaders, None, "hybridpar_calibrate_net", "calibrate-net")
    sizes_local = {len(m) for m in members.values()}
    shared = min(sizes_local) > 1
    shm = [_time_shm(local) if shared else (None, None)]
    intra = _time_allreduce(sizes, repeats, group=local.pg) if shared else None
    shm.append(_time_shm(local) if shared else (None, None))
    inter = _time_allreduce(sizes, repeats, group=net.pg, timed=me in leaders)
    shm.append(_time_shm(local) if shared else (None, None))
    small, shm_beta = _mean_shm(shm)
    world = new_group(
        list(range(dist.get_world_size())), None, "hybridpar_calibrate_world", "calibrate-world"
    )
    # a small all-reduce (what batch-norm statistics take) over all of them, across the hosts:
    # timed, not derived from the leaders' alpha (the ranks share cores with the link's packet
    # processing, and each waits for the slowest; docs/cluster.md)
    stats = torch.zeros(33, dtype=torch.float64)
    mine = _median_s(lambda: dist.all_reduce(stats, group=world.pg), warmup=10, repeats=60)
    small_net: list = [None] * dist.get_world_size()
    dist.all_gather_object(small_net, mine)
    return {
        "net_small": statistics.fmean(small_net),
        "hosts": len(hosts),
        "ranks_per_host": max(sizes_local),
        "uneven": len(sizes_local) > 1,
        "intra": intra,
        "inter": inter,
        "small": small,
        "shm_beta": shm_beta,
    }


def _median_s(fn, warmup: int, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_shm(group=None, piece: int = 1 << 18) -> tuple[float | None, float | None]:
    """The shared-memory path (comm.small) on this host: `small_alpha`, the median seconds of a
    33-element float64 all-reduce (what BN statistics take), and `shm_beta`, seconds per byte of
    an all-gather of `piece` float32 per rank (what the activations of model-parallel layers
    take): its median less small_alpha, over the bytes each rank receives. (None, None) where
    the path does not apply (several hosts). `group`: a host's ranks (comm.grid.new_group with
    shared memory), else the world."""

    if group is None:
        everyone = list(range(dist.get_world_size()))
        group = new_group(everyone, None, "hybridpar_world", "world", shm=True)
    r = group.shm
    if r is None:
        return None, None
    stats = torch.ones(33, dtype=torch.float64)
    alpha = _median_s(lambda: r.small_all_reduce(stats), warmup=10, repeats=200)
    p, acts = dist.get_world_size(group.pg), torch.ones(piece)
    gather = _median_s(lambda: r.all_gather(acts, [piece] * p, 0), warmup=3, repeats=20)
    received = (p - 1) * 4 * piece  # the cost model's all-gather volume, (p-1)/p of the whole
    return alpha, max(0.0, gather - alpha) / received


def _mean_shm(measured: list[tuple[float | None, float | None]]) -> tuple[float | None, ...]:
    """(small_alpha, shm_beta): the mean of `_time_shm`'s measurements spread over the
    calibration. A small collective of ranks that share cores can cost one of two levels for
    seconds at a time, so one measurement's median is either; a step's many calls see both, in
    proportion."""
    return tuple(
        None if any(x is None for x in xs) else statistics.fmean(xs)
        for xs in zip(*measured, strict=True)
    )


def _rank_device(device: str):
    """This rank's device for `device` (cuda: its GPU, shared with others under gloo)."""

    if device != "cuda":
        return torch.device(device)
    where = torch.device("cuda", local_gpu())
    torch.cuda.set_device(where)
    return where


def _time_all(sizes: tuple[int, ...], repeats: int, device: str = "cpu") -> dict:
    """Everything a calibration measures between ranks. The shared-memory paths are the CPU's
    (a GPU's collectives go through its backend): measured for a CPU calibration only."""

    names = host_names()
    cpu = device == "cpu"
    one_host = len(set(names)) == 1
    shm = [_time_shm() if cpu else (None, None)]
    allreduce = _time_allreduce(sizes, repeats, device)
    shm.append(_time_shm() if cpu else (None, None))
    small, shm_beta = _mean_shm(shm)
    return {
        "allreduce": allreduce,
        "small": small,
        "shm_beta": shm_beta,
        "levels": None if one_host else _time_levels(names, sizes, repeats),
    }


def _time_codecs(
    n: int = 1 << 20, repeats: int = 5, device: str = "cpu"
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """({codec: [encode s, decode s] per element}, {codec: spread}) on `device` (one thread of a
    CPU), into reused buffers (as the reducers run them), the medians of a batch of `repeats`
    settled on their sums (hybridpar.core.timing.settle): what the cost model charges a rank for the
    elements it encodes and decodes (planning.cost.terms.codec_s)."""

    out, spreads = {}, {}
    for name in CODECS:
        if name == "none":
            continue
        last: list = []

        def batch(name=name, last=last) -> list[float]:
            last[:] = time_codec(name, n, repeats, device=device)
            return [e + d for e, d in zip(*last, strict=True)]

        spreads[name] = settle(batch).spread
        out[name] = [statistics.median(ts) / n for ts in last]
    return out, spreads


def _flops(threads: int, device: str = "cpu") -> Settled:
    """FLOP/s of float32 matrix products, settled (hybridpar.core.timing.settle, on the seconds of a
    product): one CPU core's (`threads` 1), or one GPU's."""

    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # put back after: a rank of a job calibrates in it
    where = torch.device(device)
    n = 512 if where.type == "cpu" else 4096  # a GPU needs a product that fills it
    try:
        a, b = torch.randn(n, n, device=where), torch.randn(n, n, device=where)
        a @ b

        def batch() -> list[float]:
            ts = []
            for _ in range(5):
                t0 = clock(where)
                for _ in range(2):
                    a @ b
                ts.append((clock(where) - t0) / 2)
            return ts

        got = settle(batch)
        return replace(got, value=2 * n**3 / got.value)
    finally:
        torch.set_num_threads(before)


def fit_network(times: dict[int, float], p: int) -> tuple[float, float]:
    """alpha and beta of the network between hosts: beta from the slope between the two largest
    sizes, alpha from the smallest size less its bytes. A network link delivers small messages
    faster than its rate (a token bucket's burst, a switch's buffers) and large ones at it, so
    `fit_alpha_beta`'s weighting by relative error takes its beta from the small sizes, faster
    than the link carries, and prices every gradient sum across hosts too fast. The sums that
    cross hosts are megabytes: their slope is the one that matters.

    Within a host too (`_fitted` uses it for every level): the small sizes' rate moves from one
    calibration to the next, the slope of the megabyte sizes is what a gradient sum then takes
    (docs/cost-model.md has the measurements). The small sizes set alpha alone."""

    n = sorted(times)
    v = [2 * (p - 1) / p * k for k in n]
    t = [times[k] for k in n]
    beta = (t[-1] - t[-2]) / (v[-1] - v[-2]) if len(n) > 1 else t[-1] / v[-1]
    if not beta > 0:
        beta = t[-1] / v[-1]
    alpha = max(0.0, (t[0] - beta * v[0]) / max(1, 2 * clog2(p)))
    return alpha, beta


def _medians(times: dict[int, tuple[float, float]]) -> dict[int, float]:
    """{size: median seconds} of `_time_allreduce`'s {size: (median, spread)}."""
    return {n: t for n, (t, _) in times.items()}


def _fitted(
    times: dict[int, tuple[float, float]],
    nproc: int,
    small: float | None = None,
    shm_beta: float | None = None,
    device: str = "cpu",
    backend: str = "gloo",
) -> dict:

    spreads = [times[n][1] for n in sorted(times)]
    alpha, beta = fit_network(_medians(times), nproc)
    flops = _flops(1, device)
    if not (math.isfinite(alpha) and math.isfinite(beta) and beta > 0):
        raise ConfigError(
            f"the all-reduce timings do not fit alpha + beta * bytes (alpha {alpha}, beta {beta}); "
            "nothing was saved: run `hybridpar calibrate` again on a quieter machine"
        )
    gpu = device == "cuda"
    if gpu:
        units = torch.cuda.device_count()  # a GPU's FLOP/s, shared by the ranks on it
    return {
        "name": "localhost",
        "alpha": alpha,
        "beta": beta,
        # one core's, or one GPU's: a job's ranks share `cores` of them (Priced.rank_flops)
        # (on a GPU: the current one, a rank's or the first)
        "flops": flops.value,
        # each quantity's spread (hybridpar.core.timing.spread): alpha's and beta's of the sizes
        # they come from (fit_network: the smallest, the two largest)
        "spread": {"alpha": spreads[0], "beta": max(spreads[-2:]), "flops": flops.spread},
        "cores": units if gpu else os.cpu_count() or 1,
        "word_bytes": 4,
        "device": device,
        "source": f"hybridpar calibrate: {backend} all-reduce of {device} tensors on {nproc} "
        f"ranks, sizes {SIZES[0]}..{SIZES[-1]} B",
        "small_alpha": small,
        "shm_beta": shm_beta,
    }


def _save(data: dict) -> Path:
    """Write the cluster `localhost` of the device it measured atomically: a reader never sees
    half a file."""
    path = localhost_path(data.get("device", "cpu"))
    cache_write(path, data)
    return path


def calibrate(
    nproc: int | list[int] = 2,
    repeats: int = 5,
    timeout_s: float = 60.0,
    device: str = "cpu",
    backend: str = "gloo",
) -> dict | None:
    """Spawn `nproc` local ranks (or each count of a list in turn), time their all-reduces, fit
    and save `localhost`: the first count's fit is the cluster's alpha and beta, and every
    count's fit is kept under `by_procs`, for pricing a job of that many ranks (ranks sharing
    cores make the collectives slower). Under torchrun it times the job's own ranks (every rank
    calls it; rank 0 saves, the others return None): across nodes, both levels. `device` cuda:
    the collectives of GPU tensors over `backend` (nccl: a GPU per rank; gloo: ranks sharing
    GPUs), a GPU's FLOP/s, the codecs and the host <-> device copies on a GPU, saved apart from
    the CPU's calibration (`localhost` then prices a CUDA job with it)."""

    counts = [nproc] if isinstance(nproc, int) else list(nproc)
    if under_torchrun():
        counts = [int(os.environ["WORLD_SIZE"])]
    if not counts or min(counts) < 2:
        raise ConfigError("calibrate times all-reduces between processes: use --nproc 2 or more")
    fits, measured, levels, single = {}, {}, None, None
    what = f"calibrating {device} collectives at {', '.join(map(str, counts))} ranks, then codecs"
    shown = not under_torchrun() or os.environ.get("RANK", "0") == "0"
    with Phase(what, total=len(counts) + 1, every_s=0.0, shown=shown) as phase:
        for p in counts:
            args = (_time_all, p, SIZES, repeats, device)
            got = launch(*args, timeout_s=timeout_s, backend=backend)[0]
            fits[p] = _fitted(got["allreduce"], p, got["small"], got["shm_beta"], device, backend)
            measured[p] = {str(k): v for k, v in _medians(got["allreduce"]).items()}
            if got["levels"] is not None:
                levels = got["levels"]  # the largest count on several hosts
            else:
                single = p
            phase.tick()
        data = dict(fits[counts[0]])
        data["codecs"], data["spread"]["codecs"] = _time_codecs(device=device)
    data["by_procs"] = {str(p): _level(f) for p, f in fits.items() if levels is None or p == single}
    data = with_levels(data, levels)
    if os.environ.get("RANK", "0") != "0" and under_torchrun():
        return None
    path = _save(data)
    return {
        **data,
        "measured_levels_s": None
        if levels is None
        else {
            "intra": {str(k): v for k, v in _medians(levels["intra"] or {}).items()},
            "inter": {str(k): v for k, v in _medians(levels["inter"]).items()},
        },
        "measured_s": measured[counts[0]],
        "by_procs_measured_s": measured,
        "path": str(path),
    }


def _level(fit: dict) -> dict:
    return {k: fit[k] for k in ("alpha", "beta", "small_alpha", "shm_beta") if k in fit}


def with_levels(data: dict, levels: dict | None) -> dict:
    """The calibration `data` with its second level where the ranks sat on several hosts
    (`_time_levels`): the host's fit becomes alpha, beta and the shared-memory numbers (and its
    `by_procs` entry at the ranks a host has), the leaders' fit the `[network]`."""
    if levels is None:
        return data

    L, H = levels["ranks_per_host"], levels["hosts"]
    if levels["uneven"]:
        raise ConfigError(
            "the hosts run different numbers of ranks; a two-level cluster needs as many on "
            "each (use --nproc-per-node alike on every node)"
        )
    out = dict(data)
    if levels["intra"] is not None:
        intra = _fitted(levels["intra"], L, levels["small"], levels["shm_beta"])
        out.update(_level(intra))
        out["by_procs"] = {**data.get("by_procs", {}), str(L): _level(intra)}
    alpha, beta = fit_network(_medians(levels["inter"]), H)
    out["network"] = {"ranks_per_host": L, "alpha": alpha, "beta": beta}
    if levels.get("net_small"):
        out["network"]["small_alpha"] = levels["net_small"]
    out["source"] = (
        f"hybridpar calibrate: gloo all-reduce within each of {H} hosts ({L} rank(s) each) and "
        f"between one rank per host, sizes {SIZES[0]}..{SIZES[-1]} B"
    )
    return out


def calibrate_in_job(repeats: int = 5, device: str = "cpu", backend: str = "gloo") -> None:
    """Calibrate on the ranks of a running job (every rank calls it): they all take part in the
    all-reduces, rank 0 alone fits and writes the file, and nobody goes on before it is written."""

    names, cpu = host_names(), device == "cpu"
    with Phase(f"calibrating {device} collectives on this job's ranks", shown=dist.get_rank() == 0):
        _calibrate_in_job(names, cpu, repeats, device, backend)


def _calibrate_in_job(names: list[str], cpu: bool, repeats: int, device: str, backend: str):
    shm = [_time_shm() if cpu else (None, None)]
    times = _time_allreduce(SIZES, repeats, device)
    shm.append(_time_shm() if cpu else (None, None))
    levels = _time_levels(names, SIZES, repeats) if len(set(names)) > 1 else None
    shm.append(_time_shm() if cpu else (None, None))
    small, shm_beta = _mean_shm(shm)
    error = None
    if dist.get_rank() == 0:
        fit = _fitted(times, dist.get_world_size(), small, shm_beta, device, backend)
        try:
            data = with_levels(
                {**fit, "by_procs": {str(dist.get_world_size()): _level(fit)}}, levels
            )
            data["codecs"], data["spread"]["codecs"] = _time_codecs(device=device)
            if levels is not None:  # the whole job's fit mixes the levels: not kept
                data["by_procs"].pop(str(dist.get_world_size()), None)
            _save(data)
        except Exception as exc:  # every rank raises it, none waits at the barrier for rank 0
            error = str(exc)
    got: list = [error]
    dist.broadcast_object_list(got, src=0)
    if got[0] is not None:
        raise ConfigError(got[0])


def recheck(device: str = "cpu", backend: str = "gloo", repeats: int = 5) -> list[Recheck]:
    """The calibration of `device` measured again on a sample: the all-reduce fit at its
    smallest count of ranks, a core's (a GPU's) FLOP/s and every codec's encode and decode
    (`hybridpar calibrate --check`)."""

    path = localhost_path(device)
    try:
        data = json.loads(path.read_text())
        p = min(int(k) for k in data["by_procs"])
        level = data["by_procs"][str(p)]
    except (OSError, ValueError, KeyError, TypeError):
        flag = "" if device == "cpu" else f" --device {device}"
        raise ConfigError(
            f"nothing to check: {path} is missing or unusable; run `hybridpar calibrate{flag}`"
        ) from None
    was = data.get("spread", {})
    got = launch(_time_allreduce, p, SIZES, repeats, device, timeout_s=60.0, backend=backend)[0]
    fit = _fitted(got, p, device=device, backend=backend)
    where = str(path)
    out = [
        Recheck(f"alpha ({p} ranks)", where, level["alpha"], fit["alpha"], 0.0),
        Recheck(f"beta ({p} ranks)", where, level["beta"], fit["beta"], 0.0),
        Recheck("flops", where, data["flops"], fit["flops"], 0.0),
    ]
    # each with the larger of its spreads, cached and new
    for i, k in enumerate(("alpha", "beta", "flops")):
        out[i] = replace(out[i], spread=max(was.get(k, 0.0), fit["spread"][k]))
    codecs, spreads = _time_codecs(device=device)
    for name, (enc, dec) in codecs.items():
        if name in data.get("codecs", {}):
            old = sum(data["codecs"][name])
            spread = max(was.get("codecs", {}).get(name, 0.0), spreads[name])
            out.append(Recheck(f"codec {name}", where, old, enc + dec, spread))
    return out
