"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically, resumable onto
another grid or another number of processes.

What a checkpoint holds:

| key                      | what                                              | written by              |
| ------------------------ | ------------------------------------------------- | ----------------------- |
| `model.<name>`           | parameters and buffers, original names            | split layers: each shard once (a DTensor, Shard(0) over the model group); the rest once |
| `optim.<param>.<state>`  | optimizer state (momentum), laid out as its param | likewise                |
| `rank<r>.<...>`          | random-generator states, codec error-feedback     | rank r                  |
| `hybridpar.json`         | step, epoch and position in it, the epoch's       | rank 0                  |
|                          | partial sums, history, plan, config, adaptive BN  |                         |

Loading asks DCP for the tensors laid out as the *current* run holds them, so a checkpoint of a
2x2 plan on 4 ranks loads into a 3x1 plan on 3 ranks: DCP reads the overlapping pieces. The
per-rank state comes back only on the same plan and P (elsewhere it has no meaning; the run says
so): then resuming is bit-exact.

Atomic: every rank writes into `D/.tmp-step-N`; when all have written, rank 0 adds
`hybridpar.json`, renames the folder to `D/step-N` and points `D/latest` at it (write, then
rename). A job killed while writing leaves the previous checkpoint as `latest`. D must be a folder
every rank can write, a shared file system across hosts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hybridpar.errors import ConfigError

__all__ = ["FORMAT", "Position", "latest", "load", "read_meta", "save", "save_weights"]

FORMAT = "hybridpar-checkpoint/1"
META = "hybridpar.json"


@dataclass
class Position:
    """Where training stands: the next step is step `index` of epoch `epoch`."""

    epoch: int = 0
    index: int = 0
    step: int = 0  # optimizer steps taken
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # this epoch so far, global
    history: list[dict] = field(default_factory=list)  # the epoch records before it


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in `directory` (or `directory` itself if it is one)."""
    d = Path(directory)
    if (d / META).is_file():
        return d
    pointer = d / "latest"
    if pointer.is_file():
        path = d / pointer.read_text().strip()
        if (path / META).is_file():
            return path
    return None


def read_meta(path: str | Path) -> dict:
    """The checkpoint's metadata (no process group needed)."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}); "
                          "give a folder written by --checkpoint-dir") from None  # fmt: skip
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{str(path)!r} is not a hybridpar checkpoint ({meta.get('format')!r})")
    return meta


def _state(trainer, position: Position | None, per_rank: bool) -> dict:
    """The tensors of a checkpoint as this run holds them (views: loading writes into them)."""
    hp, rank = trainer.hybrid, dist.get_rank()
    module = trainer.net.module
    model = hp.distributed_state_dict() if hp else module.state_dict()
    state = {f"model.{k}": v for k, v in model.items()}
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    for p, slots in trainer.opt.state.items():
        name = names[id(p)]
        for k, v in slots.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and hp is not None:
                v = hp.distributed(name, v)
            state[f"optim.{name}.{k}"] = v
    if per_rank:
        state[f"rank{rank}.rng"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state[f"rank{rank}.rng_cuda"] = torch.cuda.get_rng_state()
        for key, res in trainer.residuals().items():
            for j, t in enumerate(res):
                state[f"rank{rank}.residual.{key}.{j}"] = t
    return state


def _global_sums(trainer, position: Position) -> tuple[list[float], dict | None]:
    """The epoch's partial sums and the adaptive BN's window accumulators summed over the ranks
    (one small all-reduce): stored once, carried on by one rank after a resume, on any P."""
    from hybridpar.plan import Term
    from hybridpar.runtime.comm.collectives import all_reduce

    switch = trainer.bn_switch.state() if trainer.bn_switch else None
    acc = switch["acc"][:2] if switch else [0.0, 0.0]
    t = torch.tensor([*position.sums, *acc], dtype=torch.float64, device=trainer.device)
    all_reduce(t, dist.group.WORLD, None, Term.STATE)
    values = t.tolist()
    if switch:
        switch["acc"] = [*values[3:5], switch["acc"][2]]
    return values[:3], switch


def save(trainer, directory: str | Path, position: Position, keep: int = 2) -> Path:
    """Write a checkpoint collectively (every rank calls it); returns its folder."""
    d = Path(directory)
    name = f"step-{position.step:08d}"
    tmp = d / f".tmp-{name}"
    rank = dist.get_rank()
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob(".tmp-step-*"):  # a write that was killed
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    from hybridpar.runtime import faults

    sums, switch = _global_sums(trainer, position)
    faults.set_step(position.step)
    faults.at("checkpoint")  # as the write starts: the others write shards, this one never will
    dcp.save(_state(trainer, position, per_rank=True), checkpoint_id=str(tmp))
    if rank == 0:
        meta = {
            "format": FORMAT,
            "procs": dist.get_world_size(),
            "position": {**position.__dict__, "sums": sums},
            "plan": trainer.plan.to_dict(),
            "config": trainer.cfg.to_dict(),
            "bn_switch": switch,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1, allow_nan=False))
        final = d / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        pointer = d / ".latest.tmp"
        pointer.write_text(name)
        pointer.replace(d / "latest")
        for old in sorted(d.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return d / name


def load(trainer, path: str | Path) -> Position:
    """Load a checkpoint into the running trainer (collective); returns where to go on from."""
    path = Path(path)
    meta = read_meta(path)
    same = meta["procs"] == dist.get_world_size() and meta["plan"]["styles"] == {
        k: v.label for k, v in trainer.plan.styles.items()
    }
    _slots(trainer, path, same)
    state = _state(trainer, None, per_rank=same)
    dcp.load(state, checkpoint_id=str(path))
    rank = dist.get_rank()
    if same:
        torch.set_rng_state(state[f"rank{rank}.rng"])
        if f"rank{rank}.rng_cuda" in state:
            torch.cuda.set_rng_state(state[f"rank{rank}.rng_cuda"])
    pos = Position(**meta["position"])
    switch = meta["bn_switch"]
    if rank != 0:  # the partial sums are global: one rank carries them on
        pos.sums = [0.0, 0.0, 0.0]
        if switch:
            switch["acc"] = [0.0, 0.0, switch["acc"][2]]
    if trainer.bn_switch is not None and switch:
        trainer.bn_switch.restore(switch)
    trainer.restore_step(pos.step)
    trainer.resharded = not same
    return pos


def _slots(trainer, path: Path, per_rank: bool) -> None:
    """Create the state the checkpoint has and a fresh run lacks (optimizer momentum, codec
    residuals), shaped as this run holds it, so that DCP can load into it."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    params = dict(trainer.net.module.named_parameters())
    mine = f"rank{dist.get_rank()}.residual."
    for key, info in metadata.items():
        if key.startswith("optim."):
            name, _, slot = key[len("optim.") :].rpartition(".")
            p = params.get(name)
            if p is None:
                raise ConfigError(
                    f"the checkpoint has optimizer state for {name!r}, which this model lacks"
                )
            trainer.opt.state[p].setdefault(slot, torch.zeros_like(p))
        elif per_rank and key.startswith(mine):
            bucket, j = (int(x) for x in key[len(mine) :].split("."))
            trainer.residual_slot(bucket, j, tuple(info.size))


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """The original model's state_dict, for plain `torch.load` into the user's model (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({k: v.cpu() for k, v in state.items()}, tmp)
    tmp.replace(path)
    return path
