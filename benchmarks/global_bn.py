"""Claims of global batch norm (Liu et al.), measured side by side in one run:

1. cost: iteration time of resnet20 at P = 4 (and 2) with local, global and adaptive BN, and the
   bytes of the BN all-reduces from the ledger;
2. accuracy: resnet20 on digits with a per-rank batch of 2 on 4 ranks (global batch 8), local vs
   global BN from the same seeds (the paper: +2.1 points at 4 devices for a global batch of 8);
3. large per-rank batch (32 on 4 ranks): the adaptive rule (bz_max 16) keeps BN local from the
   start; its accuracy and time next to global BN's.
4. AGBN against GBN over a whole run (the paper: AGBN trains about 10 % faster than GBN): resnet20
   on digits, 4 ranks x 8, global and adaptive BN (the accuracy signal) interleaved, repeated;
   wall time of the training epochs, the step the adaptive rule turned global, test accuracy.
5. bf16 under autocast, one layer: the C kernels reading bf16 as autocast hands it over, against
   the cast to float32 and back around the float32 kernels (the path before them), the float32
   kernels on float32, and torch's batch norm in bf16; forward and backward on resnet20's three
   BN shapes at a per-rank batch of 16, one thread, contenders interleaved, repeated.
6. the operation swap's own cost, per call and per step, on a net of 50 batch norms: torch's
   batch norm, the swap's fast path (a forward that is torch's own), and its general path (a
   TorchFunctionMode around a forward of the module's own).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from hybridpar.core import ops
from hybridpar.core.config import build
from hybridpar.runtime.comm import kernels
from hybridpar.runtime.comm.collectives import Via
from hybridpar.runtime.parallel.batchnorm import _GlobalBatchNormFn
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.run import run

BASE = build(
    TrainConfig,
    model="resnet20",
    data="digits",
    progress=False,
    lr=0.02,
    schedule="cosine",
    quiet=True,
)


def one(cfg: TrainConfig) -> dict:
    r = run(cfg)
    m = r["bytes"]["measured"]
    return {
        "time": r["iteration"]["time_s"],
        "bn_bytes": m.get("bn_stats", 0.0) + m.get("bn_grad", 0.0),
        "test": r["final"]["test_acc"],
        "train": r["epochs"][-1]["train_acc"],
        "bn": r.get("bn", {}),
    }


def cost(procs: list[int], steps: int, repeat: int) -> None:
    print(
        f"\n1. resnet20 on digits, per-rank batch 8, {steps} steps, hybridpar grid 1xP, gloo CPU; "
        f"local, global and adaptive run in turn, {repeat} rounds: median ms/iter over the rounds "
        "[min-max]"
    )
    print(
        f"{'P':>2} {'bn':<9} {'ms/iter':>8} {'range':>13} {'vs local':>9} {'BN KB/iter':>11}  note"
    )
    for P in procs:
        base = BASE.with_(nproc=P, batch=8 * P, epochs=1, max_steps=steps, preset=f"grid:1x{P}")
        runs: dict[str, list[dict]] = {"local": [], "global": [], "adaptive": []}
        for _ in range(repeat):
            for bn, got in runs.items():
                cfg = base.with_(bn=bn, bn_window=max(1, steps // 3), bn_threshold=0.5)
                got.append(one(cfg))
        med = {bn: statistics.median(r["time"] for r in got) for bn, got in runs.items()}
        for bn, got in runs.items():
            r, note = got[-1], ""
            if bn == "adaptive":
                at = r["bn"].get("switched_at_step")
                note = "local throughout" if at is None else f"local, global from step {at}"
            lo, hi = (f(g["time"] for g in got) * 1e3 for f in (min, max))
            print(
                f"{P:>2} {bn:<9} {med[bn] * 1e3:8.1f} {f'[{lo:.1f}-{hi:.1f}]':>13} "
                f"{med[bn] / med['local']:8.2f}x {r['bn_bytes'] / 1e3:11.2f}  {note}"
            )


def accuracy(seeds: list[int], epochs: int) -> None:
    print(
        f"\n2. resnet20 on digits, 4 ranks x per-rank batch 2 (global 8), {epochs} epochs, cosine lr"
    )
    print(
        f"{'seed':>4} {'local test':>11} {'global test':>12} {'local train':>12} {'global train':>13}"
    )
    gains = []
    for seed in seeds:
        base = BASE.with_(nproc=4, batch=8, epochs=epochs, seed=seed, preset="grid:1x4")
        lo, gl = (one(base.with_(bn=bn)) for bn in ("local", "global"))
        gains.append(gl["test"] - lo["test"])
        print(
            f"{seed:>4} {lo['test']:11.4f} {gl['test']:12.4f} {lo['train']:12.4f} {gl['train']:13.4f}"
        )
    print(
        f"global - local test accuracy: mean {statistics.mean(gains) * 100:+.2f} points "
        f"over {len(seeds)} seeds"
    )


def large_batch(epochs: int) -> None:
    print(f"\n3. resnet20 on digits, 4 ranks x per-rank batch 32 (global 128), {epochs} epochs")
    base = BASE.with_(nproc=4, batch=128, epochs=epochs, preset="grid:1x4", lr=0.05)
    gl = one(base.with_(bn="global"))
    ad = one(base.with_(bn="adaptive", bn_max_batch=64))  # BZ 128 >= 64: local
    print(f"{'bn':<9} {'test':>7} {'ms/iter':>8} {'BN KB/iter':>11}  decision")
    for name, r in (("global", gl), ("adaptive", ad)):
        decision = r["bn"].get("reason") or "-"
        print(
            f"{name:<9} {r['test']:7.4f} {r['time'] * 1e3:8.1f} {r['bn_bytes'] / 1e3:11.2f}  {decision}"
        )


def whole_run(epochs: int, repeat: int) -> None:
    print(
        f"\n4. resnet20 on digits, 4 ranks x per-rank batch 8 (global 32), {epochs} epochs, global "
        f"vs adaptive BN (accuracy signal, windows of 15 steps, threshold 0.02), {repeat} rounds"
    )
    base = BASE.with_(nproc=4, batch=32, epochs=epochs, preset="grid:1x4", quiet=True)
    runs: dict[str, list[dict]] = {"global": [], "adaptive": []}
    for _ in range(repeat):
        for bn, got in runs.items():
            r = run(base.with_(bn=bn, bn_window=15, bn_threshold=0.02))
            got.append(
                {
                    "wall": sum(e["time_s"] for e in r["epochs"]),
                    "test": r["final"]["test_acc"],
                    "at": r.get("bn", {}).get("switched_at_step"),
                }
            )
    print(f"{'bn':<9} {'train s':>8} {'range':>13} {'test acc':>9}  switched at step")
    med = {}
    for bn, got in runs.items():
        walls = [g["wall"] for g in got]
        med[bn] = statistics.median(walls)
        print(
            f"{bn:<9} {med[bn]:8.2f} {f'[{min(walls):.2f}-{max(walls):.2f}]':>13} "
            f"{statistics.median(g['test'] for g in got):9.4f}  {[g['at'] for g in got]}"
        )
    print(f"AGBN speed over GBN: {med['global'] / med['adaptive']:.3f}x (the paper: about 1.10x)")


def _bf16_contenders(shape: tuple[int, ...]) -> dict:
    """One BN layer's forward and backward on `shape` by each contender (part 5)."""
    c = shape[1]
    w, b = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
    run_stats = (torch.zeros(c), torch.ones(c))
    x16 = torch.randn(shape).bfloat16().requires_grad_()
    x32 = x16.detach().float().requires_grad_()
    dy16 = torch.randn(shape).bfloat16()

    def fn(x):
        return _GlobalBatchNormFn.apply(x, w, b, run_stats, 0.1, 1e-5, Via(None))

    def torch_bf16():
        F.batch_norm(x16, *run_stats, w, b, True, 0.1, 1e-5).backward(dy16)

    return {
        "bf16 kernels": lambda: fn(x16).backward(dy16),
        "cast both ways": lambda: fn(x16.float()).bfloat16().backward(dy16),
        "f32 kernels": lambda: fn(x32).backward(dy16.float()),
        "torch bf16": torch_bf16,
    }


