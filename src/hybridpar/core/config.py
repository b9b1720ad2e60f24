"""Typed configuration: a dataclass is the single source of truth, and the command line is generated
from its fields (flag, type, choices, default and help), the way torchtitan's JobConfig drives its
CLI. Enumerations are `Literal` types, checked once by `check_fields` before any work starts.

A field's metadata may carry `help`, `flag` (instead of --field-name), `aliases`, `required`,
`show` (the default as the help prints it), `positive` or `nonneg` (its bound, checked by
`check_fields`), and for a bool that defaults to True, `flag` names
the switch that turns it off (e.g. --no-progress). A field whose type is itself such a dataclass
(`choices: Choices`, `runtime: RuntimeOptions`) is nested: its fields become flags of their own
(`--codec`, `--bucket-mb`), and `from_namespace` builds it back, so one dataclass (the choices)
serves several configs without a field copied by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import Any, Literal

from hybridpar.core.errors import ConfigError

__all__ = [
    "add_arguments",
    "build",
    "check_fields",
    "dump_toml",
    "evolve",
    "flag_of",
    "from_namespace",
    "load_toml",
    "meta",
    "nested",
    "writable",
]


def meta(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with its command-line help."""
    return field(default=default, metadata={"help": help, **extra})


def nested(cls: type) -> Any:
    """A field holding a configuration dataclass (its own fields become flags)."""
    return field(default_factory=cls)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: tuple[str, ...] = (),
    prefix: str = "",
    concerns: dict[str, tuple[str, ...]] | None = None,
    _groups: dict | None = None,
) -> dict:
    """One option per field of `cls` (and of the configs nested in it), with the field's default,
    type, choices and help. `concerns` ({title: the fields' dests, "choices.codec" for a nested
    one}) puts every option under the title of its concern, in that order, whatever config it
    comes from; without it a nested config's options go under its own title. Returns the
    concerns' argument groups by title ({} without)."""
    if concerns is not None and _groups is None:
        _groups = {t: parser.add_argument_group(t) for t in concerns}
        _groups.update({d: _groups[t] for t, dests in concerns.items() for d in dests})
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = _unwrap(hints[f.name])
        if _is_config(tp) and _groups is not None:
            add_arguments(parser, tp, skip, f"{prefix}{f.name}.", concerns, _groups)
            continue
        if _is_config(tp):  # its options under its own title (the class's first docstring line)
            title = (tp.__doc__ or tp.__name__).strip().splitlines()[0].rstrip(".")
            group = parser.add_argument_group(f"{f.name}: {title[0].lower()}{title[1:]}")
            add_arguments(group, tp, skip, prefix=f"{prefix}{f.name}.")
            continue
        if _groups is not None:
            if prefix + f.name not in _groups:
                raise TypeError(f"option {prefix + f.name} has no concern to be listed under")
            into = _groups[prefix + f.name]
        else:
            into = parser
        names = [flag_of(cls, f.name), *f.metadata.get("aliases", ())]
        kw = _argument(f, tp, prefix + f.name)
        if "choices" not in kw and "action" not in kw:  # the flag's own name, not the dest
            kw["metavar"] = names[0].lstrip("-").upper().replace("-", "_")
        into.add_argument(*names, **kw)
    return {t: _groups[t] for t in concerns} if concerns and _groups else {}


def _argument(f: dataclasses.Field, tp: Any, dest: str) -> dict[str, Any]:
    """argparse's keywords for field `f` of type `tp`: its default, type or choices, and help."""
    default = _default(f)
    # argparse %-formats help texts: a literal "%" ("75 %") must be doubled
    kw: dict[str, Any] = {
        "dest": dest,
        "help": f.metadata.get("help", "").replace("%", "%%"),
    }
    if f.metadata.get("required"):
        kw["required"] = True
    if tp is bool:
        kw["action"] = "store_false" if default else "store_true"
        if default:  # the flag turns off what the field's help describes
            kw["help"] = f"turn off (on by default): {kw['help']}"
    elif typing.get_origin(tp) is Literal:
        kw.update(choices=list(typing.get_args(tp)), default=default)
    elif typing.get_origin(tp) is tuple:  # parsed by the dataclass itself (e.g. compress)
        kw.update(default=default)
        kw["help"] += f" (default: {f.metadata.get('show', default)})"
    else:
        kw.update(type=_parse(tp), default=default)
        if default is not None:
            kw["help"] += f" (default: {f.metadata.get('show', default)})"
    return kw


def _parse(tp: Any):
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


def from_namespace(cls: type, ns: argparse.Namespace, prefix: str = "", **extra: Any):
    """`cls` from parsed arguments, nested configs included: no field copied by hand."""
    hints = typing.get_type_hints(cls)
    values = vars(ns)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if not f.init or f.name in extra:
            continue
        tp, _ = _unwrap(hints[f.name])
        if _is_config(tp):
            kwargs[f.name] = from_namespace(tp, ns, prefix=f"{prefix}{f.name}.")
        elif prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs, **extra)


