"""`hybridpar predict`: a trained net's class mask (and, with --probabilities, every class's
probability) of each whole image, no rank holding a whole image or output it does not need.

Before any process starts the parent reads the images' sizes from their headers, checks the
weights against the model, plans each size once (a plan per distinct size, batch 1: an image
at a time) and creates every output file (`NAME.mask.npy`, `NAME.probabilities.npy` in --out;
sparse until written). Each rank then reads its band or tile of an image (data.Mapped), runs the
net on it in evaluation mode (trainer.own_outputs) and writes its part of the outputs straight
into their place of the memory-mapped files; rank 0 says a line per image once every rank has
written it."""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridpar.core.analysis import trace
from hybridpar.core.cluster import BYTES_ONLY, load_cluster, localhost_path, rank_threads
from hybridpar.core.config import writable
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import cost_layers
from hybridpar.core.live import peak_of
from hybridpar.core.models import build_any
from hybridpar.core.plan import ParallelPlan
from hybridpar.planning.presets import plan_preset
from hybridpar.planning.request import PlanRequest
from hybridpar.runtime.comm.devices import local_gpu
from hybridpar.runtime.parallel.api import parallelize
from hybridpar.runtime.parallel.layout import Layout, resolve
from hybridpar.runtime.parallel.memory import peak_bytes
from hybridpar.runtime.parallel.trainer import own_outputs
from hybridpar.runtime.train.config import PredictConfig
from hybridpar.runtime.train.data import (
    IMAGE_SUFFIXES,
    Files,
    Mapped,
    Volumes,
    digits_seg,
    image_shape,
)
from hybridpar.runtime.train.run import device_and_backend
from hybridpar.runtime.train.stores import ARRAY_SUFFIXES, VOLUME_SUFFIXES, arrays

__all__ = ["predict_worker", "prepare_predict"]


@dataclass(frozen=True)
class Image:
    """One image to predict: its name (the output files'), (C, *size) and where its pixels are
    read from (`open_image`)."""

    name: str
    shape: tuple[int, ...]
    source: tuple


@dataclass(frozen=True)
class Group:
    """The images of one size and the plan they run with."""

    shape: tuple[int, ...]
    layout: Layout
    images: tuple[Image, ...]


@dataclass(frozen=True)
class PredictJob:
    cfg: PredictConfig
    procs: int
    classes: int
    groups: tuple[Group, ...]
    device: str = "cpu"  # and the backend: a GPU per rank where there are enough (run.py's rule)
    backend: str = "gloo"


def images_of(spec: str) -> list[Image]:
    """The images of --data, their sizes from headers (no pixels read)."""
    if spec.split(":")[0] == "digits-seg":
        x, _ = digits_seg(spec, 0)
        return [
            Image(f"{i:05d}", tuple(x.shape[1:]), ("digits-seg", spec, i)) for i in range(len(x))
        ]
    p = Path(spec)
    if not p.exists():
        raise ConfigError(f"--data {spec}: no such file or folder")
    if p.suffix in (*ARRAY_SUFFIXES, ".npz") or (p / "x.npy").exists():
        x = _array(spec)
        return [Image(f"{i:05d}", tuple(x.shape[1:]), ("array", spec, i)) for i in range(len(x))]
    folder = p / "images" if (p / "images").is_dir() else p
    files = sorted(
        f for f in folder.iterdir() if f.suffix.lower() in (*IMAGE_SUFFIXES, *VOLUME_SUFFIXES)
    )
    if not files:
        raise ConfigError(f"--data {spec}: no images there (PNG, JPEG, TIFF or NIfTI files)")
    return [Image(f.stem, image_shape(f), ("file", str(f))) for f in files]


def _array(spec: str):
    """The images array x of an array file or folder (memory-mapped or read by band where the
    format allows; a .npz's whole)."""
    p = Path(spec)
    if p.suffix == ".npz":
        with np.load(p) as f:
            return f["x"]
    if p.suffix in ARRAY_SUFFIXES:
        found = arrays(p, [0])
    else:
        found = {"x": np.load(p / "x.npy", mmap_mode="r")}
    if "x" not in found:
        raise ConfigError(f"--data {spec}: no array x of images")
    return found["x"]


