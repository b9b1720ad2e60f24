"""Resolve a ParallelPlan against a model: the style of every weighted layer, the layout of every
segment, where the layout changes, and which segment each module and parameter runs in.

Needs no processes (the model is traced on the meta device), so `hybridpar train` checks a plan
against the model before it spawns anything, and hands the answer to every rank's `parallelize`
(one trace and one resolve per job). Whether a layer can take its style is
`hybridpar.core.rules.why_not`, the function the planner asks too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from hybridpar.core.analysis import Trace, trace
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import Handoff, head, is_gather, why_not_handoff
from hybridpar.core.layers import CostLayer, cost_layers
from hybridpar.core.plan import ParallelPlan, Redistribution, Style, assign_styles
from hybridpar.core.rules import why_not, why_not_choices, why_not_move

__all__ = ["Layout", "resolve", "with_handoff"]


@dataclass
class Layout:
    """A plan as it applies to one model."""

    plan: ParallelPlan
    trace: Trace
    layers: list[CostLayer]
    styles: dict[str, Style]  # weighted layer -> style
    segments: list[Style]  # segment index -> the style of its layers (its layout)
    entries: dict[int, str]  # segment index -> module whose forward pre-hook starts it ("": input)
    module_segment: dict[str, int]  # leaf module with parameters or buffers -> its segment
    param_segment: dict[str, int]  # parameter -> segment where its gradient is computed
    layer_of: dict[str, str]  # leaf module -> the cost-model layer it belongs to (ledger names)
    handoffs: dict[int, Handoff] = field(default_factory=dict)  # segment -> scheme, where not (a)

    def layer_of_param(self, name: str) -> str:
        """The cost-model layer a parameter's gradient is booked under: its module's, or for a
        parameter no layer holds (core.analysis: loose), the layer it rides with."""
        for x in self.layers:
            if name in x.loose:
                return x.name
        module = name.rpartition(".")[0]
        return self.layer_of.get(module, module)

    def hooked(self) -> set[str]:
        """The segment entries the runtime hooks: where the layout changes (the move), and with
        a style replicated over model groups every entry (hybrid.py: the same random state)."""
        if any(s.pr > 1 for s in self.segments):
            return {m for m in self.entries.values() if m}
        return {self.entries[k] for k, _, _ in self.moves() if self.entries.get(k)}

    def moves(self) -> list[tuple[int, Style, Style]]:
        """(segment, the style before it, its style) wherever the layout changes."""
        return [
            (k, self.segments[k - 1], s)
            for k, s in enumerate(self.segments)
            if k and s.layout != self.segments[k - 1].layout
        ]

    def size_before(self, seg: int) -> tuple[int, int] | None:
        """The height and width of the activation entering segment `seg`, where the segment
        before it leaves it split by height (the last window of its last layer; the width from
        its column map, 0 for a volume's); else None."""
        prev = [x for x in self.layers if x.segment == seg - 1 and x.windows]
        if not prev:
            return None
        return prev[-1].windows[-1].size_out, prev[-1].cols[-1].size_out if prev[-1].cols else 0

    def head_layers(self, seg: int) -> list[CostLayer]:
        """The layers a hand-off into segment `seg` runs in rounds (core.handoff.head)."""
        layouts = [self.styles[x.name].layout for x in self.layers]
        i = self.layers.index(self.entry_layer(seg))
        return [self.layers[j] for j in head(self.layers, layouts, i)]

    def handoff(self, seg: int) -> Handoff:
        """How the move into segment `seg` sends its activation (scheme (a) unless the plan says)."""
        return self.handoffs.get(seg, Handoff())

    def first_layer(self, seg: int) -> str:
        """The first weighted layer of segment `seg` (the name the ledger books its moves under)."""
        return self.entry_layer(seg).name

    def entry_layer(self, seg: int) -> CostLayer:
        """The first weighted layer of segment `seg`, the one its hand-off enters."""
        return next(x for x in self.layers if x.segment == seg)


def resolve(
    model: nn.Module,
    plan: ParallelPlan,
    input_shape: tuple[int, ...] | None = None,
    world: int | None = None,
    traced: Trace | None = None,
) -> Layout:
    """The plan applied to `model`; a one-line ConfigError for anything that cannot run. `traced`
    is the model's trace for the input shape when the caller has it already."""
    if world is not None and world != plan.procs:
        raise ConfigError(
            f"the plan is for P={plan.procs} processes but the job has {world}; "
            f"re-plan with --procs {world} or run {plan.procs} processes"
        )
    shape = input_shape or plan.input_shape
    if not shape:
        raise ConfigError("the plan has no input_shape: pass input_shape=(C, H, W) to parallelize")
    tr = traced or trace(model, shape)
    layers = cost_layers(tr.specs)
    modules = dict(model.named_modules())
    styles = _checked_styles(plan, list(modules), layers)
    order, entries = _segments(layers, styles)
    stateful = {
        n
        for n, m in modules.items()
        if next(m.parameters(False), None) is not None or next(m.buffers(False), None) is not None
    }
    used = {n: segs for n, segs in tr.segment_modules().items() if n in stateful}
    layout = Layout(
        plan,
        tr,
        layers,
        styles,
        order,
        entries,
        _single_segments("module", used, order),
        _single_segments("parameter", tr.param_segments, order),
        {m: x.name for x in layers for m in x.members},
    )
    _check_redistributions(layout)
    layout.handoffs = _handoffs(layout)
    return layout


def _handoffs(layout: Layout) -> dict[int, Handoff]:
    """Each move's scheme from the plan's redistributions, checked by the planner's own rule."""
    listed = {(r.at, r.layer): r for r in layout.plan.redistributions}
    out = {}
    for k, a, b in layout.moves():
        first = layout.first_layer(k)
        r = listed.get((layout.entries.get(k, first), first))
        if r is None or (r.scheme == "a" and r.rounds == 1):
            continue
        h = Handoff(r.scheme, r.rounds)
        acts = layout.plan.choices.activations_encoded
        why = why_not_handoff(h, a, b, layout.head_layers(k), layout.plan.batch, acts, first)
        if why:
            raise ConfigError(why)
        out[k] = h
    return out


def with_handoff(layout: Layout, scheme: str, rounds: int | None = None) -> Layout:
    """The layout with every batch -> model hand-off sent by `scheme` in `rounds` rounds (None:
    one per gathering rank, the paper's K), checked as `resolve` checks a plan's; the other moves
    keep scheme (a). Its plan lists every move, and no predictions (they were for other
    schemes). The styles and segments are the layout's: nothing is resolved again."""
    listed = {(r.at, r.layer): r for r in layout.plan.redistributions}
    out = []
    for k, a, b in layout.moves():
        first = layout.first_layer(k)
        at = layout.entries.get(k, first)
        x = layout.entry_layer(k)
        r = listed.get((at, first)) or Redistribution(at, first, a, b, x.entry_elements or x.d_in)
        if is_gather(a, b) and scheme != "a":
            k_rounds = rounds if rounds is not None and scheme == "c" else a.pc // b.pc
            r = dataclasses.replace(r, scheme=scheme, rounds=k_rounds)
        else:
            r = dataclasses.replace(r, scheme="a", rounds=1)
        out.append(r)
    plan = dataclasses.replace(layout.plan, redistributions=out, predicted=[])
    moved = dataclasses.replace(layout, plan=plan)
    _check_redistributions(moved)
    moved.handoffs = _handoffs(moved)
    return moved


def _checked_styles(
    plan: ParallelPlan, modules: list[str], layers: list[CostLayer]
) -> dict[str, Style]:
    """Every weighted layer's style, each checked by its kind's rule (the planner's own), and the
    plan's choices checked against them."""
    styles = assign_styles(plan.styles, modules, [x.name for x in layers], plan.procs)
    for x in layers:
        why = why_not(x, styles[x.name], plan.batch)
        if why:
            raise ConfigError(why)
    why = why_not_choices(plan.choices, [styles[x.name] for x in layers], layers, whole=True)
    if why:
        raise ConfigError(why)
    return styles


def _segments(
    layers: list[CostLayer], styles: dict[str, Style]
) -> tuple[list[Style], dict[int, str]]:
    """Each segment's style (its layers must share one) in order, and the module entering it."""
    segments: dict[int, Style] = {}
    entries: dict[int, str] = {}
    for x in layers:
        seg = x.segment
        if seg in segments and segments[seg] != styles[x.name]:
            first = next(y.name for y in layers if y.segment == seg)
            raise ConfigError(
                f"{first} and {x.name} run in one segment (no point between them where the layout "
                f"can change, e.g. a residual block) but the plan gives them {segments[seg]} and "
                f"{styles[x.name]}; give them one style"
            )
        segments.setdefault(seg, styles[x.name])
        if x.entry is not None:
            entries[seg] = x.entry
    order = [segments[k] for k in sorted(segments)]
    firsts = {x.segment: x for x in reversed(layers)}
    for k in range(1, len(order)):
        why = why_not_move(firsts[k], order[k - 1], order[k])
        if why:
            raise ConfigError(why)
        a, b = order[k - 1].pc, order[k].pc
        if max(a, b) % min(a, b):
            raise ConfigError(
                f"no redistribution between {order[k - 1]} and {order[k]} before segment "
                f"{entries.get(k, k)!r}: their Pc ({a}, {b}) must divide one another"
            )
    return order, entries


def _single_segments(what: str, uses: dict[str, set[int]], order: list[Style]) -> dict[str, int]:
    """Each name's segment; a name used in segments of different layouts is refused (its gradient
    would be summed over two different groups)."""
    out = {}
    for name, segs in uses.items():
        pcs = {order[k].pc for k in segs}
        if len(pcs) > 1:
            raise ConfigError(
                f"{what} {name} is used in layouts with {sorted(pcs)} batch groups; give the "
                "layers around it one style"
            )
        out[name] = min(segs)
    return out


def _check_redistributions(layout: Layout) -> None:
    """A plan from the planner lists the redistributions it priced; they must be this model's."""
    listed = {(r.at, r.layer, r.src.pc, r.dst.pc) for r in layout.plan.redistributions}
    if not listed:
        return
    found = {
        (layout.entries.get(k, layout.first_layer(k)), layout.first_layer(k), a.pc, b.pc)
        for k, a, b in layout.moves()
    }
    if listed != found:
        extra = sorted(listed - found) or sorted(found - listed)
        raise ConfigError(
            f"the plan's redistributions do not match this model (e.g. before {extra[0][1]!r}): "
            "it was made for another model; re-plan for this one"
        )
    unknown = sorted({p.layer for p in layout.plan.predicted} - set(layout.styles))
    if unknown:
        raise ConfigError(
            f"the plan predicts layer {unknown[0]!r}, which this model does not have; re-plan"
        )
