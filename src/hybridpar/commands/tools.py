"""`hybridpar profile`, `hybridpar codecs` and `hybridpar calibrate`: the measuring commands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hybridpar.core.config import writable
from hybridpar.core.errors import ConfigError

__all__ = ["cmd_calibrate", "cmd_codecs", "cmd_profile"]


def cmd_profile(args: argparse.Namespace) -> int:
    from hybridpar.core.cluster import cache_dir
    from hybridpar.core.zoo import file_label, input_shape, is_factory, parse_input_shape, zoo_entry
    from hybridpar.planning.profile import write_profile

    if is_factory(args.model):
        if args.input_shape is None:
            raise ConfigError(f"--model {args.model} needs --input-shape C,H,W")
        shape = parse_input_shape(args.input_shape)
    else:
        zoo_entry(args.model)  # an unknown name: one line
        shape = input_shape(args.model, args.input_size)
    label = f"{file_label(args.model)}-p{args.procs}-b{args.batch}"
    path = writable("--out", args.out or cache_dir() / "profiles" / f"{label}.json")
    model = write_profile(args.model, tuple(shape), args.procs, args.batch, path, args.repeats)
    per = {n: model.per_count[n] for n in sorted(model.per_count)}
    print(
        f"{args.model}: a rank's iteration at "
        + ", ".join(
            f"{n} samples {sum(f + b for f, b in t.values()) * 1e3:.2f} ms" for n, t in per.items()
        )
        + f" ({args.procs} ranks sharing {os.cpu_count()} cores); written to {path}"
    )
    print(f"use it with: hybridpar plan --model {args.model} --compute {path} ...")
    return 0


def available_bytes() -> int:
    """Memory this machine can still give (MemAvailable), or physical memory where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_codec_sizes(args: argparse.Namespace) -> None:
    if args.block < 1 or args.size < 1 or args.mlp_steps < 0:
        raise ConfigError(
            "--block must be a positive number of elements, --size positive, --mlp-steps >= 0"
        )
    # the error table holds three samples and an encoded and a decoded copy of each (about 16
    # floats per element); the speed test one input, its encoding and its decoding
    need = max(16 * 4 * args.size, 0 if args.no_speed else 12 * args.speed_size)
    have = available_bytes()
    if need > have:
        raise ConfigError(
            f"--size {args.size} / --speed-size {args.speed_size} need about {need / 2**30:.1f} "
            f"GiB, more than the {have / 2**30:.1f} GiB free here; give smaller sizes"
        )


def cmd_codecs(args: argparse.Namespace) -> int:
    from hybridpar.commands.papers.codec_report import (
        datasets,
        error_table,
        print_table,
        throughput,
    )
    from hybridpar.core.choices import CODECS

    _check_codec_sizes(args)
    try:
        rows = error_table(datasets(args.size, mlp_steps=args.mlp_steps), (None, args.block))
        speeds = None
        if not args.no_speed:
            speeds = {name: throughput(name, args.block, n=args.speed_size) for name in CODECS}
    except (MemoryError, RuntimeError) as exc:  # the estimate above was not enough
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--size {args.size}: out of memory ({why}); give a smaller size"
        ) from None
    if args.json:
        out = {"block": args.block, "errors": rows, "throughput_gb_s": speeds}
        print(json.dumps(out, indent=1))
    else:
        print(
            f"8-bit codecs; scales per tensor (the paper's setting) and per {args.block} elements"
        )
        print()
        print_table(rows, speeds)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hybridpar.runtime.launcher import under_torchrun
    from hybridpar.runtime.train.calibration import calibrate
    from hybridpar.runtime.train.run import device_and_backend

    local = max(args.nproc) if not under_torchrun() else int(os.environ["LOCAL_WORLD_SIZE"])
    device, backend = device_and_backend(args.device, args.backend, local)
    if args.check:
        if under_torchrun():
            raise ConfigError("--check measures this machine on its own: run it without torchrun")
        return _check(device, backend, args.repeats)
    d = calibrate(nproc=args.nproc, repeats=args.repeats, device=device, backend=backend)
    if d is not None:  # None: a rank of a torchrun job other than 0 (rank 0 reports)
        _print_calibration(d, device, backend)
    return 0