def open_image(image: Image, dtype: torch.dtype, cache: dict) -> Mapped:
    """The image as a batch of one nothing has read yet (data.Mapped: a rank reads its rows)."""
    kind, spec, *rest = image.source
    if kind == "file":
        f = Path(spec)
        if f.suffix.lower() in VOLUME_SUFFIXES:
            x = Volumes([f], image.shape, False, [0])
        else:
            x = Files([f], image.shape, "L" if image.shape[0] == 1 else "RGB")
        return Mapped(x, np.zeros(1, dtype=np.int64), dtype, [0, 0, 0])
    if spec not in cache:
        cache[spec] = digits_seg(spec, 0)[0] if kind == "digits-seg" else _array(spec)
    return Mapped(cache[spec], np.array(rest, dtype=np.int64), dtype, [0, 0, 0])


def _classes(cfg: PredictConfig, state: dict) -> int:
    """The classes the weights predict: the outputs of their last tensor."""
    last = next((v for v in reversed(state.values()) if v.dim() >= 1), None)
    if last is None:
        raise ConfigError(f"--weights {cfg.weights}: no tensors in it")
    return int(last.shape[0])


def _weights(cfg: PredictConfig) -> dict:
    try:
        state = torch.load(cfg.weights, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
        raise ConfigError(
            f"--weights {cfg.weights}: cannot be read ({str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"--weights {cfg.weights}: not a state_dict (give what `train --save` wrote)"
        )
    return state


def _model(cfg: PredictConfig, shape: tuple, classes: int, state: dict, device="meta"):
    """The model for images of `shape` with the weights loaded (on the meta device: checked)."""
    with torch.device(device):
        model = build_any(cfg.model, shape, classes)
    try:
        model.load_state_dict(state, assign=device == "meta")
    except RuntimeError as exc:
        why = str(exc).splitlines()[1].strip() if "\n" in str(exc) else str(exc)
        raise ConfigError(
            f"--weights {cfg.weights} are not of --model {cfg.model} for {classes} classes and "
            f"{shape[0]} input channels ({why})"
        ) from None
    return model


def _plan(cfg: PredictConfig, P: int, shape: tuple, layers, name: str) -> ParallelPlan:
    """The plan of one image of `shape`: the plan file's (made for this size), or the preset's."""
    if cfg.plan is not None:
        plan = ParallelPlan.load(cfg.plan)
        if plan.input_shape and tuple(plan.input_shape) != tuple(shape):
            raise ConfigError(
                f"--plan {cfg.plan} is for images of {tuple(plan.input_shape)} but {name} is "
                f"{shape}; drop --plan to plan each size"
            )
        return plan
    device = "cpu"
    if cfg.cluster == "localhost" and not localhost_path(device).exists():
        cluster = BYTES_ONLY
    else:
        cluster = load_cluster(cfg.cluster, device)
    limit = cfg.memory_limit * 2**30 if cfg.memory_limit else None
    request = PlanRequest(
        P, 1, cluster, model=cfg.model, input_shape=shape, memory_limit=limit, mode="predict"
    )
    return plan_preset(cfg.preset if P > 1 else "batch", layers, request)  # one: whole


def prepare_predict(cfg: PredictConfig) -> PredictJob:
    """Everything checked and decided before any process starts: the weights against the model,
    each image size's plan, the output files (created, sparse)."""
    P = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else cfg.nproc
    state = _weights(cfg)
    classes = _classes(cfg, state)
    images = images_of(cfg.data)
    writable("--out", Path(cfg.out) / "x")
    groups = []
    for shape in dict.fromkeys(im.shape for im in images):
        mine = tuple(im for im in images if im.shape == shape)
        model = _model(cfg, shape, classes, state)
        traced = trace(model, shape)
        out = traced.out_shape
        if len(out) != len(shape) or tuple(out[1:]) != tuple(shape[1:]):
            raise ConfigError(
                f"--model {cfg.model} outputs {out} per image of {shape}: predict writes a class "
                "per pixel of the image; use a dense model (e.g. unet)"
            )
        plan = _plan(cfg, P, shape, cost_layers(traced.specs), mine[0].name)
        layout = resolve(model, plan, shape, P, traced)
        groups.append(Group(shape, layout, mine))
    creates = os.environ.get("RANK", "0") == "0"  # under torchrun every rank prepares: one writes
    for g in groups if creates else ():  # every check passed: nothing is written before
        for im in g.images:
            _create(cfg, im, (classes, *g.shape[1:]))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", P))
    return PredictJob(cfg, P, classes, tuple(groups), *device_and_backend("auto", "auto", local))


def _files(cfg: PredictConfig, image: Image) -> tuple[Path, Path]:
    out = Path(cfg.out)
    return out / f"{image.name}.mask.npy", out / f"{image.name}.probabilities.npy"


def _create(cfg: PredictConfig, image: Image, out: tuple[int, ...]) -> None:
    """The image's output files, their headers written and their data not (sparse)."""
    mask, probs = _files(cfg, image)
    np.lib.format.open_memmap(mask, "w+", np.uint8 if out[0] <= 256 else np.uint16, out[1:])
    if cfg.probabilities:
        np.lib.format.open_memmap(probs, "w+", np.dtype(cfg.dtype), out)


def predict_worker(job: PredictJob) -> list[dict]:
    """What every rank runs: each image's part this rank computes, written into the files;
    rank 0's line per image and its records (the others return theirs too)."""
    cfg, rank = job.cfg, dist.get_rank()
    torch.set_num_threads(rank_threads(os.cpu_count() or 1, job.procs))
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    state, cache, records = _weights(cfg), {}, []
    dist.barrier()  # under torchrun: rank 0 has created the files
    total, done = sum(len(g.images) for g in job.groups), 0
    device = torch.device(job.device, local_gpu() if job.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for g in job.groups:
        model = _model(cfg, g.shape, job.classes, state, "cpu").to(device, dtype)
        engine = parallelize(model, g.layout.plan, layout=g.layout, input_shape=g.shape)
        for k, image in enumerate(g.images):
            t0, got = time.perf_counter(), {}
            x = open_image(image, dtype, cache).to(device)
            run = lambda e=engine, x=x, got=got: got.update(out=own_outputs(e, x))  # noqa: E731
            held = _measured(run, engine) if k == 0 else run() or 0  # a size's first: its peak
            part, index = got["out"]
            if index is not None:
                _write(cfg, image, part, index)
            dist.barrier()  # the image is whole in its files
            done += 1
            seconds = time.perf_counter() - t0
            every = [0] * job.procs
            dist.all_gather_object(every, held)  # the busiest rank's
            shape, peak = list(image.shape), max(every)
            records.append({"image": image.name, "shape": shape, "seconds": seconds, "peak": peak})
            if rank == 0 and not cfg.quiet:
                size = " x ".join(map(str, image.shape[1:]))
                print(
                    f"[{done}/{total}] {image.name} ({size}) on {g.layout.segments[0].label} "
                    f"in {seconds:.2f} s -> {_files(cfg, image)[0]}",
                    flush=True,
                )
    return records


def _measured(fn, engine) -> int:
    """The peak of `fn()` as torch's MemTracker measures it (memory.peak_bytes); where it
    refuses the model (a module called twice in one forward), the tensors held at once and the
    weights (core.live.peak_of)."""
    try:
        return peak_bytes(fn, engine)
    except NotImplementedError:
        weights = sum(p.numel() * p.element_size() for p in engine.parameters())
        return peak_of(fn) + weights


def _write(cfg: PredictConfig, image: Image, part: torch.Tensor, index: tuple) -> None:
    """This rank's part (examples, classes, rows...) of an image's outputs into its files."""
    mask_file, probs_file = _files(cfg, image)
    pixels = index[2:]  # past the example and the classes
    mask = np.lib.format.open_memmap(mask_file, "r+")
    mask[pixels] = part[0].argmax(0).cpu().numpy()
    mask.flush()
    if cfg.probabilities:
        probs = np.lib.format.open_memmap(probs_file, "r+")
        probs[(slice(None), *pixels)] = part[0].softmax(0).cpu().numpy()
        probs.flush()
    del mask
