"""Whether a layer can take a style, and whether a plan's choices can run with its styles: the one
decision the planner and the runtime both call (plan = run). Torch-free: it reads the layer's
description (hybridpar.core.layers.CostLayer), never the module, so `hybridpar plan` asks the
same question `parallelize` asks and gets the same answer, in the same words.

Each style kind states what it needs of a layer:

| kind     | needs                                                                          |
| -------- | ------------------------------------------------------------------------------ |
| `batch`  | Pc <= B (every batch group gets an example); any layer                          |
| `model`  | a Linear or a Conv2d (any padding mode), called once per forward, with at least |
|          | Pr output units; a grouped Conv2d's split must keep every group whole; a        |
|          | subclass's forward row by row in its parameters (core.ops.why_not_split)        |
| `domain` | a 2-d (transposed) convolution with zero padding, and a segment of operations  |
|          | that keep rows apart (rows.py), each activation in it at least Pr rows high;   |
|          | on H x W tiles 2-d images that keep columns apart too, H rows and W columns    |

Every style swaps a layer's own operation on its input, never the layer (core.ops): a layer
whose forward does not apply it to its input once takes no style that swaps it (model, domain;
global batch norm for a batch norm). Where the batch groups change between two segments, the
forward must not carry a batch size read before that point past it (`why_not_move`).

A new style adds its rule here, its runtime in hybridpar/runtime/parallel/ and its cost terms in
hybridpar/planning/cost/ (docs/runtime.md, "How to add a style").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hybridpar.core.choices import Choices
from hybridpar.core.halo import TILED
from hybridpar.core.layers import CostLayer
from hybridpar.core.operations import by_name
from hybridpar.core.plan import Style
from hybridpar.core.splits import chunk_sizes, group_split, whole_group_prs

__all__ = ["EXECUTED", "RULES", "why_not", "why_not_choices", "why_not_grid", "why_not_move"]


def _batch(layer: CostLayer, s: Style) -> str:
    return ""


def _takes(layer: CostLayer, kind: str) -> bool:
    """Whether the layer's operation takes the style `kind` (core.operations)."""
    return kind in getattr(by_name(layer.op), "styles", ())


def _model(layer: CostLayer, s: Style) -> str:
    if not _takes(layer, "model"):
        return (
            f"{layer.name} ({layer.op or layer.kind}) cannot take {s}: only Linear and 2-d and "
            "3-d convolutions (transposed too) split over a model group; give it batch"
        )
    if layer.op.startswith("conv_transpose") and layer.groups > 1 and s.pr > 1:
        return (
            f"{layer.name}: a transposed convolution of {layer.groups} groups does not split over "
            "a model group (groups=1 does); give it batch"
        )
    if s.pr > layer.out_units:
        what = "output features" if layer.op == "linear" else "output channels"
        return f"{layer.name} has {layer.out_units} {what}, fewer than Pr={s.pr}; use a smaller Pr"
    if layer.kind == "conv" and not group_split(layer.out_units, layer.groups, s.pr):
        per = layer.out_units // layer.groups
        ok = whole_group_prs(layer.out_units, layer.groups, s.pr) or [1]
        return (
            f"{layer.name}: {s} would cut one of its {layer.groups} groups of {per} output "
            f"channels (torch.chunk splits {layer.out_units} as "
            f"{chunk_sizes(layer.out_units, s.pr)}); use Pr in {ok} or give it batch"
        )
    if layer.calls != 1:
        return (
            f"{layer.name} is called {layer.calls} times per forward; only a layer called once "
            f"can take {s}"
        )
    if layer.unsplit:
        return f"{layer.name} cannot take {s}: {layer.unsplit}; give it batch"
    return ""


