"""The choices a plan makes besides its styles, in one torch-free dataclass that the plan, the
planner, `export`, the presets and both command-line configs share, with one default each.

| choice     | values                                                         | default             |
| ---------- | -------------------------------------------------------------- | ------------------- |
| `codec`    | none, fp16, bf16 and Dettmers' four 8-bit types                | none                |
| `compress` | the traffic the codec encodes: grads and/or activations        | grads,activations   |
| `reducer`  | process-group (torch.distributed), host (Sekiyama et al.)      | process-group       |
| `bn`       | local, global (Liu et al.), adaptive (local, then global)      | global              |
| `amp`      | none, bf16 autocast (activations travel as bf16)               | none                |
| `device`   | auto (cuda where every local rank has a GPU), cpu, cuda        | auto                |
| `backend`  | auto (nccl with a GPU per rank, else gloo), gloo, nccl         | auto                |
| `shard_states` | the domain segments' parameters, gradients and optimizer state sharded (FSDP2) | off |
| `activation_checkpointing` | module globs or Sequential segments `A..B` recomputed in backward | none |

`bn` defaults to global because it is the one that keeps DESIGN.md invariant 1: batch norm over
the global batch normalises exactly as one process does, whatever P and the grid.

The codecs themselves (hybridpar.runtime.comm.codecs) encode a tensor into a payload of
`payload_bytes` per element plus, for the 8-bit types, one float32 scale (the absolute maximum)
per block; the names and sizes are here, where the cost model can read them without torch.
"""

from __future__ import annotations

import fnmatch
import typing
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from hybridpar.core.config import check_fields, meta
from hybridpar.core.errors import ConfigError

__all__ = [
    "CODECS",
    "COMPRESSIBLE",
    "DEFAULT_BLOCK",
    "EIGHT_BIT",
    "Choices",
    "check_codec",
    "covered",
    "parse_compress",
    "parse_patterns",
    "payload_bytes",
]

Codec = Literal["none", "fp16", "bf16", "dynamic-tree", "linear", "mantissa", "static-tree"]
BN = Literal["local", "global", "adaptive"]
Reducer = Literal["process-group", "host"]
Amp = Literal["none", "bf16"]
Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["auto", "gloo", "nccl"]

CODECS: tuple[str, ...] = typing.get_args(Codec)
EIGHT_BIT = CODECS[3:]
DEFAULT_BLOCK = 4096
COMPRESSIBLE = ("activations", "grads")


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise ConfigError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}")
    return name


def payload_bytes(name: str) -> int:
    """Bytes per element of the codec's payload (the 8-bit types' scales come on top)."""
    check_codec(name)
    return 4 if name == "none" else 2 if name in ("fp16", "bf16") else 1


def parse_compress(text: str | typing.Iterable[str]) -> tuple[str, ...]:
    """'grads,activations' (or an iterable of the words) -> the sorted traffic the codec applies
    to; one spelling everywhere."""
    words = text.split(",") if isinstance(text, str) else list(text)
    parts = {str(p).strip() for p in words if str(p).strip()}
    bad = sorted(parts - set(COMPRESSIBLE))
    if bad:
        raise ConfigError(f"--compress takes {' and/or '.join(COMPRESSIBLE)}, got {', '.join(bad)}")
    return tuple(sorted(parts))


def parse_patterns(text: str | typing.Iterable[str]) -> tuple[str, ...]:
    """'features,layer*' (or an iterable of the patterns) -> the patterns, in order."""
    words = text.split(",") if isinstance(text, str) else list(text)
    return tuple(w.strip() for w in map(str, words) if w.strip())


