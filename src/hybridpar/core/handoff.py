"""Krizhevsky's hand-off schemes, and when a hand-off's backward is one reduce-scatter: the rules
the planner and the runtime both call (torch-free, like core/rules.py).

"One weird trick" (section 4) moves the last convolutional activations of K workers, each holding
its own examples, to the model-parallel layers after them in one of three ways:

| scheme | forward                                              | rounds | per round          |
| ------ | ---------------------------------------------------- | ------ | ------------------ |
| (a)    | every worker's batch to every worker at once          | 1      | one all-gather     |
| (b)    | worker j's batch to every worker in round j           | m      | one broadcast      |
| (c)    | 1/K of every worker's batch to every worker per round | K      | one all-gather     |

m is the number of ranks that gather (the batch groups of the finer layout inside one of the
coarser). In (b) and (c) the layers after the hand-off (its "head") run round by round, so round
j+1's activations travel while round j computes, and in backward round j's activation gradients
travel back while the head's backward of the next round computes.

**Whose gradient.** The head's first split layer computes a partial dX on every rank of its model
group (dX = sum over the shards of dY_shard W_shard). Today's split layer all-reduces it and the
hand-off keeps this rank's rows: 2 (m-1)/m of the bytes. Krizhevsky sends "each example's
gradient to the worker that owns it": a reduce-scatter of the partial dX over the hand-off's
group, (m-1)/m of them. That is sound when the split layer is the module the hand-off enters (no
other use of the moved activation can add a complete gradient to the partial one), the layout
before it is pure batch (the hand-off's group is then the split layer's model group), the layer
back-propagates into its input, does not split by groups (a grouped split all-gathers disjoint
slices instead), and activations travel unencoded (an encoded reduce-scatter is not built).
`fused` decides it; the cost model prices the reduce-scatter under `redistribute` and no dX
all-reduce for that layer, and the runtime books the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style
from hybridpar.core.splits import group_rows

__all__ = [
    "SCHEMES",
    "Handoff",
    "exposed",
    "fused",
    "head",
    "is_gather",
    "round_rows",
    "why_not_handoff",
    "why_not_variable_batch",
]

SCHEMES = ("a", "b", "c")


@dataclass(frozen=True)
class Handoff:
    """How a batch -> model hand-off moves its activations: the scheme and its rounds."""

    scheme: str = "a"
    rounds: int = 1

    @property
    def label(self) -> str:
        return self.scheme if self.scheme == "a" else f"{self.scheme}{self.rounds}"


def is_gather(prev: Style | None, s: Style) -> bool:
    """Whether the move from `prev` into `s` gathers examples (fewer batch groups after it)."""
    return (
        prev is not None
        and prev.layout[0] == "rep"
        and s.layout[0] == "rep"
        and s.pc < prev.pc
        and prev.pc % s.pc == 0
    )


def fused(layer: CostLayer, prev: Style | None, s: Style, acts_encoded: bool) -> bool:
    """Whether the hand-off into `layer` (the first layer of its segment, style `s`, from `prev`)
    returns the activation gradient as one reduce-scatter of the split layer's partial dX."""
    return (
        is_gather(prev, s)
        and prev is not None
        and prev.pr == 1
        and s.kind == "model"
        and s.pr > 1
        and layer.entry == layer.name
        and layer.input_grad
        and layer.groups == 1
        and layer.calls == 1
        and not acts_encoded
    )


def head(layers: Sequence[CostLayer], layouts: Sequence[tuple] | None, i: int) -> list[int]:
    """The hand-off into layer i's head as indices: the layers rounds.install runs round by round.
    That is the entry module's segment and, where the entry sits in an nn.Sequential
    (`CostLayer.head_in`), the layers of the Sequential's later children up to the first child
    that holds a later change of layout (`layouts`: each layer's; None while the later layers'
    are not chosen: the segment alone)."""
    x = layers[i]
    seg = [j for j in range(i, len(layers)) if layers[j].segment == x.segment]
    if layouts is None or x.head_in is None or x.segment is None:
        return seg if x.segment is not None else [i]
    prefix = x.head_in + "." if x.head_in else ""
    later = [
        layers[j].entry or "" for j in range(i + 1, len(layers)) if layouts[j] != layouts[j - 1]
    ]
    out = [i]
    for y in layers[i + 1 :]:
        if not y.name.startswith(prefix):
            break
        child = prefix + y.name[len(prefix) :].split(".")[0]
        if any(e == child or e.startswith(child + ".") for e in later):
            break
        out.append(i + len(out))
    return out


