"""Before any process starts: validate the config, describe the data, trace the model once (on the
meta device), build or load the plan and resolve it against the model; then launch the ranks and
write the report.

A fixed preset (ddp, owt, grid:RxC, batch, model) or a plan file is resolved here, in the parent,
and handed to every rank with the trace (hybridpar.runtime.train.job.Job). A preset the planner
chooses on a cluster (auto, same-grid, fc-grid, per-layer) is decided in the job by rank 0
(hybridpar.runtime.train.plans.agreed_plan): under torchrun every rank runs this module, and only
rank 0 may decide or write the calibration.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from hybridpar.core.analysis import trace
from hybridpar.core.choices import Choices
from hybridpar.core.config import writable
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import (
    Handoff,
    is_gather,
    why_not_handoff,
    why_not_variable_batch,
)
from hybridpar.core.layers import cost_layers
from hybridpar.core.models import build_any
from hybridpar.core.plan import ParallelPlan
from hybridpar.core.zoo import file_label, input_shape, is_factory, parse_input_shape, zoo_entry
from hybridpar.runtime.comm.group import DEFAULT_TIMEOUT_S
from hybridpar.runtime.launcher import launch, under_torchrun
from hybridpar.runtime.parallel.checkpoint import latest, read_meta
from hybridpar.runtime.parallel.compute import matching
from hybridpar.runtime.parallel.layout import Layout, resolve, with_handoff
from hybridpar.runtime.parallel.losses import Joined, by_sums, compares_values
from hybridpar.runtime.train.config import DEFAULT_MODEL, DEFAULTS, TrainConfig
from hybridpar.runtime.train.data import Signature, signature
from hybridpar.runtime.train.job import Job
from hybridpar.runtime.train.loop import make_loss, train_worker
from hybridpar.runtime.train.plans import checked_file_plan, parent_plan

__all__ = ["meta_model", "prepare", "run"]


def prepare(cfg: TrainConfig) -> Job:
    """Check everything that can be checked without processes; raise a one-line ConfigError.
    `cfg` is the user's and is not rewritten: what the run takes from the plan file, the
    defaults and this machine is decided here, once, and held by the Job."""
    loaded = ParallelPlan.load(cfg.plan) if cfg.plan else None
    given = _from_plan(cfg, loaded) if loaded else {}
    name = given.get("model") or cfg.model or DEFAULT_MODEL
    nproc = given.get("nproc") or cfg.nproc or DEFAULTS["nproc"]
    P = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    choices = _device(given.get("choices", cfg.choices), nproc)
    save, resume = _outputs(cfg, name), _resume(cfg)
    data = _signature(cfg, name, given)
    shape, classes = data.shape, data.classes
    model = meta_model(name, shape, classes)
    traced = trace(model, shape)  # also the check that the model runs on the data's shape
    _check_targets(cfg, name, traced.out_shape, data)
    if isinstance(_check_loss(cfg, data), Joined) and not loaded:  # the plan prices the join
        choices = choices.with_(joined_loss=True)
    if classes is None:  # a user's model on synthetic data: as many classes as it outputs
        classes = traced.specs[-1].out_shape[-1]
    batch = given.get("batch") or cfg.batch or DEFAULTS["batch"]
    layers = cost_layers(traced.specs)
    job = Job(cfg, name, P, batch, choices, save, shape, classes, traced, layers, None, resume)
    layout = _file_layout(job, loaded, model) if loaded else _preset_layout(job, model)
    if layout is not None and cfg.handoff in ("b", "c"):
        _check_handoff(cfg.handoff, cfg.rounds, layout)
    # the checkpointing patterns match, and no hand-off runs in rounds
    matching(model, choices.activation_checkpointing, layout)
    if layout is not None and cfg.runtime.variable_batch:
        why = why_not_variable_batch(layout.handoffs, layout.segments)
        if why:
            raise ConfigError(why)
    if resume is not None:
        _check_resume(resume, job)
    return replace(job, layout=layout)


def _file_layout(job: Job, loaded: ParallelPlan, model) -> Layout:
    """A plan file resolved against the model (names, styles, layouts; where it does not fit and
    was made for another model, the error says which), sent by --handoff's scheme where given,
    and priced on --cluster with the same styles."""
    name, c = job.model, job.choices
    plan = loaded.with_choices(device=c.device, backend=c.backend)
    try:
        layout = resolve(model, plan, job.input_shape, job.procs, job.trace)
    except ConfigError as exc:
        if plan.model and plan.model != name:
            raise ConfigError(
                f"the plan was made for {plan.model}, not {name} ({exc}): re-plan for this "
                f"model (`hybridpar plan --model {name} ... --out`) or drop --model"
            ) from None
        raise
    if job.cfg.handoff is not None:  # the file's hand-offs sent by another scheme: re-priced
        layout = with_handoff(layout, job.cfg.handoff, job.cfg.rounds)
    return replace(layout, plan=checked_file_plan(layout.plan, job, layout.styles))


def _preset_layout(job: Job, model) -> Layout | None:
    """A fixed preset's plan resolved against the model; None for a searched one (rank 0 plans
    it in the job)."""
    plan = parent_plan(job)
    return None if plan is None else resolve(model, plan, job.input_shape, job.procs, job.trace)


def _check_handoff(scheme: str, rounds: int | None, layout) -> None:
    """--handoff b or c must send some hand-off in rounds; else say why none can."""
    if any(h.scheme == scheme for h in layout.handoffs.values()):
        return
    moves = [(k, a, b) for k, a, b in layout.moves() if is_gather(a, b)]
    if not moves:
        raise ConfigError(
            f"--handoff {scheme}: this plan has no batch -> model hand-off (no layer gathers "
            "examples); use a plan with model-parallel layers after batch-parallel ones"
        )
    k, a, b = moves[0]
    first = layout.first_layer(k)
    why = why_not_handoff(
        Handoff(scheme, rounds if rounds and scheme == "c" else a.pc // b.pc),
        a,
        b,
        layout.head_layers(k),
        layout.plan.batch,
        layout.plan.choices.activations_encoded,
        first,
    )
    raise ConfigError(why or f"--handoff {scheme}: the planner kept scheme (a) before {first}")


def _signature(cfg: TrainConfig, model: str, given: dict) -> Signature:
    """(one example's shape, classes, target shape) of the data the model trains on; for a
    user's model the shape is --input-shape (or the plan file's) where the data does not fix it
    (and must agree where it does), and the classes None on synthetic data (then the model's
    outputs decide)."""
    text = given.get("input_shape", cfg.input_shape)
    if not is_factory(model):
        if text is not None:
            raise ConfigError(
                "--input-shape is for --model package.module:factory; zoo models take --input-size"
            )
        info = zoo_entry(model)
        size = given.get("input_size", cfg.input_size)
        return signature(cfg.data, input_shape(model, size), info.num_classes)
    wanted = parse_input_shape(text) if text else None
    synthetic = cfg.data.split(":")[0] == "synthetic"
    if synthetic and wanted is None:
        raise ConfigError(f"--model {model} on synthetic data needs --input-shape C,H,W")
    found = signature(cfg.data, wanted or (), None)  # type: ignore[arg-type]
    if wanted is not None and tuple(found.shape) != wanted:
        shown = ",".join(map(str, found.shape))
        raise ConfigError(f"--input-shape {text} but the data's examples are {shown}; drop it")
    return found._replace(shape=tuple(found.shape))


def _check_loss(cfg: TrainConfig, data: Signature):
    """--loss's loss: it builds (a user's factory is called here too) and its targets are the
    data's (a Dice compares a class per pixel)."""
    loss = make_loss(cfg.loss)
    if compares_values(loss):  # every data set here holds class labels
        raise ConfigError(
            f"--loss {cfg.loss} compares the outputs with values of their shape but --data "
            f"{cfg.data} gives class labels; use --loss cross_entropy (or dice, dice+ce), or "
            "train on one-hot targets in your own loop (HybridTrainer)"
        )
    if by_sums(loss) and not data.target:
        raise ConfigError(
            f"--loss {cfg.loss} compares a class per pixel but --data {cfg.data} gives one label "
            "per example; use --loss cross-entropy, or masks (e.g. --data digits-seg:64)"
        )
    return loss