def covered(leaves: list[str], patterns: tuple[str, ...]) -> set[str]:
    """The leaf modules (`leaves`: their names, in the order the forward runs them) inside what
    `patterns` checkpoint: a leaf whose name, or an ancestor's, matches a glob, or a leaf under
    the children A to B of a segment `A..B` (those children in the order their leaves run).
    The planner prices these; the runtime (runtime.parallel.compute.matching) recomputes the same
    on the module tree."""
    out = set()
    for leaf in leaves:
        parts = leaf.split(".")
        paths = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(p, pat) for p in paths for pat in patterns if ".." not in pat):
            out.add(leaf)
    for pat in (p for p in patterns if ".." in p):
        a, _, b = pat.partition("..")
        parent = a.rpartition(".")[0]
        depth = a.count(".") + 1
        kids: list[str] = []
        for leaf in leaves:  # the parent's children, in the order their leaves run
            kid = ".".join(leaf.split(".")[:depth])
            if (parent == "" or leaf.startswith(parent + ".")) and kid not in kids:
                kids.append(kid)
        if a in kids and b in kids:  # (B before A: nothing; the runtime refuses it)
            run = set(kids[kids.index(a) : kids.index(b) + 1])
            out |= {x for x in leaves if ".".join(x.split(".")[:depth]) in run}
    if patterns and not out:
        raise ConfigError(
            f"--activation-checkpointing {','.join(patterns)} matches none of the model's "
            f"layers; e.g. {', '.join(leaves[:4])}"
        )
    return out


@dataclass(frozen=True)
class Choices:
    """How bytes travel and how sums are taken, for a whole plan."""

    codec: Codec = meta(
        "none", "wire encoding of the traffic named by --compress (8-bit types: 1 byte/element)"
    )
    compress: tuple[str, ...] = meta(
        COMPRESSIBLE,
        "what the codec applies to: grads, activations or both (comma-separated)",
        show="grads,activations",
    )
    reducer: Reducer = meta(
        "process-group",
        "gradient sums: torch.distributed all-reduce, or host shared memory (Sekiyama et al.)",
    )
    bn: BN = meta(
        "global",
        "batch-norm statistics: per rank (local), over the whole batch (global), "
        "or local until training converges, then global (adaptive, Liu et al. 4.3)",
    )
    amp: Amp = meta("none", "mixed precision: bf16 autocast of the forward pass")
    device: Device = meta(
        "auto",
        "where each rank computes: cuda (one GPU per rank, NCCL), cpu (gloo), or auto "
        "(cuda where there is a GPU for every local rank)",
    )
    backend: Backend = meta(
        "auto",
        "torch.distributed backend: nccl (one GPU per rank), gloo (the CPU; or several ranks "
        "sharing a GPU, staged through pinned host memory), auto (nccl with a GPU per rank)",
    )

    joined_loss: bool = meta(
        False,
        "the loss runs on the whole batch's outputs, joined on every rank (one that does not "
        "split over their parts: a lambda that returns a mean, a Dice of another library); the "
        "plan prices their all-gather (train sets it from --loss)",
    )

    shard_states: bool = meta(
        False,
        "shard the parameters, gradients and optimizer state of the layers split by height over "
        "their model group (torch's FSDP2): each rank keeps 1/Pr of them, all-gathered per layer",
    )

    activation_checkpointing: tuple[str, ...] = meta(
        (),
        "recompute in backward the forward of the modules whose names match these patterns "
        "(comma-separated globs, e.g. 'layer?.?', or segments A..B of a Sequential's children, "
        "e.g. 0..12): less memory, more compute",
        show="none",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress", parse_compress(self.compress))
        patterns = parse_patterns(self.activation_checkpointing)
        object.__setattr__(self, "activation_checkpointing", patterns)
        check_fields(self)

    @property
    def grads_encoded(self) -> bool:
        """Whether the gradient reductions carry the codec's payload."""
        return self.codec != "none" and "grads" in self.compress

    @property
    def activations_encoded(self) -> bool:
        """Whether activations (all-gathers, dX, redistributions) carry the codec's payload."""
        return self.codec != "none" and "activations" in self.compress

    def with_(self, **changes: Any) -> Choices:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON form: `compress` is empty when no codec encodes anything (it means nothing then)."""
        d = asdict(self)
        d["compress"] = list(self.compress) if self.codec != "none" else []
        return d

    @staticmethod
    def from_dict(d: dict, defaults: Choices | None = None) -> Choices:
        """The choices named in `d` (a plan's JSON object); the rest from `defaults`. A plan
        without a codec has no compress list: it then keeps the default."""
        base = defaults or Choices()
        given = {f.name: d[f.name] for f in fields(Choices) if f.name in d}
        if not given.get("compress"):
            given.pop("compress", None)
        return replace(base, **given)

    def differences(self, other: Choices) -> dict[str, tuple[Any, Any]]:
        """The choices that differ, as (mine, other's): by what they mean, so compress counts
        only where a codec encodes something."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}
