"""Everything issue 38 asks of a GPU, in one command (about 5 minutes on one GPU with 16 cores):

    python benchmarks/gpu_check.py                 # on a GPU machine (torch 2.11+; bitsandbytes optional)
    DEV=cpu python benchmarks/gpu_check.py         # the same sections on the CPU, small sizes

Sections (`--sections`, comma-separated; all by default):

1. matrix: every cell of tests/device_matrix.py (every style, hand-off scheme, batch-norm mode,
   reducer, codec, bf16, dropout, variable batch, a checkpoint moved between the device and the
   CPU) on 2 ranks against one process on the same device: over gloo with both ranks on one GPU
   (a developer's box), and over NCCL with a GPU each where there are two. On the CPU the cells
   run under CUDA's device rules (tests/device_rules.py), on the paths a GPU takes.
2. overhead: P = 1, hybridpar's trainer against a plain torch loop on the same model, batch and
   optimizer (KrizhevskySGD, what `hybridpar train` steps with), fp32 and bf16 autocast,
   interleaved rounds: median, range, ratio.
   Goal: within 1.05x.
3. predict: the device calibrated from scratch (`hybridpar calibrate --device DEV` in a fresh
   cache), then the P = 1 prediction of each model and precision of section 2 (bf16 priced
   with its own profile, under autocast) next to its measured time.
   Goal: within 20 %.
4. codecs: each 8-bit type's encode and decode on the device (GB/s of float32), its relative L2
   error and the paper's mean relative error (over elements of at least 1e-6 of the largest),
   next to bitsandbytes' blockwise codec (dynamic map, same block) where installed, and
   the device's copy bandwidth (read + write of float32) that bounds both.
5. ddp: benchmarks/hybrid_vs_ddp.py on the host's cores (P = 8 and 16; DEV=cpu: 2), with its
   predictions next to its measurements.
6. beyond: `hybridpar calibrate` at 2 and 4 ranks, then `hybridpar validate` of alexnet-owt at
   P = 8 and 16 on the host's cores (the ranks the calibration never saw; DEV=cpu: P = 4).
7. compute: benchmarks/compute.py on the device (issue 41): `--compile` against eager and
   `--activation-checkpointing` against none, one rank on the GPU (DEV=cpu: 2 ranks, small):
   iteration times, compile time, and the CUDA allocator's peak next to the resident one.

Exits 1 on any CRASH or DIFFERS in the matrix, 2 on bad arguments. Prints tables to paste into
docs/runtime.md; `--out FILE` writes them as JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
SECTIONS = ("matrix", "overhead", "predict", "codecs", "ddp", "beyond", "compute")


def _device() -> str:
    dev = os.environ.get("DEV") or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev not in ("cpu", "cuda"):
        sys.exit(f"gpu_check: error: DEV={dev}: use cpu or cuda")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: error: DEV=cuda but torch sees no GPU; run with DEV=cpu for a dry run")
    return dev


def _sizes(dev: str) -> dict:
    """The models and batches of sections 2-3 (the issue's on a GPU; small on the CPU)."""
    if dev == "cuda":
        return {"alexnet-owt": (224, 128), "resnet20": (32, 128)}
    return {"alexnet-owt": (64, 8), "resnet20": (32, 16)}


# --- 1. the device matrix -----------------------------------------------------------------------


def matrix(dev: str) -> list[dict]:
    from device_matrix import CELLS, run_cells

    from hybridpar.runtime.launcher import RankFailure, launch

    names = [c.name for c in CELLS]
    backends = ["gloo"]
    if dev == "cuda" and torch.cuda.device_count() >= 2:
        backends.append("nccl")
    rows = []
    for backend in backends:
        try:  # every cell in one spawn; a spawn that fails is retried cell by cell
            got = launch(
                run_cells, 2, names, dev, dev == "cpu", False, timeout_s=300, backend=backend
            )[0]
        except RankFailure:
            got = []
            for name in names:
                try:
                    one = launch(
                        run_cells, 2, [name], dev, False, False, timeout_s=120, backend=backend
                    )
                    got += one[0]
                except RankFailure as exc:
                    got.append((name, "CRASH", str(exc).splitlines()[0][:200], float("nan")))
        for name, result, detail, seconds in got:
            rows.append(
                {"backend": backend, "cell": name, "result": result, "detail": detail, "s": seconds}
            )
    if dev == "cuda" and len(backends) == 1:
        print("matrix over NCCL: not run (one GPU; NCCL needs one per rank)")
    print(f"\n1. the device matrix on {dev}: 2 ranks against one process (float64 unless bf16)")
    print("| backend | cell | result | detail |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['backend']} | {r['cell']} | {r['result']} | {r['detail'][:110]} |")
    bad = [r for r in rows if r["result"] in ("CRASH", "DIFFERS")]
    print(f"{len(rows) - len(bad)} of {len(rows)} cells as expected; {len(bad)} CRASH or DIFFERS")
    return rows


# --- 2. one-rank overhead -------------------------------------------------------------------------


def _loop(model, opt, batches, step, steps: int, dev: torch.device) -> float:
    """Median seconds per step over `steps` steps, after one warm-up step."""
    from hybridpar.core.timing import clock

    x, y = batches
    step(x, y)
    ts = []
    for _ in range(steps):
        t0 = clock(dev)
        step(x, y)
        ts.append(clock(dev) - t0)
    return statistics.median(ts)


def overhead_rank(sizes: dict, dev: str, rounds: int, steps: int) -> list[dict]:
    """On one rank: each model, fp32 and bf16, the plain loop and the trainer in turn each round."""
    from torch.nn import functional as F

    from hybridpar.core.choices import Choices
    from hybridpar.core.models import build_model
    from hybridpar.core.optim import KrizhevskySGD
    from hybridpar.core.plan import ParallelPlan
    from hybridpar.runtime.parallel.trainer import HybridTrainer

    where = torch.device(dev)

    def sgd(params):  # what `hybridpar train` steps with, and so what section 3 prices
        return KrizhevskySGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4)

    out = []
    for name, (size, batch) in sizes.items():
        for amp in ("none", "bf16"):
            torch.manual_seed(0)
            plain = build_model(name, input_size=size).to(where)
            popt = sgd(plain.parameters())

            def plain_step(x, y, plain=plain, popt=popt, amp=amp):
                with torch.autocast(where.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    loss = F.cross_entropy(plain(x), y)
                popt.zero_grad(set_to_none=True)
                loss.backward()
                popt.step()

            torch.manual_seed(0)
            plan = ParallelPlan(1, batch, {}, input_shape=(3, size, size), choices=Choices(amp=amp))
            t = HybridTrainer(build_model(name, input_size=size).to(where), plan, sgd)
            x = torch.randn(batch, 3, size, size, device=where)
            y = torch.randint(0, 10, (batch,), device=where)
            times: dict[str, list[float]] = {"plain": [], "hybridpar": []}
            for _ in range(rounds):
                times["plain"].append(_loop(plain, popt, (x, y), plain_step, steps, where))
                times["hybridpar"].append(_loop(t.model, None, (x, y), t.train_step, steps, where))
            out.append({"model": name, "size": size, "batch": batch, "amp": amp, **times})
    return out


def overhead(dev: str, quick: bool) -> list[dict]:
    from hybridpar.runtime.launcher import launch

    rounds, steps = (2, 2) if quick else (5, 10)
    rows = launch(overhead_rank, 1, _sizes(dev), dev, rounds, steps, timeout_s=600)[0]
    print(f"\n2. one rank on {dev}: hybridpar's trainer against a plain torch loop (ms per step,")
    print(f"   median of {rounds} interleaved rounds of {steps} steps, [range]); goal <= 1.05x")
    print(
        "| model | px | B | precision | plain ms | hybridpar ms | ratio |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        p, h = (statistics.median(r[k]) * 1e3 for k in ("plain", "hybridpar"))
        span = [f"[{min(r[k]) * 1e3:.2f}-{max(r[k]) * 1e3:.2f}]" for k in ("plain", "hybridpar")]
        r["ratio"] = h / p
        precision = "fp32" if r["amp"] == "none" else "bf16"
        print(
            f"| {r['model']} | {r['size']} | {r['batch']} | {precision} | {p:.2f} {span[0]} | "
            f"{h:.2f} {span[1]} | {h / p:.3f}x |"
        )
    return rows


# --- 3. the calibrated prediction at P = 1 -----------------------------------------------------


def predict(dev: str, measured: list[dict]) -> list[dict]:
    """Calibrate `dev` in a fresh cache, then price each model's P = 1 plan with it."""
    cache = tempfile.mkdtemp(prefix="hybridpar-gpucheck-")
    env = {**os.environ, "HYBRIDPAR_CACHE": cache}
    backend = "nccl" if dev == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    cmd = [sys.executable, "-m", "hybridpar", "calibrate", "--nproc", "2", "--device", dev]
    t0 = time.perf_counter()
    done = subprocess.run([*cmd, "--backend", backend], env=env, capture_output=True, text=True)
    print(
        f"\n3. calibrated prediction at P = 1 ({dev}, calibrated over {backend} in "
        f"{time.perf_counter() - t0:.0f} s)"
    )
    if done.returncode != 0:
        print(f"calibration failed: {done.stderr.strip().splitlines()[-1:]}")
        return []
    print("  " + done.stdout.strip().splitlines()[0])
    os.environ["HYBRIDPAR_CACHE"] = cache  # the planner reads this calibration
    from hybridpar.core.cluster import load_cluster
    from hybridpar.core.zoo import input_shape
    from hybridpar.planning.profile import planning_compute
    from hybridpar.planning.search import make_plan

    cluster = load_cluster("localhost", dev)
    rows = []
    print(
        "| model | px | B | precision | predicted ms | measured ms | error |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in measured:  # each precision priced with its own profile (bf16: under autocast)
        shape = tuple(input_shape(r["model"], r["size"]))
        compute = planning_compute(cluster, r["model"], shape, 1, r["batch"], dev, r["amp"])
        plan = make_plan(
            r["model"],
            1,
            r["batch"],
            cluster,
            input_size=r["size"],
            compute=compute,
            scenarios=("batch",),
        ).export()
        pred, meas = plan.totals["total_s"], statistics.median(r["hybridpar"])
        err = (pred - meas) / meas
        precision = "bf16" if r["amp"] == "bf16" else "fp32"
        rows.append(
            {"model": r["model"], "precision": precision, "predicted_s": pred, "measured_s": meas}
            | {"error": err}
        )
        print(
            f"| {r['model']} | {r['size']} | {r['batch']} | {precision} | {pred * 1e3:.2f} | "
            f"{meas * 1e3:.2f} | {100 * err:+.1f} % |"
        )
    return rows


# --- 4. codecs against bitsandbytes -----------------------------------------------------------------


def _gbps(fn, nbytes: int, dev: torch.device, repeats: int = 10) -> float:
    from hybridpar.core.timing import clock

    fn()
    ts = []
    for _ in range(repeats):
        t0 = clock(dev)
        fn()
        ts.append(clock(dev) - t0)
    return nbytes / statistics.median(ts) / 1e9


def _bnb_row(bnb, kind: str, x: torch.Tensor, block: int, nbytes: int, where) -> dict:
    """bitsandbytes' blockwise codec (its dynamic map) on the same data and block size."""
    q, state = bnb.quantize_blockwise(x, blocksize=block)
    y = bnb.dequantize_blockwise(q, state)
    err = _errors(x, y)
    enc = _gbps(lambda: bnb.quantize_blockwise(x, blocksize=block), nbytes, where)
    dec = _gbps(lambda: bnb.dequantize_blockwise(q, state), nbytes, where)
    return {"data": kind, "codec": "bitsandbytes", "encode": enc, "decode": dec, **err}


def _errors(x: torch.Tensor, y: torch.Tensor) -> dict:
    """The relative L2 error ||y - x|| / ||x||, which stays meaningful on heavy-tailed data, and
    the paper's mean relative error (Dettmers' Table 2). The latter is taken over elements of
    at least 1e-6 of the largest: per element it explodes where x is nearly 0 (an element of
    randn^3 of 1e-20 decoded as 1e-9 counted as 1e11 %), which said nothing about the codec."""
    l2 = ((y - x).norm() / x.norm()).item()
    big = x.abs() >= 1e-6 * x.abs().max()
    mre = ((y - x)[big].abs() / x[big].abs()).mean().item()
    return {"error": l2, "mean_rel_error": mre}


def codecs(dev: str, quick: bool) -> list[dict]:
    from hybridpar.core.choices import EIGHT_BIT
    from hybridpar.runtime.comm.codecs import get_codec

    where = torch.device(dev)
    n, block = (1 << 20 if quick else 1 << 26), 4096
    if dev == "cpu":
        n = min(n, 1 << 22)
    g = torch.Generator().manual_seed(0)
    data = {
        "normal": torch.randn(n, generator=g).to(where),
        "heavy-tailed": (torch.randn(n, generator=g) ** 3).to(where),
    }
    nbytes = 4 * n
    scratch = torch.empty_like(data["normal"])
    copy = _gbps(lambda: scratch.copy_(data["normal"]), 2 * nbytes, where)
    try:
        import bitsandbytes.functional as bnb
    except Exception as exc:  # not installed, or no build for this device
        bnb, why = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    rows = []
    for kind, x in data.items():
        for name in EIGHT_BIT:
            c = get_codec(name, block)
            e = c.encode(x)
            y = c.decode(e)
            err = _errors(x, y)
            enc = _gbps(lambda c=c, e=e, x=x: c.encode(x, out=e), nbytes, where)
            dec = _gbps(lambda c=c, e=e, y=y: c.decode(e, out=y), nbytes, where)
            rows.append({"data": kind, "codec": name, "encode": enc, "decode": dec, **err})
        if bnb is not None:
            try:
                rows.append(_bnb_row(bnb, kind, x, block, nbytes, where))
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                bnb = None
    # a copy moves 8 bytes an element; an 8-bit codec 5 (4 in, 1 out or the reverse): the float32
    # rate a codec pass can reach is the copy's traffic rate / 1.25
    limit = copy / 1.25
    for r in rows:
        r["limit"] = limit
    print(
        f"\n4. 8-bit codecs on {dev}: {n} float32, block {block}; copy {copy:.0f} GB/s "
        f"(read + write): a codec pass can reach {limit:.0f} GB/s of float32"
    )
    print(
        "| data | codec | encode GB/s | decode GB/s | of that limit | rel. L2 error "
        "| mean rel. error |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        frac = f"{r['encode'] / limit * 100:.0f} / {r['decode'] / limit * 100:.0f} %"
        print(
            f"| {r['data']} | {r['codec']} | {r['encode']:.1f} | {r['decode']:.1f} | {frac} | "
            f"{100 * r['error']:.3f} % | {100 * r['mean_rel_error']:.3f} % |"
        )
    if bnb is None:
        print(f"bitsandbytes: not compared ({why})")
    return rows


# --- 5. hybrid_vs_ddp on the cores ----------------------------------------------------------------


def ddp(dev: str, quick: bool) -> str:
    procs = "2" if dev == "cpu" or quick else "8,16"
    args = ["--procs", procs, "--batch", "16" if dev == "cpu" else "64"]
    if dev == "cpu" or quick:
        args += ["--steps", "3", "--repeat", "1", "--input-size", "64"]
    print(f"\n5. benchmarks/hybrid_vs_ddp.py {' '.join(args)} (gloo on the host's cores)")
    done = subprocess.run(
        [sys.executable, str(HERE / "hybrid_vs_ddp.py"), *args], capture_output=True, text=True
    )
    text = done.stdout if done.returncode == 0 else done.stdout + done.stderr
    print(text.rstrip())
    return text


# --- 6. validate beyond four ranks -----------------------------------------------------------


def beyond(dev: str, quick: bool) -> list[dict]:
    """Issue 42, item 4: a calibration at 2 and 4 ranks (`hybridpar calibrate --nproc 2,4`), then
    `hybridpar validate` at P = 8 and 16 on the host's cores (gloo; what the planner predicts
    for ranks it never calibrated), where the host has the cores; DEV=cpu: P = 4 on small sizes."""
    cores = os.cpu_count() or 1
    counts = [p for p in (8, 16) if p <= cores] if dev == "cuda" else [4]
    size, batch = (64, 64) if dev == "cuda" else (64, 16)
    steps = ["--steps", "3", "--repeat", "1"] if dev == "cpu" or quick else []
    print(f"\n6. validate at P = {', '.join(map(str, counts))} on a calibration at 2 and 4 ranks")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-beyond-") as tmp:
        env = {**os.environ, "HYBRIDPAR_CACHE": f"{tmp}/cache"}
        hp = [sys.executable, "-m", "hybridpar"]
        subprocess.run(
            [*hp, "calibrate", "--nproc", "2,4"], env=env, check=True, capture_output=True
        )
        for p in counts:
            out = f"{tmp}/v{p}"
            done = subprocess.run(
                [
                    *hp,
                    "validate",
                    "--model",
                    "alexnet-owt",
                    "--input-size",
                    str(size),
                    "--batch",
                    str(batch),
                    "--procs",
                    str(p),
                    "--out",
                    out,
                    "--quiet",
                    *steps,
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            print(done.stdout.rstrip() if done.returncode == 0 else done.stderr[-2000:])
            if done.returncode == 0:
                summary = json.loads(Path(out, "validate.json").read_text())["summary"]
                rows.append({"procs": p, **summary})
    for r in rows:
        pick = "fastest" if r["picked_is_fastest"] else f"{r['picked_over_fastest']:.2f}x"
        print(
            f"  P = {r['procs']:2}: |error| median {r['median_abs_error']:.1%}, worst "
            f"{r['worst_abs_error']:.1%}, pick {pick}"
        )
    return rows


# --- 7. torch.compile and activation checkpointing on the device -------------------------------


def compute(dev: str, quick: bool) -> str:
    gpu = dev == "cuda" and not quick
    args = ["--device", dev, "--plans", "batch", "--rounds", "2" if gpu else "1"]
    args += ["--procs", "1", "--batch", "256", "--mem-batch", "512"] if dev == "cuda" else []
    args += [] if gpu else ["--steps", "4", "--batch", "16", "--mem-batch", "32"]
    print(f"\n7. benchmarks/compute.py {' '.join(args)}")
    done = subprocess.run(
        [sys.executable, str(HERE / "compute.py"), *args], capture_output=True, text=True
    )
    text = done.stdout if done.returncode == 0 else done.stdout + done.stderr[-3000:]
    print(text.rstrip())
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS)
    )
    ap.add_argument("--quick", action="store_true", help="fewer rounds and smaller sizes")
    ap.add_argument("--out", help="also write the tables as JSON here")
    args = ap.parse_args()
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = sorted(set(wanted) - set(SECTIONS))
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    dev = _device()
    name = torch.cuda.get_device_name(0) if dev == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"gpu_check on {name}; torch {torch.__version__}; DEV={dev}")
    out: dict = {"device": name, "torch": torch.__version__}
    if "matrix" in wanted:
        out["matrix"] = matrix(dev)
    if "overhead" in wanted or "predict" in wanted:
        out["overhead"] = overhead(dev, args.quick)
    if "predict" in wanted:
        out["predict"] = predict(dev, out["overhead"])
    if "codecs" in wanted:
        out["codecs"] = codecs(dev, args.quick)
    if "ddp" in wanted:
        out["ddp"] = ddp(dev, args.quick)
    if "beyond" in wanted:
        out["beyond"] = beyond(dev, args.quick)
    if "compute" in wanted:
        out["compute"] = compute(dev, args.quick)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    failed = [r for r in out.get("matrix", []) if r["result"] in ("CRASH", "DIFFERS")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(TESTS)]
    import gpu_check  # this file as a module: ranks find its functions by name

    sys.exit(gpu_check.main())
