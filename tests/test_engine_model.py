"""DeepSpeed config filling, LR schedule, rope scaling, attention routing, best-checkpoint order."""

import json
import math

import pytest
import torch

from longsft.train.common.errors import ConfigError
from longsft.train.config.deepspeed import build_ds_config
from longsft.train.config.recipes import load_config
from longsft.train.config.schema import ModelConfig
from longsft.train.model.build import build_hf_config, check_attention_routable
from longsft.train.training.engine import lr_lambda
from longsft.train.training.validation import is_better


def test_ds_config_auto_values_filled_from_recipe():
    cfg = load_config("qwen3_8b", ["optim.grad_accum=4", "optim.lr=1e-5"])
    ds = build_ds_config(cfg, cfg.stages[1], world_size=8, hidden_size=4096)
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 32 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["lr"] == 1e-5
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert z["reduce_bucket_size"] == 4096 * 4096
    assert "auto" not in json.dumps(ds)


def test_stage_lr_overrides_run_lr():
    cfg = load_config("tiny", ["stages.1.lr=1e-4"])
    assert build_ds_config(cfg, cfg.stages[1], 2, 64)["optimizer"]["params"]["lr"] == 1e-4
    assert build_ds_config(cfg, cfg.stages[0], 2, 64)["optimizer"]["params"]["lr"] == cfg.optim.lr


def test_offload_switches():
    cfg = load_config("tiny", ["deepspeed.offload_param=false", "deepspeed.offload_optimizer=false"])
    z = build_ds_config(cfg, cfg.stages[0], 2, 64)["zero_optimization"]
    assert "offload_param" not in z and "offload_optimizer" not in z
    cfg = load_config("tiny", ["deepspeed.config=zero2", "deepspeed.offload_param=true"])
    with pytest.raises(ConfigError, match="offload_param needs ZeRO stage 3"):
        build_ds_config(cfg, cfg.stages[0], 2, 64)


def test_ds_config_conflicts_and_unfillable_auto(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}))
    cfg = load_config("tiny", [f"deepspeed.config={bad}"])
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=4 disagrees with the recipe"):
        build_ds_config(cfg, cfg.stages[0], 2, 64)
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}))
    with pytest.raises(ConfigError, match="cannot fill \"auto\" for 'zero_optimization.sub_group_size'"):
        build_ds_config(cfg, cfg.stages[0], 2, 64)
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"ds.json:1: invalid JSON"):
        build_ds_config(cfg, cfg.stages[0], 2, 64)
    with pytest.raises(ConfigError, match="unknown DeepSpeed config 'zero4'"):
        build_ds_config(load_config("tiny", ["deepspeed.config=zero4"]), cfg.stages[0], 2, 64)


def test_cosine_schedule_without_warmup():
    f = lr_lambda("cosine", total_steps=100)
    assert f(0) == 1.0 and f(50) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)
    g = lr_lambda("cosine", total_steps=100, warmup=10, min_ratio=0.1)
    assert g(0) == pytest.approx(0.1) and g(9) == 1.0 and g(100) == pytest.approx(0.1)
    assert lr_lambda("constant", 10)(7) == 1.0


def test_rope_scaling_per_model():
    qwen = ModelConfig(config={"model_type": "qwen3", "max_position_embeddings": 40960, "rope_theta": 1e6},
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    hf = build_hf_config(qwen)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 4.0
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.max_position_embeddings == 131072
    assert hf.use_cache is False
    llama = ModelConfig(config={"model_type": "llama", "max_position_embeddings": 131072},
                        rope_scaling=load_config("llama3_1_8b").model.rope_scaling)
    hf = build_hf_config(llama)
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["factor"] == 8.0
    assert hf.max_position_embeddings == 131072  # never lowered
    plain = build_hf_config(ModelConfig(config={"model_type": "qwen3"}))
    assert plain.rope_parameters["rope_type"] == "default"


def test_models_bypassing_the_attention_registry_are_refused():
    class RemoteCodeModel(torch.nn.Module):
        pass

    with pytest.raises(ConfigError, match="does not route attention through transformers' attention registry"):
        check_attention_routable(RemoteCodeModel(), ModelConfig())


def test_best_checkpoint_order():
    base = {"balanced_accuracy": 0.7, "mcc": 0.4, "val_loss": 1.0}
    assert is_better(base, None)
    assert is_better(dict(base, balanced_accuracy=0.71), base)
    assert not is_better(dict(base, balanced_accuracy=0.69, mcc=0.9), base)
    assert is_better(dict(base, mcc=0.41), base)  # BA tie -> MCC
    assert is_better(dict(base, val_loss=0.9), base)  # BA and MCC tie -> lower loss
    assert not is_better(dict(base, val_loss=math.nan), base)
    assert not is_better(dict(base), base)  # equal is not better: keep the earlier checkpoint


def _saved_bytes(model, tokens: int = 256) -> int:
    """Bytes of the activations the decoder stack saves for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 1000, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, use_cache=False)
    return sum(seen.values())


def test_loaded_model_trains_with_checkpointing(tiny_model_dir):
    """from_pretrained returns eval mode, where transformers skips checkpointing; build_model must not."""
    from longsft.train.model.build import build_model

    path = str(tiny_model_dir())
    on = build_model(ModelConfig(path=path, tokenizer="qwen", dtype="fp32", gradient_checkpointing=True))
    off = build_model(ModelConfig(path=path, tokenizer="qwen", dtype="fp32", gradient_checkpointing=False))
    assert on.training and off.training
    assert _saved_bytes(on) < 0.5 * _saved_bytes(off)


def test_model_sdpa_keeps_cudnn_out_unless_asked(tiny_model_dir):
    """Building a model sets PyTorch's SDPA dispatch of this process from ``model.sdpa_cudnn`` (cuDNN
    would build a graph for each new length): out by default, in when asked."""
    from longsft.train.model.build import build_model

    path, before = str(tiny_model_dir()), torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for asked in (None, True, False):
            torch.backends.cuda.enable_cudnn_sdp(not asked)  # the opposite of what the model must leave
            build_model(ModelConfig(path=path, tokenizer="qwen", dtype="fp32",
                                    **({} if asked is None else {"sdpa_cudnn": asked})))
            assert torch.backends.cuda.cudnn_sdp_enabled() is bool(asked), asked
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