def _domain(layer: CostLayer, s: Style) -> str:
    whole = layer.name in layer.unchanged  # a pooled value's, or over a band's channels
    if not whole and (not _takes(layer, "domain") or len(layer.x_shape) not in (3, 4)):
        return (
            f"{layer.name} ({layer.op or layer.kind}) cannot be split by height: only 2-d and "
            "3-d convolutions and transposed convolutions take domain; give it batch or model"
        )
    if layer.padding_mode not in ("zeros", "circular"):
        return (
            f"{layer.name} pads with {layer.padding_mode!r}: only zero-padded and circular "
            "convolutions are split by height; give it batch or model"
        )
    if layer.own:
        first = layer.own[0]
        return f"{layer.name} cannot take {s}: {first.member}: {first.why}; give it batch or model"
    blockers = [b for b in layer.blockers if s.pw > 1 or not b.startswith(TILED)]
    if blockers:
        bands = " or bands of rows (domain(RxC))" if blockers[0].startswith(TILED) else ""
        return (
            f"{layer.name} cannot take {s}: its segment needs whole images "
            f"({blockers[0].removeprefix(TILED)}); give it batch or model{bands}"
        )
    if s.pw > 1 and len(layer.x_shape) == 4 and layer.pools:
        return (
            f"{layer.name}: {s}: {layer.pools[0].member} pools a volume globally, which tiles "
            "of depth x height do not sum; split it by depth (domain(RxC))"
        )
    if s.pw > 1 and len(layer.cols) != len(layer.windows):  # a layer described by hand
        return f"{layer.name}: {s}: its column maps are not described; give it bands (domain(RxC))"
    along = ((1, layer.windows, s.ph, "rows", "high"), (2, layer.cols, s.pw, "columns", "wide"))
    for axis, maps, parts, what, size in along:
        if parts == 1:
            continue
        sizes = [] if whole else [layer.x_shape[axis], layer.y_shape[axis]]
        sizes += [w.size_out for w in maps] + [w.size_in for w in maps if not w.whole_in]
        least = min(sizes or [parts])  # a layer on a whole value alone: nothing to split
        who = "Pr" if s.pw == 1 else "H" if axis == 1 else "W"
        if parts > least:
            return (
                f"{layer.name}: {s} splits {least} {what} over {who}={parts} ranks; the largest "
                f"{who} that works is {least}, or give images about {-(-parts // least)}x as {size}"
            )
    return ""


RULES: dict[str, Callable[[CostLayer, Style], str]] = {
    "batch": _batch,
    "model": _model,
    "domain": _domain,
}
"""style kind -> what it needs of a layer ("" when it can take the style)"""

EXECUTED = frozenset({"batch", "model", "domain"})
"""the kinds the runtime executes (runtime/parallel/kinds.py lists their classes)"""


def why_not_grid(pr: int, pc: int, procs: int, batch: int) -> str:
    """Why a Pr x Pc grid cannot run a job of `procs` ranks on `batch` examples; "" when it can
    (any batch of at least Pc examples: the batch groups may differ by one block, core.splits)."""
    if pr * pc != procs:
        return f"grid {pr}x{pc} has {pr * pc} ranks but the job has {procs}; use Pr*Pc = {procs}"
    if pc > batch:
        return (
            f"grid {pr}x{pc} needs at least Pc={pc} examples (one per batch group), got B={batch}; "
            "change --batch or --procs"
        )
    return ""


def why_not(layer: CostLayer, s: Style, batch: int) -> str:
    """Why `layer` cannot take style `s` in a global batch of `batch` examples; "" when it can."""
    if s.pc > batch:
        return f"{layer.name}: {s} needs at least Pc={s.pc} examples per batch, got {batch}"
    if s.kind not in EXECUTED:
        return f"{layer.name}: style {s.kind} is not executed by the runtime; give it batch"
    return RULES[s.kind](layer, s)


def why_not_choices(
    choices: Choices, styles: Iterable[Style], layers: Iterable[CostLayer] = (), whole=False
) -> str:
    """Why a plan with these styles (of these layers; `whole`: all of them) cannot run with
    these choices; "" when it can."""
    styles = list(styles)
    if whole and choices.shard_states and not any(s.kind == "domain" for s in styles):
        return "--shard-states shards the layers split by height: this plan splits none (domain)"
    if choices.activations_encoded and any(s.layout[0] == "dom" for s in styles):
        return (
            "the domain style's halo rows and row moves travel unencoded: compress grads only "
            "(--compress grads) or give the convolutions batch or model"
        )
    if choices.shard_states:
        why = _why_not_sharded(styles, list(layers))
        if why:
            return why
    if choices.bn != "local":
        norm = next((o for x in layers for o in x.own if o.op == "batch_norm"), None)
        if norm is not None:
            return (
                f"{norm.member}: {norm.why}, so its statistics cannot be taken over ranks "
                f"(--bn {choices.bn}); use --bn local or make it call F.batch_norm on its input"
            )
    return ""


def _why_not_sharded(styles: list[Style], layers: list[CostLayer]) -> str:
    """Why sharded states (runtime.parallel.sharded) cannot run with these styles; "" if they can:
    they shard each module's own parameters."""
    for x, s in zip(layers, styles, strict=False):
        if s.kind == "domain" and "(tied)" in x.unsplit:
            return (
                f"{x.name}: {x.unsplit.partition(':')[0]}; sharded states shard each module's own "
                "parameters: drop --shard-states"
            )
    return ""


def why_not_move(layer: CostLayer, prev: Style, s: Style) -> str:
    """Why the layout may not change from `prev` to `s` where `layer`'s segment starts; "" when
    it may. A forward that reads the batch size before this point and uses it after it needs
    every rank to hold as many examples after it as before: the same batch groups."""
    if layer.pinned and prev.pc != s.pc:
        return (
            f"{layer.name}: {layer.pinned}, so the batch groups may not change there ({prev} -> "
            f"{s}); give it Pc={prev.pc} or re-plan"
        )
    return ""
