"""Recipes: ``recipes/NAME.yaml`` (or any YAML path) with its ``base:`` chain, plus ``key=value``
overrides -> a validated :class:`RunConfig`."""

from __future__ import annotations

from pathlib import Path

import yaml

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import read_text
from longsft.train.config.checks import validate
from longsft.train.config.loader import (
    YamlLoader,
    build,
    check_acyclic,
    deep_merge,
    did_you_mean,
    line_map,
    load_yaml,
    parse_override,
    set_path,
)
from longsft.train.config.schema import RunConfig

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"


def recipe_path(name: str) -> Path:
    """A recipe name (``tiny``) or a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"recipe file not found: {p}")
        return p
    p = RECIPE_DIR / f"{name}.yaml"
    if not p.exists():
        known = shipped_recipes()
        raise ConfigError(f"unknown recipe {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}")
    return p


def shipped_recipes() -> list[str]:
    """Runnable recipes in ``recipes/`` (files starting with ``_`` are bases)."""
    return sorted(q.stem for q in RECIPE_DIR.glob("*.yaml") if not q.stem.startswith("_"))


def load_config(recipe: str, overrides: list[str] = ()) -> RunConfig:
    """Recipe YAML (with its ``base:`` chain) + ``key=value`` overrides -> validated :class:`RunConfig`."""
    path = recipe_path(recipe)
    raw, where = load_recipe_file(path, seen=())
    raw["recipe"] = raw.get("recipe") or path.stem
    for ov in overrides:
        key, value = parse_override(ov)
        check_acyclic(value, f"override {ov!r}")
        set_path(raw, key, value)
        where[key] = f"override {ov!r}"
    return build(RunConfig, raw, where=where)


DEFAULT_RECIPE = "tiny"


def parse_run_args(argv: list[str]) -> RunConfig:
    """``recipe=NAME`` plus ``key=value`` overrides -> validated config."""
    recipe, overrides = DEFAULT_RECIPE, []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. recipe=tiny optim.lr=1e-5)")
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    cfg = load_config(recipe, overrides)
    validate(cfg)
    return cfg


def load_recipe_file(path: Path, seen: tuple) -> tuple[dict, dict[str, str]]:
    """YAML mapping + {dotted key: 'file:line'}; ``base: NAME`` is loaded first and merged under."""
    if path in seen:
        raise ConfigError(f"{path}: circular base chain {[str(p) for p in seen]}")
    try:
        text = read_text(path)
        raw = load_yaml(text) or {}
        lines = line_map(yaml.compose(text, Loader=YamlLoader))
    except (yaml.YAMLError, DataError) as e:
        raise ConfigError(f"{path}: invalid YAML: {e}" if isinstance(e, yaml.YAMLError) else str(e)) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply, or a YAML alias that refers to itself") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys")
    check_acyclic(raw, str(path))
    where = {k: f"{path}:{v}" for k, v in lines.items()}
    base = raw.pop("base", None)
    if base is None:
        return raw, where
    if not isinstance(base, str):
        raise ConfigError(f"{where.get('base', path)}: base must be one recipe name or path, got {base!r}")
    base_raw, base_where = load_recipe_file(recipe_path(base), seen + (path,))
    base_raw.pop("recipe", None)
    return deep_merge(base_raw, raw), {**base_where, **where}
