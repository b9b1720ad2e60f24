"""Validate a training config before any process starts, resolve `auto`, launch, write the report."""

from __future__ import annotations

import dataclasses
import os

from hybridpar.errors import ConfigError
from hybridpar.train.config import TrainConfig, parse_strategy
from hybridpar.train.launch import launch, under_torchrun
from hybridpar.wire import check_codec, parse_compress

__all__ = ["prepare", "run"]


def _world(cfg: TrainConfig) -> int:
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.nproc


def prepare(cfg: TrainConfig) -> tuple[TrainConfig, str]:
    """Check everything that can be checked without processes; return the config with its grid."""
    import torch

    from hybridpar.models import MODELS, build_model, fc_tail_start
    from hybridpar.train.data import validate_data_spec
    from hybridpar.train.optim import lr_factor

    P = _world(cfg)
    if P < 1:
        raise ConfigError(f"--nproc must be at least 1, got {P}")
    if cfg.epochs < 1 or cfg.batch < 1:
        raise ConfigError("--epochs and --batch must be at least 1")
    if cfg.model not in MODELS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of: {', '.join(MODELS)}")
    lr_factor(cfg.schedule, 0.0)
    check_codec(cfg.codec)
    parse_compress(cfg.compress)
    if cfg.codec_block < 0:
        raise ConfigError("--codec-block must be 0 (one scale per tensor) or a positive block size")
    if cfg.reducer not in ("process-group", "host"):
        raise ConfigError(f"unknown --reducer {cfg.reducer!r}; use process-group or host")
    if cfg.reducer == "host" and cfg.codec != "none" and "grads" in parse_compress(cfg.compress):
        raise ConfigError(
            "--reducer host sums float32 gradients; use --compress activations or --codec none"
        )
    if cfg.bn not in ("local", "global", "adaptive"):
        raise ConfigError(f"unknown --bn {cfg.bn!r}; use local, global or adaptive")
    if cfg.bn_window < 1 or not cfg.bn_threshold >= 0:
        raise ConfigError("--bn-window must be at least 1 and --bn-threshold at least 0")
    validate_data_spec(cfg.data)
    if cfg.batch % P:
        raise ConfigError(
            f"global batch {cfg.batch} does not split evenly over {P} ranks; use a multiple of {P}"
        )
    kind, grid = parse_strategy(cfg.strategy, P)
    if kind == "auto":
        grid = _auto_grid(cfg, P)
        kind = "hybrid"
    pr, pc = grid
    if cfg.reducer == "host" and pr > 1 and kind != "ddp":
        raise ConfigError(
            f"--reducer host runs with pure batch parallelism; use --strategy grid:1x{P} or ddp"
        )
    if pr > 1:
        with torch.device("meta"):
            model = build_model(cfg.model, input_size=cfg.input_size)
        tail = fc_tail_start(model)  # raises the one-line error when there is none
        widths = [m.out_features for m in list(model)[tail:] if isinstance(m, torch.nn.Linear)]
        if pr > min(widths):
            raise ConfigError(
                f"Pr={pr} exceeds the narrowest FC layer of {cfg.model} ({min(widths)} outputs); use a smaller Pr"
            )
    return dataclasses.replace(cfg, grid=(pr, pc)), kind


def _auto_grid(cfg: TrainConfig, P: int) -> tuple[int, int]:
    """The planner's choice among what the runtime executes (pure batch, or FC on a grid) for the
    cluster `localhost`, calibrating it first if needed."""
    from hybridpar.cluster import load_cluster, localhost_path
    from hybridpar.planner import make_plan

    if not localhost_path().exists():
        from hybridpar.calibrate import calibrate

        print(
            "calibrating this machine for --strategy auto (once; `hybridpar calibrate` to redo) ...",
            flush=True,
        )
        calibrate(nproc=min(2, max(P, 2)))
    size = cfg.input_size or (8 if cfg.data == "digits" else None)
    r = make_plan(
        cfg.model,
        P,
        cfg.batch,
        load_cluster("localhost"),
        input_size=size,
        scenarios=["batch", "fc-grid"],
    )
    best = r.best
    return (1, P) if best.scenario == "batch" else best.grid


def run(cfg: TrainConfig) -> dict:
    from hybridpar.train.loop import train_worker
    from hybridpar.train.report import write_report

    cfg, kind = prepare(cfg)
    results = launch(train_worker, _world(cfg), cfg, kind, timeout_s=cfg.timeout_s)
    report = results[0]
    if report is not None and cfg.report:
        json_path, png = write_report(report, cfg.report)
        report["written"] = [str(json_path)] + ([str(png)] if png else [])
    return report