def _print_calibration(d: dict, device: str, backend: str) -> None:
    """What `hybridpar calibrate` measured: the network, shared memory, each rank count's fit
    and points, the codecs."""
    unit = "core" if device == "cpu" else "GPU"
    print(
        f"localhost ({device}, {backend}): alpha {d['alpha'] * 1e6:.2f} us, bandwidth "
        f"{1 / d['beta'] / 1e9:.3f} GB/s, {d['flops'] / 1e9:.1f} GFLOP/s per {unit} "
        f"({d['cores']} {unit}s); saved to {d['path']}"
    )
    if d.get("small_alpha") is not None:
        print(f"  small all-reduce through shared memory: {d['small_alpha'] * 1e6:8.1f} us")
    if d.get("shm_beta"):
        print(f"  all-gather through shared memory: {1 / d['shm_beta'] / 1e9:8.2f} GB/s")
    _print_levels(d)
    if d.get("codecs"):
        print("  codecs, one thread, ns per element (encode/decode):")
        print(
            "    "
            + "  ".join(f"{k} {e * 1e9:.2f}/{x * 1e9:.2f}" for k, (e, x) in d["codecs"].items())
        )


def _print_levels(d: dict) -> None:
    """The calibration's levels: between hosts, each rank count's fit and the sync table."""
    net = d.get("network")
    if net is not None:
        print(
            f"  two levels, {net['ranks_per_host']} ranks per host: within a host the numbers "
            f"above; between hosts alpha {net['alpha'] * 1e6:.2f} us, bandwidth "
            f"{1 / net['beta'] / 1e9:.3f} GB/s"
        )
        for level, times in d["measured_levels_s"].items():
            for n, t in times.items():
                print(f"    {level} all-reduce {int(n):>10} B: {t * 1e3:8.3f} ms")
    for p, times in d["by_procs_measured_s"].items():
        level = d["by_procs"].get(str(p))
        if level is None:  # the whole job over several hosts: its fit mixes the two levels
            continue
        print(
            f"  {p} ranks: alpha {level['alpha'] * 1e6:.2f} us, bandwidth "
            f"{1 / level['beta'] / 1e9:.3f} GB/s"
        )
        for n, t in times.items():
            print(f"    all-reduce {int(n):>10} B: {t * 1e3:8.3f} ms")
    for p, level in d["by_procs"].items():
        if level.get("sync"):
            print(
                f"  {p} ranks on a host meeting after work of (ms alone): the round's wall time "
                "beyond a round without work / the wait for the slowest rank"
            )
            rows = level["sync"]
            print(
                "    "
                + "  ".join(f"{a * 1e3:.2f}: {w * 1e3:.2f}/{x * 1e3:.2f}" for a, w, x in rows)
            )
    if net is not None and net.get("small_alpha") is not None:
        print(
            f"  small all-reduce of all ranks across the hosts: {net['small_alpha'] * 1e3:.3f} ms"
        )


def print_rechecks(rows, out=sys.stdout) -> None:
    """A table of cached quantities measured again (hybridpar.core.timing.Recheck), by cache file."""
    source, w = None, max((len(r.quantity) for r in rows), default=26)
    for r in rows:
        if r.source != source:
            source = r.source
            print(f"  {source}", file=out)
            print(
                f"    {'quantity':{w}} {'cached':>10} {'now':>10} {'now/cached':>10} "
                f"{'spread':>7}  holds",
                file=out,
            )
        print(
            f"    {r.quantity:{w}} {r.cached:10.3g} {r.now:10.3g} {r.ratio:10.2f} "
            f"{r.spread:7.1%}  {'yes' if r.holds else 'NO'}",
            file=out,
        )


def _check(device: str, backend: str, repeats: int) -> int:
    """`hybridpar calibrate --check`: the calibration and every compute profile taken on it,
    measured again on a sample; 0 where all of it holds on this machine today, 1 where not."""

    from hybridpar.core.cluster import cache_dir, localhost_path
    from hybridpar.core.timing import CHECK_TOL
    from hybridpar.planning.profile import recheck as recheck_profile
    from hybridpar.runtime.train.calibration import recheck

    rows = recheck(device, backend, repeats)
    flops = json.loads(localhost_path(device).read_text())["flops"]
    for path in sorted((cache_dir() / "profiles").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("calibration") == flops and data.get("measured", {}).get("device") == device:
            print(f"measuring {path.name} again ...", file=sys.stderr, flush=True)
            rows += recheck_profile(path, repeats)
    print(
        f"the cache of localhost ({device}) measured again (holds: within "
        f"{CHECK_TOL:.0%} or three times its spread):"
    )
    print_rechecks(rows)
    moved = [r for r in rows if not r.holds]
    if not moved:
        print(f"the cache holds on this machine today ({len(rows)} quantities)")
        return 0
    print(
        f"{len(moved)} of {len(rows)} cached quantities no longer hold: "
        + "; ".join(f"{r.quantity} x{r.ratio:.2f} ({Path(r.source).name})" for r in moved)
        + ". Run `hybridpar calibrate` again (the profiles are measured again after it)"
    )
    return 1