def bf16_layer(repeat: int) -> None:
    print(
        "\n5. one BN layer under bf16 autocast, forward + backward, one thread, per-rank batch 16; "
        f"contenders interleaved, {repeat * 5} rounds: median us [min-max], and over the bf16 kernels"
    )
    if not kernels.available():
        print("no C compiler: the kernels are not built, nothing to compare")
        return
    torch.set_num_threads(1)
    for shape in ((16, 16, 32, 32), (16, 32, 16, 16), (16, 64, 8, 8)):
        steps = _bf16_contenders(shape)
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(repeat * 5):
            for k, step in steps.items():
                for _ in range(5):
                    step()
                t0 = time.perf_counter()
                for _ in range(50):
                    step()
                times[k].append((time.perf_counter() - t0) / 50 * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [
            f"{k} {med[k]:.0f} [{min(v):.0f}-{max(v):.0f}] {med[k] / med['bf16 kernels']:.2f}x"
            for k, v in times.items()
        ]
        print(f"{shape!s:18s} " + " | ".join(cells))


class _OwnForward(nn.BatchNorm2d):
    """A batch norm with a forward of its own (as timm's and MONAI's are): the swap runs it under
    a TorchFunctionMode (core.ops.call's general path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def swap_cost(repeat: int, layers: int = 50) -> None:
    print(
        f"\n6. the operation swap (core.ops.call) on a net of {layers} batch norms (each after a 1x1 "
        "convolution and a ReLU), one process, one thread, batch 8 of 16 x 8 x 8, forward + "
        "backward; the stand-in is torch's own F.batch_norm, so only the swap is timed; "
        f"contenders interleaved, {repeat * 5} rounds: median ms per step [min-max]"
    )
    torch.set_num_threads(1)

    def net(bn) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *[m for _ in range(layers) for m in (nn.Conv2d(16, 16, 1), bn(16), nn.ReLU())]
        )

    nets = {"torch's batch norm": net(nn.BatchNorm2d)}
    nets["swapped, fast path"] = net(nn.BatchNorm2d)
    nets["swapped, mode"] = net(_OwnForward)
    for name in ("swapped, fast path", "swapped, mode"):
        for i, m in enumerate(nets[name]):
            if isinstance(m, nn.BatchNorm2d):
                ops.install(m, F.batch_norm, name=str(i))
    x = torch.randn(8, 16, 8, 8)

    def step(m: nn.Module) -> None:
        m(x).sum().backward()

    times: dict[str, list[float]] = {k: [] for k in nets}
    for _ in range(repeat * 5):
        for k, m in nets.items():
            for _ in range(3):
                step(m)
            t0 = time.perf_counter()
            for _ in range(20):
                step(m)
            times[k].append((time.perf_counter() - t0) / 20 * 1e3)
    base = statistics.median(times["torch's batch norm"])
    print(f"{'contender':<22} {'ms/step':>8} {'range':>15} {'vs torch':>9} {'us per call':>12}")
    for k, v in times.items():
        med = statistics.median(v)
        print(
            f"{k:<22} {med:8.3f} {f'[{min(v):.3f}-{max(v):.3f}]':>15} {med / base:8.3f}x "
            f"{(med - base) * 1e3 / layers:12.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of part 1 (noise)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--parts", default="1,2,3")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "1" in parts:
        cost([int(p) for p in args.procs.split(",")], args.steps, args.repeat)
    if "2" in parts:
        accuracy([int(s) for s in args.seeds.split(",")], args.epochs)
    if "3" in parts:
        large_batch(args.epochs * 3)
    if "4" in parts:
        whole_run(args.epochs, args.repeat)
    if "5" in parts:
        bf16_layer(args.repeat)
    if "6" in parts:
        swap_cost(args.repeat)


if __name__ == "__main__":
    main()
