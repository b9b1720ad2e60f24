"""Before any process starts: validate the config, describe the data, build or load the plan and
check it against the model (traced on the meta device); then launch the ranks and write the report.

A fixed preset (ddp, owt, grid:RxC, batch, model) or a plan file is resolved here, in the parent,
and handed to every rank. A preset the planner chooses on a cluster (auto, same-grid, fc-grid,
per-layer) is decided in the job by rank 0, which calibrates `localhost` first if it has to (with
every rank taking part in the measurement) and broadcasts the plan (DESIGN.md invariant 3): under
torchrun every rank runs this module, and only rank 0 may decide or write the calibration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hybridpar.errors import ConfigError
from hybridpar.plan import ParallelPlan
from hybridpar.runtime.launcher import launch, under_torchrun
from hybridpar.runtime.train.config import DEFAULT_MODEL, TrainConfig

__all__ = ["Job", "prepare", "run"]


@dataclass(frozen=True)
class Job:
    """What every rank needs: the resolved config, the data's shape, and the plan (None when rank
    0 chooses it in the job)."""

    cfg: TrainConfig
    procs: int
    input_shape: tuple[int, ...]
    num_classes: int
    plan: ParallelPlan | None
    resume: Path | None = None


def prepare(cfg: TrainConfig) -> Job:
    """Check everything that can be checked without processes; raise a one-line ConfigError."""
    from hybridpar.planning.analysis import trace
    from hybridpar.planning.cost.layers import cost_layers
    from hybridpar.planning.models import MODELS, input_shape
    from hybridpar.runtime.parallel.layout import resolve
    from hybridpar.runtime.train.data import signature

    cfg.validate()
    _check_environment()
    loaded = ParallelPlan.load(cfg.plan) if cfg.plan else None
    cfg = _defaults(cfg, loaded)
    resume = _resume(cfg)
    cfg = _outputs(cfg)
    P = int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.nproc
    if cfg.model not in MODELS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of: {', '.join(MODELS)}")
    if cfg.batch % P:
        raise ConfigError(
            f"global batch {cfg.batch} does not split evenly over {P} ranks; use a multiple of {P}"
        )
    info = MODELS[cfg.model]
    shape, classes = signature(cfg.data, input_shape(cfg.model, cfg.input_size), info.num_classes)
    model = meta_model(cfg.model, shape, classes)
    traced = trace(model, shape)  # also the check that the model runs on the data's shape
    layers = cost_layers(traced.specs)
    if loaded is not None:  # names, styles, layouts: every check before spawning
        resolve(model, loaded, shape, P, traced)
        plan = _checked_file_plan(loaded, cfg, model, layers, shape)
    elif cfg.searched:  # rank 0 plans in the job; the cluster it will read is checked now
        pricing_cluster(cfg.cluster, required=False)
        plan = None
    else:
        plan = build_plan(cfg, P, layers, shape, pricing_cluster(cfg.cluster, required=False))
        resolve(model, plan, shape, P, traced)
    if resume is not None:
        _check_resume(resume, cfg, shape, classes)
    device = _device(cfg, P)
    if plan is not None:
        plan = plan.with_choices(device=device)
    return Job(cfg.with_(device=device), P, shape, classes, plan, resume)


def _check_environment() -> None:
    """The HYBRIDPAR_* settings the ranks read, checked before they are spawned."""
    from hybridpar.runtime.comm.host import _stage_bytes

    try:
        _stage_bytes()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    timeout = os.environ.get("HYBRIDPAR_TIMEOUT_S", "300")
    try:
        ok = float(timeout) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"HYBRIDPAR_TIMEOUT_S={timeout!r}: give the collective timeout in seconds > 0"
        )


def _device(cfg: TrainConfig, P: int) -> str:
    """cpu or cuda. CUDA runs one rank per GPU (NCCL refuses two ranks on one device)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", P)) if under_torchrun() else P
    if cfg.device == "auto":
        return "cuda" if gpus >= local else "cpu"
    if cfg.device == "cuda" and gpus < local:
        raise ConfigError(
            f"--device cuda runs one rank per GPU: {local} local ranks but {gpus} GPUs here; "
            "use fewer ranks or --device cpu"
        )
    return cfg.device