def _check_targets(cfg: TrainConfig, model: str, out: tuple[int, ...], data: Signature) -> None:
    """The model's output per example (`out`, from the trace) must be what the loss compares
    with the data's targets: (classes,) for a class per example, (classes, *mask) for a class
    per pixel; said in one line before any process starts, not by torch in a rank."""
    if not out:  # not one tensor (a dict, a tuple): the loss reads it as it was written
        return
    shown = "x".join(map(str, out))
    if len(out) > 1 and not data.target:
        raise ConfigError(
            f"--model {model} predicts a class per pixel (an output of {shown} per example) but "
            f"--data {cfg.data} gives one label per example; train it on masks, e.g. --data "
            f"digits-seg:64"
        )
    if data.target and tuple(out[1:]) != tuple(data.target):
        mask = " x ".join(map(str, data.target))
        raise ConfigError(
            f"--data {cfg.data} gives a class per pixel ({mask} masks) but --model {model} "
            f"outputs {shown} per example; use a model that predicts a class per pixel of "
            "that size (e.g. --model unet), or data with one label per example"
        )
    if data.classes is not None and out[0] < data.classes:
        raise ConfigError(
            f"--data {cfg.data} has {data.classes} classes but --model {model} outputs "
            f"{out[0]} scores per {'pixel' if data.target else 'example'}; build it for "
            f"{data.classes} classes"
        )


