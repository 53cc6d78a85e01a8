"""ZeRO-3 (+ CPU offload) on 2 ranks over gloo equals one plain-torch process.

The global batch (2 ranks x grad_accum 2, answers of different lengths) is the same in both;
the loss is the token mean over the whole global batch, so any mistake in the scaling against
DeepSpeed's gradient averaging or accumulation shows up as a factor in loss or gradients.
"""

import pytest
import torch

from conftest import ROOT, torchrun

SCRIPT = str(ROOT / "tests" / "dist" / "step_grads.py")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("model")
    cfg = AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["zero3_offload", "zero3"])
def test_two_rank_step_equals_single_process(tmp_path, tiny_model_dir, sample_dir, ds_config):
    data = str(sample_dir / "512" / "train.jsonl")
    common = ["optim.grad_accum=2", f"deepspeed.config={ds_config}", "model.gradient_checkpointing=true"]
    ref, ds = tmp_path / "ref.pt", tmp_path / "ds.pt"
    torchrun([SCRIPT, "ref", str(tiny_model_dir), data, str(ref), "2", *common], nproc=1)
    torchrun([SCRIPT, "ds", str(tiny_model_dir), data, str(ds), "2", *common], nproc=2)
    a, b = torch.load(ref), torch.load(ds)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert set(a["grads"]) == set(b["grads"])
    for name, g in a["grads"].items():
        err = (b["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-5, f"{name}: relative gradient error {err:.2e}"