def _resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to go on from, or None; a --checkpoint-dir that holds checkpoints is only
    written into on purpose (--resume auto)."""
    from hybridpar.runtime.train.checkpoint import latest

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


def _check_resume(path: Path, cfg: TrainConfig, shape: tuple[int, ...], classes: int) -> None:
    """The checkpoint must be of this model and data; the plan and P may differ."""
    from hybridpar.runtime.train.checkpoint import read_meta

    meta = read_meta(path)
    then = meta["config"]
    plan = meta["plan"]
    for what, old, new in (("model", then["model"], cfg.model), ("data", then["data"], cfg.data),
                           ("batch", then["batch"], cfg.batch), ("seed", then["seed"], cfg.seed),
                           ("input shape", tuple(plan["input_shape"] or ()), tuple(shape))):  # fmt: skip
        if old != new:
            raise ConfigError(
                f"the checkpoint in {path} is for {what} {old}, this run has {new}; resume with the same {what}"
            )


def _outputs(cfg: TrainConfig) -> TrainConfig:
    """Where the weights go, and a check that every output can be written, before any work."""
    save = cfg.save or str(
        Path(cfg.checkpoint_dir or "runs")
        / ("final.pt" if cfg.checkpoint_dir else f"{cfg.model}.pt")
    )
    for flag, target in (
        ("--save", save),
        ("--report", cfg.report),
        ("--checkpoint-dir", cfg.checkpoint_dir and Path(cfg.checkpoint_dir) / "x"),
    ):
        if target is not None:
            _writable(flag, Path(target))
    return cfg.with_(save=save)


def _writable(flag: str, path: Path) -> None:
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".hybridpar-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot write in {folder} ({exc.strerror}); choose another place"
        ) from None


def _defaults(cfg: TrainConfig, plan: ParallelPlan | None) -> TrainConfig:
    """Model, processes and batch come from the plan file when given, else the defaults; the wire
    and reduction choices of a plan file win, and an explicit conflicting one is an error."""
    if plan is None:
        return cfg.with_(
            model=cfg.model or DEFAULT_MODEL, nproc=cfg.nproc or 4, batch=cfg.batch or 64
        )
    for name, value in (("nproc", plan.procs), ("batch", plan.batch)):
        given = getattr(cfg, name)
        if given is not None and given != value:
            raise ConfigError(
                f"the plan is for --{name} {value}, got {given}; drop --{name} or re-plan"
            )
    defaults = TrainConfig()
    for name in ("codec", "reducer", "bn", "amp"):
        given, wanted = getattr(cfg, name), getattr(plan, name)
        if given != getattr(defaults, name) and given != wanted:
            raise ConfigError(
                f"the plan says {name} {wanted}, got --{name} {given}; drop it or re-plan"
            )
    model = cfg.model or plan.model or DEFAULT_MODEL
    size = cfg.input_size or (
        plan.input_shape[-1] if plan.input_shape and len(plan.input_shape) == 3 else None
    )
    return cfg.with_(
        model=model,
        nproc=plan.procs,
        batch=plan.batch,
        input_size=size,
        codec=plan.codec,
        reducer=plan.reducer,
        bn=plan.bn,
        amp=plan.amp,
    )


def meta_model(name: str, shape: tuple[int, ...], classes: int):
    import torch

    from hybridpar.planning.models import build_model

    size = shape[-1] if len(shape) == 3 else None
    with torch.device("meta"):
        return build_model(name, input_size=size, num_classes=classes, in_channels=shape[0])


def model_layers(model, shape: tuple[int, ...]):
    from hybridpar.planning.analysis import analyze
    from hybridpar.planning.cost.layers import cost_layers

    return cost_layers(analyze(model, shape))


def pricing_cluster(spec: str, required: bool):
    """The cluster presets are priced on. An uncalibrated `localhost` prices bytes only (seconds
    ~0) for a fixed preset, and is calibrated in the job for a searched one."""
    from hybridpar.planning.cluster import BYTES_ONLY, load_cluster, localhost_path

    if spec == "localhost" and not localhost_path().exists() and not required:
        return BYTES_ONLY
    return load_cluster(spec)


def build_plan(cfg: TrainConfig, P: int, layers, shape: tuple[int, ...], cluster) -> ParallelPlan:
    from hybridpar.choices import parse_compress
    from hybridpar.planning.presets import plan_preset

    return plan_preset(
        cfg.preset,
        layers,
        P,
        cfg.batch,
        cluster,
        model=cfg.model,
        input_shape=shape,
        codec=cfg.codec,
        compress=tuple(sorted(parse_compress(cfg.compress))),
        bn=cfg.bn,
        reducer=cfg.reducer,
        amp=cfg.amp,
    )


def _checked_file_plan(plan: ParallelPlan, cfg: TrainConfig, model, layers, shape) -> ParallelPlan:
    """A plan file must be for this model and data. A hand-written one (no predictions) becomes
    the exact plan it means: one style per layer, priced on --cluster."""
    from hybridpar.plan import assign_styles
    from hybridpar.planning.search import evaluate, export

    if plan.input_shape and tuple(plan.input_shape) != tuple(shape):
        raise ConfigError(
            f"the plan was made for input {tuple(plan.input_shape)} but the data gives "
            f"{tuple(shape)}; re-plan with the data's --input-size"
        )
    names = [x.name for x in layers]
    styles = assign_styles(plan.styles, [n for n, _ in model.named_modules()], names, plan.procs)
    cluster = pricing_cluster(cfg.cluster, required=False)
    chosen = [styles[n] for n in names]
    choices = dict(codec=plan.codec, compress=frozenset(plan.compress), bn=plan.bn, amp=plan.amp)
    priced = evaluate(layers, plan.procs, plan.batch, cluster, chosen, **choices)
    if not priced.feasible:
        raise ConfigError(f"the plan cannot run on {cfg.model}: {priced.reason}")
    fresh = export(
        priced,
        procs=plan.procs,
        batch=plan.batch,
        model=cfg.model,
        input_shape=tuple(shape),
        codec=plan.codec,
        compress=plan.compress,
        bn=plan.bn,
        amp=plan.amp,
        reducer=plan.reducer,
        engine=plan.engine,
        cluster=cluster.name,
    )
    if not plan.predicted:
        return fresh.with_choices(scenario=plan.scenario)
    if _bytes(plan) != _bytes(fresh):
        raise ConfigError(
            "the plan's predicted bytes do not match this model (different widths or classes?): "
            "it was made for another model; re-plan for this one"
        )
    return plan


def _bytes(plan: ParallelPlan) -> dict:
    return {k: round(v, 3) for k, v in plan.predicted_bytes(by_layer=True).items()}


def run(cfg: TrainConfig) -> dict | None:
    """Train; rank 0's report (None on the other ranks under torchrun)."""
    from hybridpar.runtime.train.loop import train_worker

    job = prepare(cfg)
    backend = "nccl" if job.cfg.device == "cuda" else "gloo"
    return launch(train_worker, job.procs, job, timeout_s=job.cfg.timeout_s, backend=backend)[0]
