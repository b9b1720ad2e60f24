"""The style kinds the runtime executes, by name: one class per file. The torch-free rules
(hybridpar.core.rules.EXECUTED) name the same kinds; a test holds the two lists equal."""

from __future__ import annotations

from collections.abc import Callable

from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import Style
from hybridpar.runtime.parallel import domain, redistribute
from hybridpar.runtime.parallel.batch import BatchStyle
from hybridpar.runtime.parallel.domain import DomainStyle
from hybridpar.runtime.parallel.model import ModelStyle
from hybridpar.runtime.parallel.redistribute import Move
from hybridpar.runtime.parallel.styles import BuildContext, ParallelStyle

__all__ = ["MOVES", "STYLES", "move", "runtime_style"]

STYLES: dict[str, type[ParallelStyle]] = {
    cls.kind: cls for cls in (BatchStyle, ModelStyle, DomainStyle)
}
MOVES = {**redistribute.MOVES, **domain.MOVES}
"""(layout kind before, layout kind after) -> the builder of the forward pre-hook moving it"""


def move(src: Style, dst: Style, m: Move) -> Callable:
    """The forward pre-hook that moves a segment's input from `src`'s layout to `dst`'s."""
    kinds = (src.layout[0], dst.layout[0])
    if kinds not in MOVES:
        raise ConfigError(f"no redistribution from {src} to {dst} before {m.layer}; re-plan")
    return MOVES[kinds](src, dst, m)


def runtime_style(spec: Style, ctx: BuildContext) -> ParallelStyle:
    """The runtime of `spec` on this rank."""
    if spec.kind not in STYLES:
        raise ConfigError(f"style {spec} is not executed by the runtime; re-plan without it")
    return STYLES[spec.kind](spec, ctx)
