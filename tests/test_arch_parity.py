"""Sequence parallelism trains the same model as one process, for every architecture family longsft
accepts (tiny configs, sp=2 vs one process, both backends), and the trainer's memory planner plans
each one (a trace it cannot run would leave the trainer without a plan). A transformers release that
gives one of them a quirk the SP attention would drop fails here, not in a run; known quirks are
refused at start-up (tests/test_model_quirks.py)."""

import json

import pytest
from conftest import ROOT, torchrun

BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {
    "llama": {"model_type": "llama"},  # also InternLM2.5 and Llama-3.1 (llama3 rope) in Llama format
    "llama-yarn": {"model_type": "llama",  # the static rope scaling the paper's long stages use
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "head_dim": 16},  # q/k norms
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "glm4": {"model_type": "glm4", "head_dim": 16},  # partial, interleaved rotary
    "phi3": {"model_type": "phi3"},  # fused qkv
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "gemma": {"model_type": "gemma", "head_dim": 16},  # scaled embeddings, gelu
}


@pytest.mark.slow
def test_every_family_under_sp2_equals_one_process(tmp_path):
    families = {name: {**BASE, **cfg} for name, cfg in FAMILIES.items()}
    out = tmp_path / "parity.json"
    torchrun([str(ROOT / "tests" / "dist" / "arch_parity.py"), json.dumps(families), str(out)], nproc=2)
    results = json.loads(out.read_text())
    assert {(r["family"], r["backend"]) for r in results} == {(f, b) for f in FAMILIES for b in ("torch", "ulysses")}
    for r in results:
        assert r["params"] and r["loss"] < 1e-6 and r["grad"] < 1e-5, r
        assert r["plan"].startswith("planned peak"), r  # traced, as the trainer plans it
