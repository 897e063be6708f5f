"""Typed configuration: dataclasses, TOML files and ``--section.key value`` overrides.

Each component owns its ``Config`` dataclass beside its code (``DataConfig`` in
``freescale.dataloader``, ``HSTUConfig`` in ``freescale.models.hstu`` ...); the
trainer nests them into one ``TrainerConfig``.  This module only knows how to
fill any such tree of dataclasses from a TOML file and command-line overrides,
and how to refuse bad input with one line that names the key:

    >>> cfg = load_config(TrainerConfig, "configs/tiny_hstu.toml", ["--train.steps", "50"])

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``
of strings, ``list[int]`` / ``list[float]`` / ``list[str]``, and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, phrased for the user (one line, names the key)."""


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"list of {type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (TOML values) or convert (override strings) ``value`` to ``tp``."""
    origin = get_origin(tp)
    from_text = isinstance(value, str) and tp is not str and origin is not Literal
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str):
            text = value.strip().strip("[]")
            value = [v.strip() for v in text.split(",") if v.strip()] if text else []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.lower() in ("true", "1", "yes", "on"):
            return True
        if from_text and value.lower() in ("false", "0", "no", "off"):
            return False
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a programming error in a Config class
        raise TypeError(f"{key}: unsupported config field type {tp!r}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def did_you_mean(name: str, known: typing.Iterable[str], prefix: str = "") -> str:
    """`` (did you mean '<prefix><closest>'?)`` for the closest of ``known`` to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _unknown_key(prefix: str, name: str, known: typing.Iterable[str]) -> ConfigError:
    return ConfigError(f"unknown config key '{prefix}{name}'{did_you_mean(name, known, prefix)}")


def _apply_mapping(obj: Any, mapping: dict[str, Any], prefix: str = "") -> None:
    fields = _fields(type(obj))
    for name, value in mapping.items():
        if name not in fields:
            raise _unknown_key(prefix, name, fields)
        _, tp = fields[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table [{key}], got {value!r}")
            _apply_mapping(getattr(obj, name), value, prefix=f"{key}.")
        else:
            setattr(obj, name, _coerce(key, value, tp))


def _apply_override(obj: Any, dotted: str, text: str) -> None:
    *path, leaf = dotted.split(".")
    prefix = ""
    for part in path:
        fields = _fields(type(obj))
        if part not in fields or not dataclasses.is_dataclass(fields[part][1]):
            raise _unknown_key(prefix, part, [n for n, (_, t) in fields.items() if dataclasses.is_dataclass(t)])
        obj = getattr(obj, part)
        prefix += part + "."
    fields = _fields(type(obj))
    if leaf not in fields:
        raise _unknown_key(prefix, leaf, fields)
    _, tp = fields[leaf]
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"{dotted}: is a section; set one of its keys, e.g. --{dotted}.<key> VALUE")
    setattr(obj, leaf, _coerce(dotted, text, tp))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Split ``["--a.b", "1", "--c=2"]`` into ``[("a.b", "1"), ("c", "2")]``."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{body}: missing value")
            key, value = body, args[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build ``cls()`` from its defaults, then a TOML file, then CLI overrides; validate."""
    cfg = cls()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}" + (" (a directory; name a .toml file in it)"
                                                                  if path.is_dir() else ""))
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        try:
            _apply_mapping(cfg, data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    for key, value in parse_overrides(overrides or []):
        _apply_override(cfg, key, value)
    validate(cfg)
    return cfg


def validate(cfg: Any, prefix: str = "") -> None:
    """Run every nested ``validate()`` method (each raises ConfigError naming its key)."""
    for name, (_, tp) in _fields(type(cfg)).items():
        if dataclasses.is_dataclass(tp):
            validate(getattr(cfg, name), prefix=f"{prefix}{name}.")
    check = getattr(cfg, "validate", None)
    if callable(check):
        try:
            check()
        except ConfigError as exc:
            raise ConfigError(f"{prefix}{exc}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logs and checkpoint metadata)."""
    return dataclasses.asdict(cfg)


_NOT_SET = object()


def differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: saved -> current`` for each dotted key whose value differs between two ``to_dict`` configs;
    a key the saved one lacks (written before the key existed) shows as ``(not set)``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key, _NOT_SET), current.get(key, _NOT_SET)
        if isinstance(old, dict) and isinstance(new, dict):
            out += differences(old, new, f"{prefix}{key}.")
        elif old != new:
            shown = ["(not set)" if v is _NOT_SET else repr(v) for v in (old, new)]
            out.append(f"{prefix}{key}: {shown[0]} -> {shown[1]}")
    return out


def require(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"{key}: {message}")