def exposed(g: float, r: float, f: float, b: float, rounds: int) -> float:
    """Seconds of a hand-off in `rounds` rounds that the head's compute cannot hide: the first
    round's transfer forward (g) and the last round's return backward (r) wait, and every later
    round waits for what its transfer takes beyond the head's compute of a round (f forward, b
    backward). One round (scheme (a)) hides nothing: g + r."""
    k = rounds - 1
    return g + k * max(0.0, g - f) + r + k * max(0.0, r - b)


def round_rows(rows: int, scheme: str, rounds: int, member: int) -> list[int]:
    """The rows a member of the hand-off's group (holding `rows` examples) sends in each round."""
    if scheme == "b":
        return [rows if j == member else 0 for j in range(rounds)]
    if scheme == "c":
        base, extra = divmod(rows, rounds)
        return [base + (1 if j < extra else 0) for j in range(rounds)]
    return [rows]


def why_not_handoff(
    h: Handoff,
    prev: Style | None,
    s: Style,
    head: Sequence[CostLayer],
    batch: int,
    acts_encoded: bool,
    where: str,
) -> str:
    """Why the hand-off before `where` cannot run scheme `h`; "" when it can. `head`: the layers of
    the segment it enters (they run round by round)."""
    if h.scheme not in SCHEMES:
        return f"hand-off scheme {h.scheme!r} before {where}: use one of {', '.join(SCHEMES)}"
    if h.rounds < 1:
        return f"hand-off before {where}: rounds must be at least 1, got {h.rounds}"
    if h.scheme == "a":
        return "" if h.rounds == 1 else f"scheme (a) before {where} is one round, got {h.rounds}"
    if not is_gather(prev, s):
        return (
            f"scheme ({h.scheme}) runs a batch -> model hand-off in rounds, but before {where} "
            f"the layout goes from {prev} to {s}; use --handoff a"
        )
    m = prev.pc // s.pc if prev is not None else 1
    if h.scheme == "b" and h.rounds != m:
        return (
            f"scheme (b) before {where} sends each of the {m} gathering ranks' batches in its own "
            f"round: rounds must be {m}, got {h.rounds}"
        )
    fine = min(group_rows(batch, prev.pr, prev.pc)) if prev is not None else batch
    if h.scheme == "c" and h.rounds > fine:
        return (
            f"scheme (c) before {where} splits each rank's {fine} examples into {h.rounds} "
            f"rounds; use at most {fine} rounds or a larger batch"
        )
    if acts_encoded and h.scheme == "b":
        return (
            f"scheme (b) before {where} broadcasts its rounds unencoded: use --handoff c (its "
            "all-gathers carry the codec) or compress grads only (--compress grads)"
        )
    normed = [x.name for x in head if x.norms]
    if normed:
        return (
            f"scheme ({h.scheme}) runs the layers after the hand-off before {where} round by "
            f"round, but batch norm in {normed[0]} would see one round's examples; use --handoff a"
        )
    return ""


def why_not_variable_batch(handoffs: dict[int, Handoff], segments: list[Style]) -> str:
    """Why Krizhevsky's variable batch size (section 4.2: the layers after a hand-off sent in
    rounds step after every round) cannot run; "" when it can. `handoffs`: segment -> scheme,
    `segments`: each segment's style. The rounds' layers must end the model (each round's loss is
    taken on their output) and sit on one model group (Pc = 1: every rank holds every round's
    examples, so their gradients need no sum over batch groups between rounds)."""
    rounds = [k for k, h in handoffs.items() if h.scheme in ("b", "c")]
    if not rounds:
        return (
            "--variable-batch steps the layers after a hand-off once per round: send one in "
            "rounds (--handoff b or c)"
        )
    k = max(rounds)
    if any(segments[j].layout != segments[j - 1].layout for j in range(k + 1, len(segments))):
        return (
            "--variable-batch takes each round's loss on the output of the layers after the "
            "hand-off: they must end the model (the last change of layout)"
        )
    if segments[k].pc != 1:
        return (
            f"--variable-batch needs the layers after the hand-off on one model group (grid "
            f"Px1), got {segments[k]}; use --preset owt or grid:Px1"
        )
    return ""
