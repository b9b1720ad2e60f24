"""Whole images on ranks against sliding windows on one process (issue 74), in one invocation.

One U-Net of the zoo, trained here on digits-seg:64 (11 classes), predicts one digits-seg image
of --side pixels square. The memory limit per process is what the planner predicts 4 ranks on
bands need for it (mode predict: the activations alive at once, core.live); --fit's largest
image one process infers under it is printed beside. Contenders, interleaved over --rounds:

- hybridpar on P = 2 and 4 (`HybridTrainer.predict(x, out=...)`'s path, `own_outputs`: each rank
  reads its band, writes its part of the logits into one memory-mapped file);
- MONAI's `sliding_window_inference` on one process (overlap 0.25, gaussian blending), its ROI the
  largest square (a multiple of 16) whose measured peak stays under the limit.

Each against one process's whole-image inference (run once, without the limit): the largest
difference of a logit, the pixels whose class changes; the peak MemTracker measures (per rank;
the largest: the tensors held at once, as core.live counts them, and the weights), seconds
(median and spread over the rounds). Needs MONAI (`pip install monai`, the
`bench` extra); not part of CI.

    python benchmarks/inference.py [--side 512] [--rounds 3] [--out docs/inference.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridpar.core.analysis import analyze
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.live import peak_of
from hybridpar.core.models import build_any
from hybridpar.planning.fit import largest_fitting
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import plan_layers
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel.api import parallelize
from hybridpar.runtime.parallel.trainer import own_outputs
from hybridpar.runtime.train.data import Mapped, digits_seg

CLASSES = 11
NET = Cluster("bench", alpha=1e-6, beta=1e-9, flops=1e12)


def trained(steps: int = 60) -> dict[str, torch.Tensor]:
    """The zoo U-Net after `steps` Adam steps on digits-seg:64 (batches of 8), one process."""
    x, y = digits_seg("digits-seg:64:256", 0)
    torch.manual_seed(0)
    model = build_any("unet", (1, 64, 64), CLASSES)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = np.random.default_rng(0)
    for _ in range(steps):
        i = g.choice(len(x), 8, replace=False)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x[i])), torch.from_numpy(y[i])
        )
        loss.backward()
        opt.step()
    return model.state_dict()


def _model(state: dict, side: int) -> torch.nn.Module:
    model = build_any("unet", (1, side, side), CLASSES)
    model.load_state_dict(state)
    return model.eval()


def _plan(side: int, P: int, limit: float | None):
    """The planner's plan on bands (or tiles) for one image, for inference."""
    shape = (1, side, side)
    with torch.device("meta"):
        layers = cost_layers(analyze(build_any("unet", shape, CLASSES), shape))
    request = PlanRequest(P, 1, NET, model="unet", input_shape=shape, elem_bytes=4,
                          mode="predict", memory_limit=limit, scenarios=("domain",))  # fmt: skip
    return plan_layers(layers, request).export()


def ranks(state: dict, path: str, out: str, limit: float | None) -> tuple[float, float]:
    """(the busiest rank's peak, seconds) of one inference on this job's ranks, the logits
    written into `out` (a .npy every rank opens)."""
    x_all = np.load(path, mmap_mode="r")
    side, P = x_all.shape[-1], dist.get_world_size()
    model = _model(state, side)
    engine = parallelize(model, _plan(side, P, limit), input_shape=(1, side, side))
    x = Mapped(x_all, np.arange(1), torch.float32, [0, 0, 0])
    logits = np.lib.format.open_memmap(out, "r+")
    own_outputs(engine, x)  # once before it is timed and measured
    dist.barrier()
    t0 = time.perf_counter()
    part, index = own_outputs(engine, x)
    logits[index] = part.numpy()
    logits.flush()
    dist.barrier()
    seconds = time.perf_counter() - t0
    every = [None] * P
    dist.all_gather_object(every, _peak(lambda: own_outputs(engine, x), model))
    return max(every), seconds


