"""The style kinds the runtime executes, by name: one class per file. The torch-free rules
(hybridpar.planning.rules.EXECUTED) name the same kinds; a test holds the two lists equal."""

from __future__ import annotations

from hybridpar.errors import ConfigError
from hybridpar.plan import Style
from hybridpar.runtime.parallel.batch import BatchStyle
from hybridpar.runtime.parallel.model import ModelStyle
from hybridpar.runtime.parallel.styles import BuildContext, ParallelStyle

__all__ = ["STYLES", "runtime_style"]

STYLES: dict[str, type[ParallelStyle]] = {cls.kind: cls for cls in (BatchStyle, ModelStyle)}


def runtime_style(spec: Style, ctx: BuildContext) -> ParallelStyle:
    """The runtime of `spec` on this rank."""
    if spec.kind not in STYLES:
        raise ConfigError(f"style {spec} is not executed by the runtime; re-plan without it")
    return STYLES[spec.kind](spec, ctx)
