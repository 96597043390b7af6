"""A plain mapping (parsed YAML) to the config's dataclasses: unknown keys, missing keys,
wrong types, nulls and non-finite numbers raise `ConfigError` naming the dotted key and the
value; the dataclasses' own `__post_init__` checks run as each one is built."""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from recognition.config.values import ConfigError


def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    """An instance of the dataclass `cls` from the mapping `raw`, every value converted to its
    field's annotation; `prefix` is the dotted key of `raw` with a trailing dot ("" at the
    top).

    Every unknown, missing or wrongly typed key (in sub-sections too) is found before it
    raises: one ConfigError, a line per problem. A section's `__post_init__` checks run once
    its keys convert, and raise their first problem.
    """
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    known = ", ".join(sorted(names))
    problems = [
        f"{prefix}{key}: unknown config key (known in {where}: {known})"
        for key in sorted(set(raw) - names, key=str)
    ]
    kwargs = {}
    for name in raw:
        if name not in names:
            continue
        try:
            kwargs[name] = convert_value(raw[name], hints[name], prefix + name)
        except ConfigError as exc:
            problems.append(str(exc))
    problems += [
        f"{prefix + f.name}: required key is missing"
        for f in dataclasses.fields(cls)
        if f.name not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    return cls(**kwargs)


def convert_value(value: Any, tp: Any, key: str) -> Any:
    """`value` checked against (and, for a float or a dataclass, converted to) the annotation
    `tp` of the dotted `key`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        others = [arg for arg in args if arg is not type(None)]
        if len(others) == 1 and get_origin(others[0]) is Literal:  # the choices, or null
            return convert_value(value, others[0], key)
        for arg in others:
            try:
                return convert_value(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = get_args(tp)
        return [convert_value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None:
        raise ConfigError(f"{key}: must not be null (expected {type_name(tp)})")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept it as the number it means.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{key}: unsupported annotation {tp!r}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")


def type_name(tp: Any) -> str:
    """The annotation `tp` in words for messages ("int or null", "a list of float")."""
    if get_origin(tp) is list:
        return f"a list of {type_name(get_args(tp)[0])}"
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
