"""Checks and preparation before a curriculum starts its processes: the model's config against the
parallel settings (no weights read), the attention kernel this machine runs, the demo's sample data."""

from __future__ import annotations

from longsft.train.common.errors import ConfigError
from longsft.train.common.model_files import check_model_source
from longsft.train.config.backends import check_heads
from longsft.train.config.schema import RunConfig
from longsft.train.datagen.sample_data import write_sample_data
from longsft.train.model.build import attention_quirks, build_hf_config, check_attention_quirks


def check_model(cfg: RunConfig) -> str:
    """Checks that need only the model's config (no weights): head counts against the SP backend.
    Returns the name of the block kernel sequence-parallel attention will run (:func:`attention_kernel`)."""
    m = cfg.model
    for key, value in (("model.path", m.path), ("model.tokenizer", m.tokenizer)):
        if not value or value == "qwen":
            continue
        # a missing path, an uncached hub id offline, a cut-off config.json, shard or GGUF: refused now, named
        check_model_source(value, m.gguf_file if key == "model.path" else None, key,
                           "weights" if key == "model.path" else None)
    try:
        hf = build_hf_config(m)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={m.path}: cannot read its config.json ({e})") from None
    check_heads(cfg.parallel.sp_backend, cfg.parallel.sp_size, hf.num_attention_heads,
                getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
    check_attention_quirks(hf, cfg.parallel.sp_size, cfg.data.packing)
    rope = [q for q in attention_quirks(hf) if q.startswith("rope_type")]
    if rope and cfg.parallel.pad_multiple not in ("auto", 1):
        raise ConfigError(f"parallel.pad_multiple={cfg.parallel.pad_multiple}: this model's {rope[0].split(' ')[0]} "
                          "takes its frequencies from the largest position, which padding would raise: the loss "
                          "would change; use parallel.pad_multiple=auto (none for this model)")
    import torch

    if m.loss_kernel == "liger" and getattr(hf, "final_logit_softcapping", None):
        raise ConfigError(f"model.loss_kernel=liger: this model caps its logits (final_logit_softcapping="
                          f"{hf.final_logit_softcapping}), which longsft does not pass to Liger's kernel; use "
                          "model.loss_kernel=torch (it applies the cap, chunked or not)")
    if m.loss_kernel == "liger" and not torch.cuda.is_available():
        raise ConfigError("model.loss_kernel=liger runs on CUDA GPUs only; use model.loss_kernel=torch "
                          "(with model.loss_chunk_tokens) on this machine")
    return attention_kernel(cfg, hf)


def attention_kernel(cfg: RunConfig, hf) -> str:
    """The fused kernel the ring's blocks (and Ulysses) run on this machine, by name; a forced
    ``parallel.attention_kernel`` that cannot run here fails now, before any model is built."""
    import torch

    from longsft.train.model.build import torch_dtype
    from longsft.train.parallel.kernels import block_kernel

    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return block_kernel(device, torch_dtype(cfg.model), cfg.parallel.attention_kernel, head_dim).name
    except ValueError as e:
        raise ConfigError(str(e)) from None


def prepare_data(cfg: RunConfig, tokenizer) -> None:
    """``data.source: sample`` -> write the deterministic sample set into the run dir (once)."""
    if cfg.data.source != "sample":
        return
    out = cfg.run_path / "data"
    buckets = sorted({s.bucket for s in cfg.stages})
    if all((out / b / "validation.jsonl").exists() for b in buckets):
        return
    write_sample_data(out, tokenizer, buckets, cfg.data.sample_size, max(2, cfg.data.sample_size // 4),
                      cfg.data.seed)
