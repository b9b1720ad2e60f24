"""ParallelPlan: the one object the planner writes and the runtime executes. Torch-free, typed,
JSON round-trip.

A plan maps module names to *styles*, the way `torch.distributed.tensor.parallel.parallelize_module`
maps them to ParallelStyles: each entry is a fully-qualified module name or an fnmatch pattern
(`classifier.*`, `layer2.*`), and it applies to the weighted layers (Linear, Conv2d) at or inside
the modules it matches. The first entry that covers a layer wins; a layer no entry covers is
`batch`. Modules without weights (activations, pooling, batch norm, dropout) take no style: they
run in the layout of the layer they sit next to.

| style          | what the layer does on a Pr x Pc grid (P = Pr Pc)                                  |
| -------------- | ---------------------------------------------------------------------------------- |
| `batch`        | whole layer on every rank, B/P examples each (the grid 1 x P)                        |
| `model(RxC)`   | Linear: output features split over the Pr ranks of a model group; Conv2d: output   |
|                | channels split; the Pc batch groups split the examples (Gholami et al. 1.5D, Eq. 8) |
| `domain(RxC)`  | Conv2d: the image split by height over Pr, halo rows exchanged (Eqs. 7, 9); the    |
|                | pools, norms and element-wise layers of its segment run on the bands too          |
| `domain(HxWxC)`| the same on H x W tiles of 2-d images (Pr = H W): halo columns, then rows          |

`model(1xP)` is `batch`: the two spellings are one style (its kind is "batch").

Where consecutive layers have different layouts the plan lists a *redistribution* (Gholami Eq. 6
generalised; Krizhevsky's hand-off scheme (a) is the batch -> model case) at the module whose
forward pre-hook carries it. The plan also carries its `Choices` (codec, compress, reducer, bn, amp,
device: hybridpar.core.choices) and the cost model's predicted bytes and seconds per (layer, term), so
the training report can put every measurement next to its prediction. In JSON the choices are
keys of the plan object itself.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from hybridpar.core.choices import Choices
from hybridpar.core.config import read_json
from hybridpar.core.errors import ConfigError
from hybridpar.core.groups import check_placement, why_not_placement
from hybridpar.core.terms import Term

__all__ = [
    "ENGINES",
    "FORMAT",
    "KINDS",
    "ParallelPlan",
    "Prediction",
    "Redistribution",
    "Style",
    "assign_styles",
]

FORMAT = "hybridpar-plan/1"
ENGINES = ("hybridpar", "ddp")
KINDS = ("batch", "model", "domain")

_STYLE_RE = re.compile(r"(batch|model|domain)(?:\((\d+)x(\d+)(?:x(\d+))?\))?")


@dataclass(frozen=True, order=True)
class Style:
    """How one layer is split: its kind and the grid Pr x Pc it runs on. `batch` is the 1 x P
    grid: a model style with Pr = 1 is batch (one style, one spelling). A domain style's `pw`:
    its model group splits 2-d images into (Pr / pw) x pw tiles (1: bands of rows)."""

    kind: Literal["batch", "model", "domain"]
    pr: int
    pc: int
    pw: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"style kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "model" and self.pr == 1:
            object.__setattr__(self, "kind", "batch")
        if self.pw != 1 and (self.kind != "domain" or self.pw < 1 or self.pr % self.pw):
            raise ConfigError(
                f"{self.kind} style with {self.pw} tile columns: only domain styles tile, "
                f"with Pr={self.pr} a multiple of them"
            )

    @staticmethod
    def batch(p: int) -> Style:
        return Style("batch", 1, p)

    @staticmethod
    def model(pr: int, pc: int) -> Style:
        return Style("model", pr, pc)

    @staticmethod
    def domain(pr: int, pc: int, pw: int = 1) -> Style:
        return Style("domain", pr, pc, pw)

    @staticmethod
    def tiles(pr: int, pc: int) -> Style | None:
        """The squarest tiling of a model group of Pr ranks (H x W tiles, H >= W > 1: 2 x 2 of
        4, 4 x 4 of 16, 4 x 2 of 8), the one the planner offers; None where Pr is prime."""
        pw = max((d for d in range(2, math.isqrt(pr) + 1) if pr % d == 0), default=0)
        return Style.domain(pr, pc, pw) if pw else None

    @property
    def ph(self) -> int:
        """Tile rows of a domain style (Pr: bands)."""
        return self.pr // self.pw

    @property
    def is_batch(self) -> bool:
        return self.kind == "batch"

    @property
    def procs(self) -> int:
        return self.pr * self.pc

    @property
    def label(self) -> str:
        if self.pw > 1:
            return f"{self.kind}({self.ph}x{self.pw}x{self.pc})"
        return "batch" if self.is_batch else f"{self.kind}({self.pr}x{self.pc})"

    def __str__(self) -> str:
        return self.label

    @property
    def layout(self) -> tuple:
        """How the layer's output activations lie on the ranks: ("rep", pc) = split over pc batch
        groups and replicated within each model group; ("dom", pr, pc) = also split by height;
        ("dom", pr, pc, pw) by height and width into tiles."""
        if self.kind != "domain" or self.pr == 1:
            return ("rep", self.pc)
        return ("dom", self.pr, self.pc) + ((self.pw,) if self.pw > 1 else ())

    @staticmethod
    def parse(text: str, procs: int) -> Style:
        """'batch', 'model(2x2)', 'domain(4x1)' or 'domain(2x2x1)' (tiles) for a job of `procs`
        ranks."""
        m = _STYLE_RE.fullmatch(str(text).strip())
        if not m:
            raise ConfigError(
                f"style {text!r} is not one of batch, model(RxC), domain(RxC), domain(HxWxC), "
                "e.g. model(2x2)"
            )
        kind, pr, pc, tiled = m.group(1), m.group(2), m.group(3), m.group(4)
        if tiled is not None:
            if kind != "domain":
                raise ConfigError(f"style {text!r}: only domain takes tiles, e.g. domain(2x2x1)")
            pr, pc, pw = int(pr) * int(pc), int(tiled), int(pc)
            if pr * pc != procs:
                raise ConfigError(
                    f"style {text!r} has {pr * pc} ranks but the plan is for P={procs}; "
                    f"use H x W x C = {procs}"
                )
            return Style.domain(pr, pc, pw)
        if kind == "batch":
            if pr is not None and int(pr) != 1:
                raise ConfigError(f"style {text!r}: batch is 1x{procs}; write batch")
            return Style.batch(procs)
        if pr is None:
            raise ConfigError(f"style {text!r} needs its grid, e.g. {kind}(2x{max(1, procs // 2)})")
        s = Style(kind, int(pr), int(pc))  # type: ignore[arg-type]
        if s.pr < 1 or s.pc < 1 or s.pr * s.pc != procs:
            raise ConfigError(
                f"style {text!r} has {s.pr * s.pc} ranks but the plan is for P={procs}; "
                f"use R x C = {procs}"
            )
        return s


@dataclass(frozen=True)
class Redistribution:
    """A layout change in front of `layer`, carried by the forward pre-hook of module `at` (its
    input is the only activation alive at that point of the forward, so changing it there changes
    it for every path that uses it, residual shortcuts included)."""

    at: str
    layer: str
    src: Style
    dst: Style
    elements: int  # per example, of the activation redistributed
    scheme: str = "a"  # Krizhevsky's hand-off scheme (core/handoff.py): a, b or c
    rounds: int = 1  # how many rounds (b) and (c) send it in

    def to_dict(self) -> dict:
        return {
            "at": self.at,
            "layer": self.layer,
            "from": self.src.label,
            "to": self.dst.label,
            "elements": self.elements,
            "scheme": self.scheme,
            "rounds": self.rounds,
        }


@dataclass(frozen=True)
class Prediction:
    """The cost model's bytes sent per rank per iteration and seconds, for one (layer, term), and
    its blocking calls per iteration (planning.cost.sync.calls; 0 for a term that does not block)."""

    layer: str
    term: str
    bytes: float
    seconds: float
    calls: int = 0


_CHOICES = tuple(f.name for f in fields(Choices))


@dataclass
class ParallelPlan:
    procs: int
    """P, the number of ranks the plan is for"""
    batch: int
    """global mini-batch B the predictions are for"""
    styles: dict[str, Style] = field(default_factory=dict)
    """module name or fnmatch pattern -> style, in order; the first entry covering a layer wins"""
    model: str = ""
    """what was planned (a zoo name or a class name): informative"""
    input_shape: tuple[int, ...] | None = None
    """per-example input shape the layouts were traced with, e.g. (3, 64, 64)"""
    scenario: str = "custom"
    engine: Literal["hybridpar", "ddp"] = "hybridpar"
    """hybridpar's runtime, or torch DistributedDataParallel (every layer batch: the baseline)"""
    choices: Choices = field(default_factory=Choices)
    """codec, compress, reducer, bn, amp, device (hybridpar.core.choices)"""
    redistributions: list[Redistribution] = field(default_factory=list)
    predicted: list[Prediction] = field(default_factory=list)
    cluster: str = ""
    """the cluster the predicted seconds are for"""
    totals: dict[str, float] = field(default_factory=dict)
    """predicted comm_s, compute_s and total_s per iteration"""
    placement: tuple[int, int] | None = None
    """grid (Pr, Pc) whose batch groups sit on consecutive ranks (hybridpar.core.groups);
    None: rank = position, model groups on consecutive ranks"""
    memory_bytes: float | None = None
    """the busiest rank's predicted peak in a step: parameters, gradients, momentum and what
    autograd keeps for backward (planning.cost.memory.kept), and the gradients in flight at the
    worst layer's backward; of a plan for inference the weights and the activations alive at
    the worst point of the forward (cost.memory.at_worst); None where not predicted"""
    held_bytes: float | None = None
    """of `memory_bytes`, what a rank holds throughout a step (states and what backward keeps:
    what `HybridTrainer.train_step(count=True)` counts)"""

    def __post_init__(self) -> None:
        for name in ("procs", "batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"plan: {name} must be a positive integer, got {v!r}")
        if self.engine not in ENGINES:
            raise ConfigError(
                f"plan: engine must be one of {', '.join(ENGINES)}, got {self.engine!r}"
            )
        if not isinstance(self.choices, Choices):
            raise ConfigError("plan: choices must be a hybridpar.core.choices.Choices")
        for pattern, s in self.styles.items():
            if not isinstance(s, Style) or s.pr * s.pc != self.procs:
                raise ConfigError(f"plan entry {pattern!r}: style {s} does not fit P={self.procs}")
        if self.engine == "ddp" and any(not s.is_batch for s in self.styles.values()):
            raise ConfigError("plan: engine ddp runs batch parallelism only; drop the other styles")
        if self.placement is not None:
            self.placement = tuple(self.placement)  # type: ignore[assignment]
            if self.engine == "ddp":
                raise ConfigError("plan: engine ddp places ranks as torch does; drop placement")
        why = check_placement(self.placement, self.procs) or why_not_placement(
            self.placement, [(s.pr, s.pc) for s in self.styles.values()]
        )
        if why:
            raise ConfigError(f"plan: {why}")

    # --- what the runtime and the report ask ---------------------------------------------------

    def predicted_bytes(self, by_layer: bool = False) -> dict:
        """Bytes per rank per iteration by term, or by (layer, term)."""
        out: dict = {}
        for p in self.predicted:
            if p.bytes:
                key = (p.layer, p.term) if by_layer else p.term
                out[key] = out.get(key, 0.0) + p.bytes
        return out

    def with_choices(self, **changes: Any) -> ParallelPlan:
        """The same plan with some choices changed (e.g. device="cuda")."""
        return replace(self, choices=self.choices.with_(**changes))

    # --- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "input_shape": list(self.input_shape) if self.input_shape else None,
            "procs": self.procs,
            "batch": self.batch,
            "scenario": self.scenario,
            "engine": self.engine,
            "styles": {k: v.label for k, v in self.styles.items()},
            **self.choices.to_dict(),
            "redistributions": [r.to_dict() for r in self.redistributions],
            "cluster": self.cluster,
            "totals": self.totals,
            **({"placement": list(self.placement)} if self.placement else {}),
            **({"memory_bytes": self.memory_bytes} if self.memory_bytes is not None else {}),
            **({"held_bytes": self.held_bytes} if self.held_bytes is not None else {}),
            "predicted": [
                {"layer": p.layer, "term": p.term, "bytes": p.bytes, "seconds": p.seconds}
                | ({"calls": p.calls} if p.calls else {})
                for p in self.predicted
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(d: Any, origin: str = "plan") -> ParallelPlan:
        if not isinstance(d, dict):
            raise ConfigError(
                f"{origin}: a plan is a JSON object; write one with `hybridpar plan --out`"
            )
        if d.get("format") != FORMAT:
            raise ConfigError(
                f"{origin}: not a hybridpar plan (format {d.get('format')!r}, expected {FORMAT!r}); "
                "write one with `hybridpar plan ... --out FILE`"
            )
        known = (set(ParallelPlan.__dataclass_fields__) - {"choices"}) | {"format", *_CHOICES}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{origin}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        procs = d.get("procs")
        if not isinstance(procs, int) or procs < 1:
            raise ConfigError(f"{origin}: procs must be a positive integer, got {procs!r}")
        styles = d.get("styles", {})
        if not isinstance(styles, dict):
            raise ConfigError(f'{origin}: styles must map module names to styles like "model(2x2)"')
        try:
            return ParallelPlan(
                procs=procs,
                batch=d.get("batch"),
                styles={str(k): Style.parse(v, procs) for k, v in styles.items()},
                model=str(d.get("model", "")),
                input_shape=_shape(d.get("input_shape"), origin),
                scenario=str(d.get("scenario", "custom")),
                engine=d.get("engine", "hybridpar"),
                choices=Choices.from_dict(d),
                redistributions=[_redistribution(r, procs) for r in d.get("redistributions", [])],
                predicted=[_prediction(p) for p in d.get("predicted", [])],
                cluster=str(d.get("cluster", "")),
                totals={str(k): float(v) for k, v in d.get("totals", {}).items()},
                placement=_placement(d.get("placement")),
                memory_bytes=float(d["memory_bytes"]) if "memory_bytes" in d else None,
                held_bytes=float(d["held_bytes"]) if "held_bytes" in d else None,
            )
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {str(exc).replace('--', '')}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"{origin}: malformed plan ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def load(path: str | Path) -> ParallelPlan:
        data = read_json(path, "plan file", "write one with `hybridpar plan ... --out`")
        return ParallelPlan.from_dict(data, f"plan file {str(path)!r}")

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json())
        return p

    def describe(self) -> str:
        """The plan as a table: one row per layer with its style and predicted bytes per term."""
        terms = [
            t.value for t in Term if any(p.term == t.value and p.bytes for p in self.predicted)
        ]
        per: dict[str, dict[str, Prediction]] = {}
        for p in self.predicted:
            per.setdefault(p.layer, {})[p.term] = p
        named = dict(self.styles)
        width = max([len(k) for k in [*per, *named]] + [5])
        wide = {t: max(14, len(str(t)) + 2) for t in terms}
        head = f"{'layer':<{width}}  {'style':<12}" + "".join(f"{t:>{wide[t]}}" for t in terms)
        c = self.choices
        lines = [
            f"plan {self.scenario} for {self.model or 'a model'}: P={self.procs}, B={self.batch}, "
            f"engine {self.engine}, bn {c.bn}, codec {c.codec}"
            + (f" on {'+'.join(c.compress)}" if c.codec != "none" else "")
            + f", reducer {c.reducer}"
            + (", states sharded" if c.shard_states else "")
            + (
                f", recomputed {','.join(c.activation_checkpointing)}"
                if c.activation_checkpointing
                else ""
            )
            + "; predicted KB per rank per iteration"
            + (f" on {self.cluster}" if self.cluster else ""),
            head,
        ]
        for layer in dict.fromkeys([*named, *per]):
            style = named.get(layer)
            row = per.get(layer, {})
            cells = "".join(
                f"{row[t].bytes / 1e3:{wide[t]}.1f}" if t in row and row[t].bytes else " " * wide[t]
                for t in terms
            )
            lines.append(f"{layer:<{width}}  {style.label if style else '':<12}{cells}")
        for r in self.redistributions:
            how = f", scheme ({r.scheme}) in {r.rounds} rounds" if r.scheme != "a" else ""
            lines.append(
                f"redistribute before {r.layer} (at {r.at or '<input>'}): {r.src} -> {r.dst}{how}"
            )
        if self.totals:
            lines.append(
                "predicted per iteration: "
                + ", ".join(
                    f"{k} {v * 1e3:.3f} ms" for k, v in self.totals.items() if math.isfinite(v)
                )
            )
        return "\n".join(lines)


def _placement(v: Any) -> tuple[int, int] | None:
    """A plan file's placement: [Pr, Pc] or absent (checked by ParallelPlan itself)."""
    if v is None:
        return None
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ConfigError(f"placement must be [Pr, Pc], got {v!r}")
    return (v[0], v[1])


def _shape(v: Any, origin: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and x > 0 for x in v):
        raise ConfigError(
            f"{origin}: input_shape must be a list of positive sizes, e.g. [3, 64, 64]"
        )
    return tuple(v)


def _redistribution(r: dict, procs: int) -> Redistribution:
    return Redistribution(
        str(r["at"]),
        str(r["layer"]),
        Style.parse(r["from"], procs),
        Style.parse(r["to"], procs),
        int(r["elements"]),
        str(r.get("scheme", "a")),
        _rounds(r.get("rounds", 1)),
    )


def _rounds(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"a redistribution's rounds must be a positive integer, got {v!r}")
    return v


def _prediction(p: dict) -> Prediction:
    layer, term, n, s = str(p["layer"]), str(p["term"]), float(p["bytes"]), float(p["seconds"])
    return Prediction(layer, term, n, s, int(p.get("calls", 0)))


def assign_styles(
    styles: dict[str, Style], modules: list[str], layers: list[str], procs: int
) -> dict[str, Style]:
    """The style of every weighted layer in `layers` (module names): the first entry of `styles`
    whose pattern matches the layer or a module containing it; `batch` when none does.

    An entry that covers no weighted layer is a mistake (a typo, a plan for another model) and
    raises a one-line ConfigError naming it."""
    known = set(modules)
    out: dict[str, Style] = {}
    for pattern, style in styles.items():
        matched = [m for m in modules if fnmatchcase(m, pattern)]
        if not matched:
            close = sorted(m for m in known if m and m.split(".")[0] == pattern.split(".")[0])[:4]
            hint = f" (modules there: {', '.join(close)})" if close else ""
            raise ConfigError(f"plan entry {pattern!r} names no module of the model{hint}")
        covered = [
            x for x in layers if any(x == m or m == "" or x.startswith(m + ".") for m in matched)
        ]
        if not covered:
            raise ConfigError(
                f"plan entry {pattern!r} matches {', '.join(matched[:3])}, which has no Linear or "
                "Conv2d layer: only layers with weights take a style (the others follow them)"
            )
        for x in covered:
            out.setdefault(x, style)
    return {x: out.get(x, Style.batch(procs)) for x in layers}