def _peak(fn, model: torch.nn.Module) -> int:
    """Bytes at the peak of fn(): the tensors it holds at once (core.live.peak_of, every
    contender counted alike) and the model's weights."""
    return peak_of(fn) + sum(p.numel() * p.element_size() for p in model.parameters())


def _windows(state: dict, x: torch.Tensor, roi: int):
    from monai.inferers import sliding_window_inference

    model = _model(state, roi)

    def run():
        with torch.no_grad():
            return sliding_window_inference(x, (roi, roi), 1, model, overlap=0.25, mode="gaussian")

    return run, model


def _largest_roi(state: dict, x: torch.Tensor, limit: float) -> int:
    """The largest ROI (multiple of 16) whose sliding-window inference peaks under `limit`."""
    best = 16
    for roi in range(16, x.shape[-1] + 1, 16):
        run, model = _windows(state, x, roi)
        if _peak(run, model) > limit:
            break
        best = roi
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args()
    side, state = args.side, trained()
    image = digits_seg(f"digits-seg:{side}:2", 1)[0][:1].astype(np.float32)
    x = torch.from_numpy(image)
    with torch.no_grad():
        t0 = time.perf_counter()
        want = _model(state, side)(x)
        whole_s = time.perf_counter() - t0
    whole = _model(state, side)
    whole_peak = _peak(lambda: whole(x), whole)
    limit = _plan(side, 4, None).memory_bytes
    fit, _ = largest_fitting("unet", (1, 64, 64), 1, 1, NET, mode="predict", memory_limit=limit,
                             elem_bytes=4, scenarios=("batch",))  # fmt: skip
    alone = fit.input_shape[-1]
    roi = _largest_roi(state, x, limit)
    tmp = Path(tempfile.mkdtemp())
    np.save(tmp / "x.npy", image)
    runs: dict[str, list] = {"hybridpar P=2": [], "hybridpar P=4": [], f"MONAI ROI {roi}": []}
    outputs = {}
    for _ in range(args.rounds):
        for P in (2, 4):
            out = tmp / f"p{P}.npy"
            np.lib.format.open_memmap(out, "w+", np.float32, tuple(want.shape))
            fits = limit if P == 4 else None  # 2 ranks cannot: planned without it
            peak, s = launch(ranks, P, state, str(tmp / "x.npy"), str(out), fits, backend="gloo")[0]
            runs[f"hybridpar P={P}"].append((peak, s))
            outputs[f"hybridpar P={P}"] = torch.from_numpy(np.load(out))
        run, model = _windows(state, x, roi)
        t0 = time.perf_counter()
        got = run()
        s = time.perf_counter() - t0
        runs[f"MONAI ROI {roi}"].append((_peak(run, model), s))
        outputs[f"MONAI ROI {roi}"] = got
    lines = [
        f"U-Net (zoo, trained 60 steps on digits-seg:64), one {side} x {side} image, 11 classes; "
        f"limit {limit / 2**20:.2f} MiB a process (4 ranks' predicted peak); one process infers "
        f"up to {alone} x {alone} under it (plan --fit); whole image on one process: peak "
        f"{whole_peak / 2**20:.2f} MiB, {whole_s:.3f} s.",
        "",
        "| contender | largest logit difference | pixels whose class changes | peak MiB (largest rank) | peak / limit | seconds, median (spread) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, got in outputs.items():
        peaks, secs = zip(*runs[name], strict=True)
        diff = float((got - want).abs().max())
        changed = int((got.argmax(1) != want.argmax(1)).sum())
        spread = max(secs) - min(secs)
        lines.append(f"| {name} | {diff:.2e} | {changed} of {side * side} | {max(peaks) / 2**20:.2f} | "
                     f"{max(peaks) / limit:.3f} | {statistics.median(secs):.3f} ({spread:.3f}) |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
