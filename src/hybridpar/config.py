"""Typed configuration: a dataclass is the single source of truth, and the command line is generated
from its fields (flag, type, choices, default and help), the way torchtitan's JobConfig drives its
CLI. Enumerations are `Literal` types, checked once by `check_fields` before any work starts.

A field's metadata may carry `help`, `flag` (instead of --field-name), `aliases`, and for a bool
that defaults to True, `flag` names the switch that turns it off (e.g. --no-progress).
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from hybridpar.choices import CODECS, check_codec, parse_compress
from hybridpar.errors import ConfigError

__all__ = [
    "PlanConfig",
    "add_arguments",
    "check_fields",
    "flag_of",
    "from_namespace",
    "meta",
    "positive",
]

Codec = Literal["none", "fp16", "bf16", "dynamic-tree", "linear", "mantissa", "static-tree"]
BN = Literal["local", "global", "adaptive"]
Reducer = Literal["process-group", "host"]
assert set(typing.get_args(Codec)) == set(CODECS)


def meta(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with its command-line help."""
    return field(default=default, metadata={"help": help, **extra})


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One option per field of `cls`, with the field's default, type, choices and help."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = _unwrap(hints[f.name])
        names = [flag_of(cls, f.name), *f.metadata.get("aliases", ())]
        default = f.default if f.default is not MISSING else None
        # argparse %-formats help texts: a literal "%" ("75 %") must be doubled
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "").replace("%", "%%")}
        if f.metadata.get("required"):
            kw["required"] = True
        if tp is bool:
            kw["action"] = "store_false" if default else "store_true"
        elif typing.get_origin(tp) is Literal:
            kw.update(choices=list(typing.get_args(tp)), default=default)
        else:
            kw.update(type=_parse(tp, f.name), default=default)
            if default is not None:
                kw["help"] += f" (default: {default})"
        parser.add_argument(*names, **kw)


def _parse(tp: Any, name: str):
    def parse(text: str):
        try:
            v = tp(text)
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(tp, f"a {tp.__name__}")
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        return v

    parse.__name__ = tp.__name__  # argparse names the type in its messages
    return parse


def from_namespace(cls: type, ns: argparse.Namespace, **extra: Any):
    """`cls` from parsed arguments: no field copied by hand."""
    names = {f.name for f in fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(ns).items() if k in names}, **extra)


def check_fields(obj: Any) -> None:
    """Every Literal field holds one of its values, every number is finite."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        tp, optional = _unwrap(hints[f.name])
        v = getattr(obj, f.name)
        if v is None and optional:
            continue
        flag = flag_of(obj, f.name)
        if typing.get_origin(tp) is Literal and v not in typing.get_args(tp):
            raise ConfigError(f"{flag} must be one of {', '.join(typing.get_args(tp))}, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{flag} must be a finite number, got {v}")


def flag_of(obj: Any, name: str) -> str:
    """The command-line flag of a field (its metadata's `flag`, or --field-name)."""
    f = next(f for f in fields(obj) if f.name == name)
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def positive(obj: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if v is not None and (v < 0 or (v == 0 and not allow_zero)):
            flag = flag_of(obj, name)
            raise ConfigError(
                f"{flag} must be {'at least 0' if allow_zero else 'positive'}, got {v}"
            )


@dataclass
class PlanConfig:
    """What `hybridpar plan` and `simulate` plan for (the number of processes is theirs)."""

    model: str = meta(
        None,
        "zoo model: alexnet, alexnet-owt, vgg16, resnet20, digits-cnn, digits-wide, mlp",
        required=True,
    )
    batch: int = meta(None, "global mini-batch B", required=True)
    cluster: str = meta(
        "cori-knl",
        "preset (cori-knl, k20-pcie, fdr-infiniband, p100-nvlink), localhost, or a .toml/.json file",
    )
    input_size: int | None = meta(None, "image side, e.g. 64 (default: the model's)")
    compute: str | None = meta(
        None, "compute table from `hybridpar profile` (default: FLOPs / cluster rate)"
    )
    bytes_per_element: float | None = meta(
        None, "wire bytes per element (default: the cluster's word size)"
    )
    codec: Codec = meta(
        "none", "wire encoding of the traffic named by --compress (8-bit types: 1 byte/element)"
    )
    compress: str = meta(
        "grads,activations",
        "what the codec applies to: grads, activations or both (comma-separated)",
    )
    bn: BN = meta("local", "batch norm: global and adaptive price the statistics all-reduces")
    memory_limit: float | None = meta(None, "GiB per process (parameters + activations)")
    overlap: bool = meta(False, "hide the weight all-reduce behind the backward pass (Fig. 8)")
    reducer: Reducer = meta(
        "process-group", "how the plan's gradients are summed (recorded in --out's plan)"
    )
    amp: Literal["none", "bf16"] = meta("none", "bf16 autocast: activations travel as bf16")

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ConfigError(f"--batch must be a positive integer, got {self.batch!r}")
        positive(self, "input_size", "bytes_per_element", "memory_limit")
        check_codec(self.codec)
        parse_compress(self.compress)

    def plan_kwargs(self) -> dict:
        """Keyword arguments of `hybridpar.planning.search.make_plan`."""
        from hybridpar.planning.cost.compute import load_table

        return dict(
            input_size=self.input_size,
            compute=load_table(self.compute) if self.compute else None,
            elem_bytes=self.bytes_per_element,
            memory_limit=self.memory_limit * 2**30 if self.memory_limit else None,
            overlap=self.overlap,
            codec=self.codec,
            compress=parse_compress(self.compress),
            bn=self.bn,
            amp=self.amp,
        )
