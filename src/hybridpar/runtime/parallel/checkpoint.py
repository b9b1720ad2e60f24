"""Checkpoints of (engine, optimizer) through torch.distributed.checkpoint (DCP), written
atomically, resumable onto another plan or another number of processes. `HybridTrainer.save` and
`.load` call these, so a user's own loop checkpoints exactly as `hybridpar train` does.

What a checkpoint holds, each part a DCP `Stateful`:

| key                      | what                                              | written by              |
| ------------------------ | ------------------------------------------------- | ----------------------- |
| `model.<name>`           | parameters and buffers, original names            | split layers: each shard once (a DTensor, Shard(0) over the model group); the rest once |
| `optim.<param>.<state>`  | optimizer state (momentum), laid out as its param | likewise                |
| `rank<r>.<...>`          | random-generator states, codec error-feedback     | rank r                  |
|                          | residuals, its batch norms' running statistics    |                         |
|                          | (local BN makes them differ between ranks)        |                         |
| `hybridpar.json`         | the step, the plan, P, the adaptive BN's state,   | rank 0                  |
|                          | and the caller's metadata (the CLI's position)    |                         |

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
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpar.core import faults
from hybridpar.core.errors import ConfigError
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via, all_reduce
from hybridpar.runtime.comm.hooks import PIECE_STRIDE
from hybridpar.runtime.parallel.engine import Engine

__all__ = ["FORMAT", "latest", "load", "read_meta", "save", "save_weights"]

FORMAT = "hybridpar-checkpoint/1"
META = "hybridpar.json"
RESERVED = ("format", "procs", "step", "plan", "bn_switch", "order")


class _Model:  # a DCP Stateful (a protocol: state_dict and load_state_dict)
    """The engine's parameters and buffers; split layers' shards as DTensor views (loaded in
    place)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def state_dict(self) -> dict:
        return self.engine.distributed_state_dict()

    def load_state_dict(self, state: dict) -> None:
        pass  # DCP wrote into the views state_dict() gave it


class _Optimizer:  # a DCP Stateful (a protocol: state_dict and load_state_dict)
    """The optimizer's per-parameter state by parameter name, each tensor laid out like its
    parameter (a shard as a DTensor view)."""

    def __init__(self, engine: Engine, optimizer: torch.optim.Optimizer) -> None:
        self.engine, self.optimizer = engine, optimizer

    def state_dict(self) -> dict:
        names = {id(p): n for n, p in self.engine.named_parameters_for_state().items()}
        out = {}
        for p, slots in self.optimizer.state.items():
            name = names[id(p)]
            for k, v in slots.items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    v = self.engine.distributed(name, v)
                out[f"{name}.{k}"] = v
        return out

    def load_state_dict(self, state: dict) -> None:
        pass

    def make_room(self, keys: list[str]) -> None:
        """Create the state a checkpoint has and a fresh optimizer lacks (momentum), shaped as
        this run holds its parameter, so that DCP can load into it."""
        params = self.engine.named_parameters_for_state()
        for key in keys:
            name, _, slot = key.rpartition(".")
            p = params.get(name)
            if p is None:
                raise ConfigError(
                    f"the checkpoint has optimizer state for {name!r}, which this model lacks"
                )
            self.optimizer.state[p].setdefault(slot, torch.zeros_like(p))


class _Rank:  # a DCP Stateful (a protocol: state_dict and load_state_dict)
    """This rank's random-generator states, codec error-feedback residuals and batch-norm
    statistics."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stored: set[str] | None = None
        """loading: the keys the checkpoint has (one written before the statistics were kept
        per rank has none of them); None: saving, everything"""

    def states(self) -> dict[int, object]:
        return {id(st): st for st in self.engine.reducer_states().values()}

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Batch norms' running statistics: under local (or adaptive, before its switch) BN each
        rank's differ, while the `model` part keeps one rank's copy of a replicated tensor."""
        return {
            k: b
            for n, m in self.engine.module.named_modules()
            if isinstance(m, _BatchNorm)
            for k, b in m.named_buffers(prefix=n, recurse=False)
        }

    def state_dict(self) -> dict:
        out = {"rng": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["rng_cuda"] = torch.cuda.get_rng_state()
        for name, b in self._buffers().items():
            if self.stored is None or f"buffer.{name}" in self.stored:
                out[f"buffer.{name}"] = b.detach().clone()
        for st in self.states().values():
            for key, res in getattr(st, "residuals", {}).items():  # the host reducer keeps none
                for j, t in enumerate(res):
                    out[f"residual.{key}.{j}"] = t
        return out

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])
        if "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"])
        with torch.no_grad():  # after the model part: this rank's own statistics win
            for name, b in self._buffers().items():
                if f"buffer.{name}" in state:
                    b.copy_(state[f"buffer.{name}"])

    def make_room(self, key: str, size: tuple[int, ...]) -> None:
        """A residual slot the checkpoint has (bucket.j), so that it can be loaded in place."""
        bucket, j = (int(x) for x in key.split("."))
        states = self.engine.reducer_states()
        st = states.get(bucket % PIECE_STRIDE, states.get(-1))  # a split bucket's pieces too
        slot = st.residuals.setdefault(bucket, [None, None])
        slot[j] = torch.zeros(size)