def device_and_backend(device: str, backend: str, local: int) -> tuple[str, str]:
    """(cpu, gloo), (cuda, nccl): a GPU per local rank, or (cuda, gloo): ranks sharing GPUs (NCCL
    refuses two ranks on one device; gloo stages CUDA tensors through pinned host memory)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if gpus and (gpus >= local or backend == "gloo") else "cpu"
    if device == "cpu":
        if backend == "nccl":
            raise ConfigError("--backend nccl runs on GPUs: add --device cuda, or use gloo")
        return "cpu", "gloo"
    if backend == "gloo":
        if not gpus:
            raise ConfigError("--device cuda: no GPU here; use --device cpu")
        return "cuda", "gloo"
    if gpus < local:
        raise ConfigError(
            f"--device cuda with NCCL runs one rank per GPU: {local} local ranks but {gpus} GPUs "
            "here; use fewer ranks, --backend gloo (ranks share the GPUs), or --device cpu"
        )
    return "cuda", "nccl"


def _device(choices: Choices, nproc: int) -> Choices:
    """The device and backend for this machine's ranks (torchrun's local ones, else `nproc`)."""
    env = os.environ
    local = int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])) if under_torchrun() else nproc
    device, backend = device_and_backend(choices.device, choices.backend, local)
    return choices.with_(device=device, backend=backend)


def _resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to go on from, or None; a --checkpoint-dir that holds checkpoints is only
    written into on purpose (--resume auto)."""
    found = latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if cfg.resume is None:
        if found is not None:
            raise ConfigError(
                f"--checkpoint-dir {cfg.checkpoint_dir} already holds checkpoints; pass --resume "
                "auto to go on from them, or choose an empty folder"
            )
        return None
    if cfg.resume == "auto":
        return found
    path = latest(cfg.resume)
    if path is None:
        raise ConfigError(
            f"--resume {cfg.resume}: no checkpoint there; give a folder written by --checkpoint-dir"
        )
    return path