def _route(cls: type, flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Flat keyword arguments named like the flags' fields, split into `cls`'s own fields and
    those of each config nested in it; an unknown name is a TypeError, as for any call."""
    hints = typing.get_type_hints(cls)
    own = {k: v for k, v in flat.items() if k in {f.name for f in fields(cls)}}
    inner: dict[str, dict[str, Any]] = {}
    for f in fields(cls):
        tp, _ = _unwrap(hints[f.name])
        if _is_config(tp) and f.name not in own:
            inner[f.name] = {k: v for k, v in flat.items() if k in {g.name for g in fields(tp)}}
    unknown = sorted(set(flat) - set(own) - {k for d in inner.values() for k in d})
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r}")
    return own, inner


def build(cls: type, **flat: Any):
    """`cls` from flat keyword arguments named like its flags' fields: the ones of a nested
    config go to it (`build(TrainConfig, lr=0.1, codec="fp16", seed=3)`), as on the command
    line."""
    own, inner = _route(cls, flat)
    hints = typing.get_type_hints(cls)
    nested_ = {k: build(_unwrap(hints[k])[0], **v) for k, v in inner.items()}
    return cls(**own, **nested_)


def evolve(obj: Any, **flat: Any):
    """A copy of `obj` with fields changed by their flat names, as `build` takes them: a nested
    config's field is changed inside it (`evolve(cfg, codec="fp16", lr=0.1)`)."""
    own, inner = _route(type(obj), flat)
    nested_ = {k: evolve(getattr(obj, k), **v) for k, v in inner.items() if v}
    return dataclasses.replace(obj, **own, **nested_)


def check_fields(obj: Any) -> None:
    """Every Literal field holds one of its values, every number is finite and within its
    declared bound (nested configs too)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        tp, optional = _unwrap(hints[f.name])
        v = getattr(obj, f.name)
        if v is None and optional:
            continue
        if _is_config(tp):
            check_fields(v)
            continue
        flag = flag_of(obj, f.name)
        if typing.get_origin(tp) is Literal and v not in typing.get_args(tp):
            raise ConfigError(f"{flag} must be one of {', '.join(typing.get_args(tp))}, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{flag} must be a finite number, got {v}")
        strict = f.metadata.get("positive", False)
        if (strict or f.metadata.get("nonneg")) and (v <= 0 if strict else v < 0):
            raise ConfigError(f"{flag} must be {'positive' if strict else 'at least 0'}, got {v}")


def flag_of(obj: Any, name: str) -> str:
    """The command-line flag of a field (its metadata's `flag`, or --field-name)."""
    f = next(f for f in fields(obj) if f.name == name)
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def read_json(path: str | Path, what: str, hint: str) -> Any:
    """The JSON in `path`; where it is missing or not JSON, a one-line ConfigError that names
    `what` it should be and says what to do (`hint`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist; {hint}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        why = str(exc).splitlines()[0]
        raise ConfigError(f"{what} {str(p)!r} is not valid JSON ({why}); {hint}") from None


def writable(flag: str, path: str | Path) -> Path:
    """A one-line ConfigError unless a file can be written at `path` (its folder is made): the
    check every command runs on its outputs before any work."""
    path = Path(path)
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".hybridpar-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot write in {folder} ({exc.strerror}); choose another place"
        ) from None
    return path


# --- a command's options as a TOML file (`--config`, `--print-config`) ---------------------------

_NOT_KEYS = {"help", "config", "print_config", "version", "func", "command"}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{dest: action} of a command's options, a nested config's under "choices.codec"."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_KEYS}


def _flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _from_toml(action: argparse.Action, key: str, v: Any) -> Any:
    """A TOML value for `action`, checked and converted as its flag's text would be."""
    if action.nargs == 0:  # a switch: true or false
        if not isinstance(v, bool):
            raise ConfigError(f"{key} must be true or false, got {v!r}")
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return tuple(v)  # a list field (compress), parsed by its config
    if isinstance(v, bool | list | dict) or (action.type is None and not isinstance(v, str)):
        raise ConfigError(f"{key} must be {'a string' if action.type is None else 'a number'}")
    if action.type is not None:
        try:
            v = action.type(str(v))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"{key}: {exc}") from None
    if action.choices is not None and v not in action.choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, action.choices))}, got {v!r}")
    return v


def load_toml(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """{dest: value} of a TOML file of `parser`'s options: its keys the options' fields, a nested
    config's in its own table (`[choices] codec = "linear"`), as `dump_toml` writes them; an
    unknown key, a wrong type or a bad value is a ConfigError naming the key."""
    import tomllib

    try:
        table = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: not TOML ({str(exc).splitlines()[0]})") from None
    options, out = _options(parser), {}
    for key, v in _flatten(table).items():
        if key not in options:
            near = [k for k in options if k.split(".")[-1] == key.split(".")[-1]]
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--config {path}: unknown key {key!r}{hint}")
        try:
            out[key] = _from_toml(options[key], key, v)
        except ConfigError as exc:
            raise ConfigError(f"--config {path}: {exc}") from None
    return out


def dump_toml(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str:
    """The options `ns` holds for `parser` as TOML that `load_toml` reads back unchanged (an
    option without a value is left out: TOML has no null)."""
    import json

    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, tuple | list):
            return "[" + ", ".join(json.dumps(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    tables: dict[str, list[str]] = {"": []}
    for dest in _options(parser):
        v = getattr(ns, dest, None)
        if v is None:
            continue
        table, _, key = dest.rpartition(".")
        tables.setdefault(table, []).append(f"{key} = {text(v)}")
    parts = ["\n".join(tables.pop(""))]
    parts += [f"[{t}]\n" + "\n".join(lines) for t, lines in tables.items()]
    return "\n\n".join(p for p in parts if p) + "\n"