def _stateful(engine: Engine, optimizer, per_rank: bool) -> dict:
    out = {"model": _Model(engine), "optim": _Optimizer(engine, optimizer)}
    if per_rank:
        out[f"rank{dist.get_rank()}"] = _Rank(engine)
    return out


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
        raise ConfigError(
            f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}); "
            "give a folder written by --checkpoint-dir"
        ) from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{str(path)!r} is not a hybridpar checkpoint ({meta.get('format')!r})")
    return meta


def _switch_state(engine: Engine) -> dict | None:
    """The adaptive BN's state with its window accumulators summed over the ranks (one small
    all-reduce): stored once, carried on by one rank after a resume, on any P."""
    if engine.bn_switch is None:
        return None
    state = engine.bn_switch.state()
    t = torch.tensor(state["acc"][:2], dtype=torch.float64, device=_device(engine))
    all_reduce(t, Via(engine.world, term=Term.STATE))
    state["acc"] = [*t.tolist(), state["acc"][2]]
    return state


def _device(engine: Engine) -> torch.device:
    p = next(engine.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def save(
    engine: Engine,
    optimizer: torch.optim.Optimizer,
    directory: str | Path,
    meta: dict | None = None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint collectively (every rank calls it); returns its folder. `meta`: the
    caller's JSON-serialisable metadata, stored next to the step, the plan and P."""
    clash = sorted(set(meta or {}) & set(RESERVED))
    if clash:
        raise ValueError(f"checkpoint metadata keys {clash} are reserved")
    d = Path(directory)
    name = f"step-{engine.step:08d}"
    tmp = d / f".tmp-{name}"
    rank = dist.get_rank()
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob(".tmp-step-*"):  # a write that was killed
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    switch = _switch_state(engine)
    faults.set_step(engine.step)
    faults.at("checkpoint")  # as the write starts: the others write shards, this one never will
    import torch.distributed.checkpoint as dcp  # here: a rank that never saves never pays it

    dcp.save(_stateful(engine, optimizer, per_rank=True), checkpoint_id=str(tmp))
    if rank == 0:
        record = {
            "format": FORMAT,
            "procs": dist.get_world_size(),
            "step": engine.step,
            "plan": engine.plan.to_dict(),
            "bn_switch": switch,
            "order": engine.order,  # ranks dealt to hosts otherwise: the positions they held
            **(meta or {}),
        }
        (tmp / META).write_text(json.dumps(record, indent=1, allow_nan=False))
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


def load(engine: Engine, optimizer: torch.optim.Optimizer, path: str | Path) -> tuple[dict, bool]:
    """Load a checkpoint into the running engine and optimizer (collective). Returns its metadata
    and whether it was written by the same plan on the same P (then the per-rank state, random
    streams and codec residuals, came back too, and training goes on bit for bit)."""
    import torch.distributed.checkpoint as dcp  # here: a rank that never loads never pays it

    path = Path(latest(path) or path)
    meta = read_meta(path)
    styles = {k: v.label for k, v in engine.plan.styles.items()}
    same = (
        meta["procs"] == dist.get_world_size()
        and meta["plan"]["styles"] == styles
        and meta["plan"].get("placement") == (list(engine.plan.placement or []) or None)
        and meta.get("order") == engine.order
    )
    state = _stateful(engine, optimizer, per_rank=same)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state["optim"].make_room([k[len("optim.") :] for k in stored if k.startswith("optim.")])
    mine = f"rank{dist.get_rank()}.residual."
    for key, info in stored.items():
        if same and key.startswith(mine):
            state[f"rank{dist.get_rank()}"].make_room(key[len(mine) :], tuple(info.size))
    if same:
        own = f"rank{dist.get_rank()}."
        state[own[:-1]].stored = {k[len(own) :] for k in stored if k.startswith(own)}
    dcp.load(state, checkpoint_id=str(path))
    switch = meta.get("bn_switch")
    if switch and dist.get_rank() != 0:  # the accumulators are global: one rank carries them on
        switch["acc"] = [0.0, 0.0, switch["acc"][2]]
    if engine.bn_switch is not None and switch:
        engine.bn_switch.restore(switch)
    engine.step = int(meta.get("step", meta.get("position", {}).get("step", 0)))
    return meta, same


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """The original model's state_dict, for plain `torch.load` into the user's model (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({k: v.cpu() for k, v in state.items()}, tmp)
    tmp.replace(path)
    return path
