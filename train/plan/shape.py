"""The model's sizes as the planner needs them, from its config.json alone (no weights)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from longsft.train.common.errors import ConfigError
from longsft.train.common.io import read_json
from longsft.train.common.model_files import check_model_source, looks_local, model_not_found
from longsft.train.config.recipes import RECIPE_DIR
from longsft.train.config.schema import RunConfig
from longsft.train.model.build import build_hf_config

MODEL_DIR = RECIPE_DIR / "models"  # config.json of each shipped recipe's model, named after model.path


@dataclass
class Shape:
    """What the planner needs from a model: sizes in elements (activations are traced per stage)."""

    name: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    params: int  # all parameters
    layer_params: int  # one decoder layer
    largest_module: int  # largest single weight (embedding or LM head, usually)
    persistent: int  # parameters below ZeRO-3's persistence threshold (kept whole on every rank)
    tied: bool = False  # the LM head shares the input embedding's weight
    deferrable: bool = False  # and its gradient can wait for the embedding's backward (model/tied_head.py)
    hf: object = field(default=None, repr=False)  # the HF config (traced for activations)
    traces: dict = field(default_factory=dict, repr=False)  # (tokens, settings) -> traced bytes


def model_config_source(cfg: RunConfig) -> str:
    """Where the model's config comes from: inline ``model.config``, a local checkpoint, or a shipped file.
    A local path that is not there, or a cut-off GGUF file, is refused as ``longsft train`` refuses it."""
    if cfg.model.config is not None:
        return "recipe"
    if cfg.model.gguf_file or cfg.model.path.endswith(".gguf"):
        check_model_source(cfg.model.path, cfg.model.gguf_file, what="config")  # missing or cut off: named
        return "recipe"  # (a GGUF file: its header, read without the weights)
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return str(path / "config.json")
    if looks_local(cfg.model.path) and not path.exists():
        raise model_not_found("model.path", cfg.model.path)
    shipped = MODEL_DIR / f"{path.name}.json"
    if shipped.is_file():
        return str(shipped)
    raise ConfigError(f"model.path={cfg.model.path!r}: no config.json there and none shipped as {shipped}; "
                      "point model.path at a local checkpoint folder (only its config.json is read)")


def hf_config(cfg: RunConfig):
    """The HF config the run would train (rope scaling applied), without any weights."""
    source = model_config_source(cfg)
    if source == "recipe":
        try:
            return build_hf_config(cfg.model)
        except ConfigError:  # a broken file, named (build_hf_config reads through model_files.reading_model)
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.config / model.path={cfg.model.path}: cannot build the model's config ({e})") \
                from None
    raw = read_json(source, "model config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object (an HF config.json)")
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"{source}: no model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        raw.pop(key, None)
    check_model_sizes(raw, str(model_type), source)
    inline = dataclasses.replace(cfg.model, path=None, config={"model_type": model_type, **raw})
    return build_hf_config(inline)


SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_model_sizes(raw: dict, model_type: str, source: str) -> None:
    """A config to plan must name its model type and sizes: transformers' defaults are some other model."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=1)
        raise ConfigError(f"{source}: model_type {model_type!r} is not one this transformers knows"
                          + (f" (did you mean {close[0]!r}?)" if close else ""))
    aliases = {v: k for k, v in CONFIG_MAPPING[model_type].attribute_map.items()}
    missing = [k for k in SIZE_KEYS if k not in raw and aliases.get(k) not in raw]
    if missing:
        raise ConfigError(f"{source}: no {', '.join(missing)}: the planner will not guess a model's size "
                          "(transformers' defaults describe another model)")
    for key in SIZE_KEYS + ("intermediate_size", "num_key_value_heads", "head_dim"):
        value = raw.get(key, raw.get(aliases.get(key, ""), 1))
        if value is None and key in ("num_key_value_heads", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: {key}={value!r} must be a positive integer")
