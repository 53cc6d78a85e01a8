"""Recipe schema, base inheritance, overrides and their error messages."""

import subprocess
import sys
from pathlib import Path

import pytest

from longsft.train.common.errors import ConfigError
from longsft.train.config.checks import validate
from longsft.train.config.loader import parse_override
from longsft.train.config.recipes import load_config, shipped_recipes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", shipped_recipes())
def test_every_shipped_recipe_loads_and_validates(name):
    cfg = load_config(name)
    validate(cfg)
    assert cfg.recipe == name
    assert [s.name for s in cfg.stages]


def test_paper_recipes_carry_the_paper_settings():
    for name in ("qwen3_8b", "qwen3_14b", "qwen3_32b", "llama3_1_8b", "glm4_9b", "internlm2_5_20b"):
        cfg = load_config(name)
        assert cfg.optim.lr == 5e-6 and cfg.optim.scheduler == "cosine" and cfg.optim.warmup_steps == 0
        assert cfg.seed == 42 and cfg.model.dtype == "bf16" and cfg.model.gradient_checkpointing
        assert cfg.deepspeed.config == "zero3_offload"
        assert cfg.parallel.sp_size == 8 and cfg.parallel.sp_backend == "torch"
        assert [s.bucket for s in cfg.stages] == ["2k", "16k", "32k", "64k", "100k"]
        assert cfg.stages[0].max_steps == 100 and all(s.epochs == 2 for s in cfg.stages[1:])
    # each model gets its own rope scaling (the reference script gave Llama Qwen's)
    assert load_config("qwen3_32b").model.rope_scaling["factor"] == 4.0
    assert load_config("internlm2_5_20b").model.rope_scaling["factor"] == 4.0
    assert load_config("llama3_1_8b").model.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert load_config("glm4_9b").model.rope_scaling is None


def test_yaml_1_2_floats_are_numbers(tmp_path):
    """YAML 1.1 reads 1e-6 as a string; a model config passes it to the model's constructor."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: tiny\nmodel:\n  config:\n    rms_norm_eps: 1e-6\n    rope_theta: 1E+6\n"
                      "    name: 1e-6x\n    version: '1e-6'\n")
    cfg = load_config(str(recipe), ["model.config.initializer_range=2e-2", "optim.lr=-3e-5"])
    c = cfg.model.config
    assert (c["rms_norm_eps"], c["rope_theta"], c["initializer_range"]) == (1e-6, 1e6, 2e-2)
    assert all(isinstance(c[k], float) for k in ("rms_norm_eps", "rope_theta", "initializer_range"))
    assert (c["name"], c["version"], cfg.optim.lr) == ("1e-6x", "1e-6", -3e-5)  # not numbers stay text


def test_overrides_nested_and_list_items():
    cfg = load_config("tiny", ["optim.lr=1e-5", "stages.1.seq_len=8192", "model.config.hidden_size=32",
                               "logging.wandb=true", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.lr == 1e-5
    assert cfg.stages[1].seq_len == 8192 and cfg.stages[0].seq_len == 512
    assert cfg.model.config["hidden_size"] == 32
    assert cfg.logging.wandb is True
    assert cfg.optim.betas == (0.8, 0.9)


def test_override_replaces_whole_stage_list():
    cfg = load_config("tiny", ["stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2}]"])
    assert len(cfg.stages) == 1 and cfg.stages[0].max_steps == 2


@pytest.mark.parametrize("override, needle", [
    ("optim.lrr=1", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("optimm.lr=1", "unknown key 'optimm' (did you mean 'optim'?)"),
    ("stages.0.seqlen=4", "unknown key 'stages.0.seqlen' (did you mean 'stages.0.seq_len'?)"),
    ("optim.lr=fast", "'optim.lr' must be a number, got 'fast'"),
    ("optim.micro_batch_size=1.5", "'optim.micro_batch_size' must be an integer"),
    ("model.dtype=fp16", "'model.dtype' must be one of ['bf16', 'fp32']"),
    ("logging.wandb=maybe", "'logging.wandb' must be true or false"),
    ("stages.9.seq_len=4", "index 9 out of range"),
    ("noequals", "is not key=value"),
])
def test_override_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override] if override != "noequals" else [override])
    assert needle in str(e.value)
    assert f"override {override!r}" in str(e.value) or "index" in needle or "key=value" in needle


def test_recipe_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: tiny\noptim:\n  lr: 1e-3\n  warmpu_steps: 3\n")
    with pytest.raises(ConfigError, match=rf"{bad}:4: unknown key 'optim.warmpu_steps' \(did you mean 'optim.warmup_steps'\?\)"):
        load_config(str(bad))


def test_unknown_recipe_suggests():
    with pytest.raises(ConfigError, match="did you mean 'qwen3_32b'"):
        load_config("qwen3_32")


def test_parse_override_types():
    assert parse_override("a=1") == ("a", 1)
    assert parse_override("a=1.5") == ("a", 1.5)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=x=y") == ("a", "x=y")


def test_launch_typo_fails_fast_with_exit_code(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "curriculum.py"), "recipe=tiny", "optim.lrr=1",
                        f"run_dir={tmp_path}/run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "did you mean 'optim.lr'" in r.stderr
    assert not (tmp_path / "run").exists()
