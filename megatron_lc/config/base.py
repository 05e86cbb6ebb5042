"""Strict YAML -> dataclass loading shared by every config section.

Each section is a dataclass; ``build_section(cls, mapping, where)`` checks keys and types and raises
``ConfigError`` with a one-line message naming the key, the section and the valid keys.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A user mistake in a config file or an override; the message is meant to be shown as is."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise ConfigError naming ``where``.

    Accepts ints for floats, and strings from ``--set`` overrides ("3", "1e-4", "true", "null").
    """
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        errors = []
        # try the non-str alternatives first so "0.5" becomes a float under `float | Literal['auto']`
        for arg in sorted(args, key=lambda a: a is str):
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} is not {_type_name(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        for c in choices:  # "true" -> True etc. when a literal is not a string
            if not isinstance(c, str) and isinstance(value, str) and str(c).lower() == value.lower():
                return c
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
    if origin in (list, tuple):
        (elem,) = get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
            if f.is_integer():
                return int(f)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    raise ConfigError(f"{where}: unsupported type {tp}")


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build_section(cls: type, mapping: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``mapping``; unknown keys -> ConfigError listing the valid ones."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {mapping!r}")
    types_ = field_types(cls)
    unknown = [k for k in mapping if k not in types_]
    if unknown:
        raise ConfigError(
            f"unknown key '{where}.{unknown[0]}'; valid keys of '{where}': {', '.join(sorted(types_))}"
        )
    kwargs = {k: coerce(v, types_[k], f"{where}.{k}") for k, v in mapping.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``cond``; used by sections' ``__post_init__``."""
    if not cond:
        raise ConfigError(message)


def read_yaml_mapping(path: str, not_a_mapping: str) -> dict:
    """The mapping in YAML file ``path`` (empty file -> {}); a one-line ConfigError if it is not YAML, or
    ``"{path}: {not_a_mapping}"`` if it is not a mapping."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {not_a_mapping}")
    return raw