def _check_resume(path: Path, job: Job) -> None:
    """The checkpoint must be of this model and data; the plan and P may differ."""
    meta = read_meta(path)
    then = meta["config"]
    seed = then["runtime"]["seed"] if "runtime" in then else then["seed"]
    given = (
        ("model", then["model"], job.model),
        ("data", then["data"], job.cfg.data),
        ("batch", then["batch"], job.batch),
        ("seed", seed, job.cfg.runtime.seed),
        ("input shape", tuple(meta["plan"]["input_shape"] or ()), tuple(job.input_shape)),
    )
    for what, old, new in given:
        if old != new:
            raise ConfigError(
                f"the checkpoint in {path} is for {what} {old}, this run has {new}; "
                f"resume with the same {what}"
            )


def _outputs(cfg: TrainConfig, model: str) -> str:
    """Where the weights go (returned), and a check that every output can be written, before
    any work."""
    save = cfg.save or str(
        Path(cfg.checkpoint_dir or "runs")
        / ("final.pt" if cfg.checkpoint_dir else f"{file_label(model)}.pt")
    )
    for flag, target in (
        ("--save", save),
        ("--report", cfg.report),
        ("--checkpoint-dir", cfg.checkpoint_dir and Path(cfg.checkpoint_dir) / "x"),
    ):
        if target is not None:
            writable(flag, Path(target))
    if cfg.profile_trace is not None:
        writable("--profile-trace", Path(cfg.profile_trace) / "rank0.json")
    if cfg.tensorboard is not None:
        writable("--tensorboard", Path(cfg.tensorboard) / "x")
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--tensorboard needs the tensorboard package: pip install tensorboard"
            ) from None
    return save


def _shown(value: object) -> str:
    """A choice as its flag takes it (a tuple comma-separated, an empty one as none)."""
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def _from_plan(cfg: TrainConfig, plan: ParallelPlan) -> dict:
    """What the run takes from a plan file: model, processes, batch, input and choices (the
    file's win, and an explicit conflicting one is an error), but where it runs (the command
    line's device, else the plan's)."""
    for name, value in (("nproc", plan.procs), ("batch", plan.batch)):
        given = getattr(cfg, name)
        if given is not None and given != value:
            raise ConfigError(
                f"the plan is for --{name} {value}, got {given}; drop --{name} or re-plan"
            )
    explicit = Choices().differences(cfg.choices)  # what the command line changed
    for name, (wanted, given) in plan.choices.differences(cfg.choices).items():
        if name in explicit and name not in ("device", "backend"):
            flag, wanted, given = name.replace("_", "-"), _shown(wanted), _shown(given)
            raise ConfigError(
                f"the plan says {flag} {wanted}, got --{flag} {given}; drop it or re-plan"
            )
    model = cfg.model or plan.model or DEFAULT_MODEL
    size = cfg.input_size or (
        plan.input_shape[-1] if plan.input_shape and len(plan.input_shape) == 3 else None
    )
    shape = cfg.input_shape
    if is_factory(model) and shape is None and plan.input_shape:
        shape = ",".join(map(str, plan.input_shape))
        size = None
    # where it runs: the command line's, else the plan's
    placed = {k: getattr(cfg.choices, k) for k in ("device", "backend")}
    placed = {k: v if v != "auto" else getattr(plan.choices, k) for k, v in placed.items()}
    return {
        "model": model,
        "nproc": plan.procs,
        "batch": plan.batch,
        "input_size": size,
        "input_shape": shape,
        "choices": plan.choices.with_(**placed),
    }


def meta_model(name: str, shape: tuple[int, ...], classes: int | None) -> torch.nn.Module:
    """The zoo model for the data's shape and classes, or the user's factory's, on the meta
    device (no memory)."""
    with torch.device("meta"):
        return build_any(name, shape, classes)


def run(cfg: TrainConfig) -> dict | None:
    """Train; rank 0's report (None on the other ranks under torchrun)."""
    job = prepare(cfg)
    timeout = cfg.runtime.timeout_s or DEFAULT_TIMEOUT_S
    return launch(train_worker, job.procs, job, timeout_s=timeout, backend=job.choices.backend)[0]
