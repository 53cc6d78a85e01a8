"""Architectures whose attention longsft's sequence-parallel (or packed) attention would compute
differently are refused before training, naming the quirk; the paper's models are not."""

import pytest
import torch
from transformers import AutoConfig

from longsft.train.common.errors import ConfigError
from longsft.train.config.recipes import load_config
from longsft.train.model.build import check_attention_quirks
from longsft.train.training.preflight import check_model

LONGROPE = {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 16},
            "original_max_position_embeddings": 4096, "max_position_embeddings": 131072, "hidden_size": 256,
            "num_attention_heads": 8}


@pytest.mark.parametrize("model_type, overrides, named", [
    ("mistral", {"sliding_window": 4096}, "sliding_window=4096 (set model.config.sliding_window=null"),
    ("gemma2", {}, "sliding_window=4096 on its sliding_attention layers; attn_logit_softcapping=50.0"),
    ("gemma3_text", {}, "sliding_window=4096 on its sliding_attention layers"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type=dynamic"),
    ("phi3", LONGROPE, "rope_type=longrope"),
], ids=["mistral-sliding", "gemma2", "gemma3", "dynamic-ntk", "phi3-longrope"])
def test_a_quirk_the_sp_attention_does_not_apply_is_refused(model_type, overrides, named):
    hf = AutoConfig.for_model(model_type, **overrides)
    with pytest.raises(ConfigError, match="longsft's attention would train a different model") as e:
        check_attention_quirks(hf, sp_size=2, packing=False)
    assert named in str(e.value) and "parallel.sp_size=1" in str(e.value)
    check_attention_quirks(hf, sp_size=1, packing=False)  # the model's own attention: fine


def test_packing_refuses_windows_but_not_rope():
    check_attention_quirks(AutoConfig.for_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 1, True)
    with pytest.raises(ConfigError, match="with data.packing=true .* sliding_window=4096"):
        check_attention_quirks(AutoConfig.for_model("mistral", sliding_window=4096), 1, True)


@pytest.mark.parametrize("model_type, overrides", [
    ("mistral", {"sliding_window": None}), ("qwen2", {}), ("qwen3", {}), ("phi3", {}), ("glm4", {}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}),
])
def test_plain_attention_passes(model_type, overrides):
    check_attention_quirks(AutoConfig.for_model(model_type, **overrides), sp_size=2, packing=True)


def test_the_run_refuses_it_at_start_up():
    cfg = load_config("tiny", ["model.config.model_type=mistral", "model.config.sliding_window=64"])
    with pytest.raises(ConfigError, match="model type mistral: with parallel.sp_size>1 .* sliding_window=64"):
        check_model(cfg)
    check_model(load_config("tiny", ["model.config.model_type=mistral", "model.config.sliding_window=null"]))


def test_the_attention_itself_refuses_a_quirk_it_is_handed():
    """A new transformers release may pass a quirk the start-up check does not know: the forward fails."""
    from longsft.train.parallel.attention import SPAttention

    q, entry = torch.randn(1, 2, 8, 4), SPAttention()
    with entry.active(doc_ids=torch.zeros(1, 8, dtype=torch.long)), pytest.raises(ValueError, match="sliding_window=4"):
        entry.forward(torch.nn.Identity(), q, q, q, None, sliding_window=4)
    with entry.active(doc_ids=torch.zeros(1, 8, dtype=torch.long)), pytest.raises(ValueError, match="softcap=50.0"):
        entry.forward(torch.nn.Identity(), q, q, q, None, softcap=50.0)


def test_padding_is_refused_for_a_rope_of_the_largest_position():
    """Padding raises a row's largest position, from which dynamic and longrope take their frequencies:
    a forced ``parallel.pad_multiple`` is refused for them at start-up; auto pads nothing there."""
    keys = ["model.config.model_type=llama", "model.config.rope_scaling={rope_type: dynamic, factor: 2.0}",
            "parallel.sp_size=1"]
    with pytest.raises(ConfigError, match=r"parallel.pad_multiple=64: this model's rope_type=dynamic takes its "):
        check_model(load_config("tiny", [*keys, "parallel.pad_multiple=64"]))
    check_model(load_config("tiny", [*keys, "parallel.pad_multiple=auto"]))
    check_model(load_config("tiny", ["parallel.sp_size=1", "parallel.pad_multiple=64"]))  # qwen3: a static rope
