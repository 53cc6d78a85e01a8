"""Typed dataclasses from YAML and ``key=value`` arguments, for any schema (the run's, eval's, serve's).

Every error names the offending key, the file and line (or argument) that set it, the expected type,
and suggests the closest valid key. We use our own small converter instead of OmegaConf: it gives
file:line and did-you-mean messages, and the schema stays plain dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from typing import Any, Literal

import yaml

from longsft.train.common.errors import ConfigError
from longsft.train.config.schema import RunConfig


class YamlLoader(yaml.SafeLoader):
    """PyYAML's YAML 1.1, plus YAML 1.2's floats: ``1e-6`` is a number (1.1 reads it as a string,
    which a model config would pass on to the model's constructor)."""


YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def load_yaml(text: str):
    """A recipe or an override value (see :class:`YamlLoader`)."""
    return yaml.load(text, Loader=YamlLoader)  # a SafeLoader subclass: no Python objects


def check_acyclic(raw: Any, where: str) -> None:
    """YAML aliases can make a structure contain itself (``a: &x [*x]``): refuse it by name."""
    try:
        json.dumps(raw, default=str)
    except ValueError:
        raise ConfigError(f"{where}: a YAML alias refers to itself (a structure that contains itself)") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None


def deep_merge(base: dict, top: dict) -> dict:
    """Deep-merge mappings; lists and scalars in ``top`` replace those in ``base``."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.0.c=value`` -> (key, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        parsed = load_yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def get_path(raw: dict, key: str) -> Any:
    """``raw[a][b][c]`` for ``key='a.b.c'`` (mappings only), or None where a part is missing."""
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_path(raw: dict, key: str, value: Any) -> None:
    """Set ``raw[a][b][0][c] = value`` for ``key='a.b.0.c'``, creating mappings as needed."""
    parts = key.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            node = node[_index(node, part, parts[: i + 1])]
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() and part == "stages" else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, parts)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override {key!r}: {'.'.join(parts[:-1])} is not a mapping")


def _index(node: list, part: str, parts: list[str]) -> int:
    if not part.lstrip("-").isdigit():
        raise ConfigError(f"override {'.'.join(parts)!r}: list index expected, got {part!r}")
    i = int(part)
    if not -len(node) <= i < len(node):
        raise ConfigError(f"override {'.'.join(parts)!r}: index {i} out of range (list has {len(node)} items)")
    return i


def from_args(cls: type, argv: list[str], example: str = "key=value") -> Any:
    """``key=value`` command-line arguments -> dataclass ``cls`` (typed, unknown keys named)."""
    raw: dict = {}
    where: dict[str, str] = {}
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. {example})")
        key, value = parse_override(arg)
        set_path(raw, key, value)
        where[key] = f"argument {arg!r}"
    return build(cls, raw, where=where)


def build(cls: type, raw: Any, prefix: str = "", where: dict[str, str] | None = None) -> Any:
    """Convert a nested dict into dataclass ``cls``, checking every key and type."""
    where = where or {}
    if not isinstance(raw, dict):
        raise ConfigError(_msg(prefix, where, f"expected a mapping for {cls.__name__}, got {type(raw).__name__}"))
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(_msg(full, where, f"unknown key {full!r}{did_you_mean(str(key), names, prefix)}"))
        kwargs[key] = _convert(hints[key], value, full, where)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: str, where: dict[str, str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key + ".", where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key, where)
            except ConfigError:
                continue
        raise ConfigError(_msg(key, where, f"{key!r} must be {_type_name(tp)}, got {value!r}"))
    if origin is Literal:
        if value not in args:
            raise ConfigError(_msg(key, where, f"{key!r} must be one of {list(args)}, got {value!r}"
                                   f"{did_you_mean(str(value), [str(a) for a in args])}"))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(_msg(key, where, f"{key!r} must be a list, got {value!r}"))
        return [_convert(args[0], v, f"{key}.{i}", where) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(_msg(key, where, f"{key!r} must be a list of {len(args)} values, got {value!r}"))
        return tuple(_convert(a, v, f"{key}.{i}", where) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(_msg(key, where, f"{key!r} must be a mapping, got {value!r}"))
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(_msg(key, where, f"{key!r} must be true or false, got {value!r}"))
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(_msg(key, where, f"{key!r} must be an integer, got {value!r}"))
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-6 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(_msg(key, where, f"{key!r} must be a number, got {value!r}"))
        if not math.isfinite(value):
            raise ConfigError(_msg(key, where, f"{key!r} must be a finite number, got {value!r}"))
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(_msg(key, where, f"{key!r} must be a string, got {value!r}"))
        return value
    raise ConfigError(f"{key!r}: unsupported schema type {tp}")  # a bug in the schema, not user input


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in args]
    return " or ".join(names) + (" or null" if type(None) in typing.get_args(tp) else "")


def did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def _msg(key: str, where: dict[str, str], text: str) -> str:
    """Prefix ``text`` with where ``key`` was set: itself, a child it was set through, or a parent."""
    key = key.rstrip(".")
    loc = where.get(key) or next((v for k, v in where.items() if k.startswith(key + ".")), None)
    parts = key.split(".")
    while loc is None and parts:
        parts.pop()
        loc = where.get(".".join(parts))
    return f"{loc}: {text}" if loc else text


def line_map(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line number in the recipe file."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{prefix}{k.value}"
            out[key] = k.start_mark.line + 1
            out.update(line_map(v, key + "."))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[f"{prefix}{i}"] = v.start_mark.line + 1
            out.update(line_map(v, f"{prefix}{i}."))
    return out


def with_changes(cfg: Any, changes: dict[str, Any]) -> Any:
    """A copy of dataclass ``cfg`` with ``{dotted key: value}`` set, through the same dotted set and typed
    build as overrides (every key and type checked)."""
    raw = to_dict(cfg)
    for key, value in changes.items():
        set_path(raw, key, value)
    return build(type(cfg), raw)


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain YAML-safe dict (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)
