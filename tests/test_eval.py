"""`longsft eval` / `serve` / `report`: backends against real processes, resume, CIs, comparisons."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port

from longsft.eval.eval_config import EvalConfig, model_config, parse_eval_args
from longsft.train.common.errors import ConfigError
from longsft.train.config.recipes import load_config
from longsft.train.scoring.bootstrap import bootstrap_ci
from longsft.train.scoring.metrics import labels
from longsft.train.scoring.score import load_predictions

CLI = [sys.executable, "-m", "longsft.launch.cli"]
ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def cli(*args, check=True, timeout=300):
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    if check and r.returncode != 0:
        raise AssertionError(f"longsft {' '.join(args)}: {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def data(sample_dir):
    return sample_dir / "512" / "validation.jsonl"


def _eval(model, data, out, *extra):
    return cli("eval", f"model={model}", "tokenizer=qwen", f"data={data}", f"out={out}", "max_new_tokens=12",
               "bootstrap=200", "progress=false", *extra)


def _preds(out, r=0):
    return [json.loads(x) for x in (out / f"predictions_r{r}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_run(tiny_model_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "hf"
    _eval(tiny_model_dir("qwen3"), data, out, "repeats=2")
    return out


def test_hf_backend_writes_scored_predictions_per_repeat(hf_run, data):
    summary = json.loads((hf_run / "eval.json").read_text())
    n = len(data.read_text().splitlines())
    assert summary["n"] == n and summary["repeats"] == 2 and summary["generation"]["failed"] == 0
    assert summary["generation"]["gen_tokens"] > 0 and summary["generation"]["prompt_tokens"] > 0
    assert len(_preds(hf_run, 0)) == len(_preds(hf_run, 1)) == n
    assert [p["prediction"] for p in _preds(hf_run, 0)] == [p["prediction"] for p in _preds(hf_run, 1)]  # greedy
    keys = [json.loads(x)["key"] for x in (hf_run / "generations.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 2 * n


def test_bootstrap_ci_is_seeded_and_matches_a_direct_computation(hf_run):
    scores = json.loads((hf_run / "scores_r0.json").read_text())
    gold, pred = labels(load_predictions(hf_run / "predictions_r0.jsonl"), "wrong")
    assert scores["ci"] == bootstrap_ci(gold, pred, n=200, seed=0)


def test_openai_backend_against_the_tiny_model_served_by_longsft(hf_run, tiny_model_dir, data, tmp_path):
    port = free_port()
    server = subprocess.Popen([*CLI, "serve", f"model={tiny_model_dir('qwen3')}", "tokenizer=qwen", f"port={port}"],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "longsft serve" in server.stdout.readline()  # up and listening
        out = tmp_path / "api"
        _eval("tiny", data, out, "backend=openai", f"base_url=http://127.0.0.1:{port}/v1")
    finally:
        server.terminate()
        server.wait(timeout=30)
    api, hf = _preds(out), _preds(hf_run)
    assert [p["prediction"] for p in api] == [p["prediction"] for p in hf]  # the same model, over HTTP
    gen = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert all(g["prompt_tokens"] > 0 and g["error"] is None for g in gen)


def test_killed_evaluation_resumes_without_generating_anything_twice(hf_run, tiny_model_dir, data, tmp_path):
    out = tmp_path / "killed"
    cmd = [*CLI, "eval", f"model={tiny_model_dir('qwen3')}", "tokenizer=qwen", f"data={data}", f"out={out}",
           "max_new_tokens=12", "bootstrap=200", "progress=false", "repeats=2"]
    p = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gens = out / "generations.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (gens.exists() and len(gens.read_text().splitlines()) >= 3):
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done_before = len(gens.read_text().splitlines())
    n = 2 * len(data.read_text().splitlines())
    assert 3 <= done_before < n
    subprocess.run(cmd, env=ENV, cwd=ROOT, check=True, capture_output=True)
    keys = [json.loads(x)["key"] for x in gens.read_text().splitlines() if x.strip().endswith("}")]
    assert len(keys) == len(set(keys)) == n  # every item once, none twice
    for r in (0, 1):
        assert _preds(out, r) == _preds(hf_run, r)
    assert json.loads((out / "scores_r0.json").read_text()) == json.loads((hf_run / "scores_r0.json").read_text())


def test_failed_generations_are_recorded_scored_invalid_and_retried(data, tmp_path):
    out = tmp_path / "down"
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    _eval("m", data, out, "backend=openai", f"base_url={dead}", "retries=0", "limit=3")
    summary = json.loads((out / "eval.json").read_text())
    assert summary["n"] == 3 and summary["generation"]["failed"] == 3
    assert summary["scores"][0]["invalid_rate"] == 1.0  # in the denominator, not dropped
    assert all("URLError" in p["error"] or "Connection" in p["error"] for p in _preds(out))
    _eval("m", data, out, "backend=openai", f"base_url={dead}", "retries=0", "limit=3")
    assert len((out / "generations.jsonl").read_text().splitlines()) == 6  # the rerun tried them again


def _eval_run(root, name, correct, gold):
    """An eval run folder whose predictions are right exactly where ``correct`` says (scores 1 or 4)."""
    run = root / name
    run.mkdir()
    (run / "eval.json").write_text(json.dumps({"name": name, "invalid_policy": "wrong"}))
    recs = [{"id": f"s{i}", "gold_score": g, "bucket": "16k" if i % 2 else "32k",
             "prediction": json.dumps({"score": g if ok else 5 - g})}  # gold 1 or 4: 5 - g is the other label
            for i, (g, ok) in enumerate(zip(gold, correct))]
    (run / "predictions_r0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_report_compare_of_two_different_runs_has_the_sign_and_size_of_b_minus_a(tmp_path):
    import numpy as np
    from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef

    rng = np.random.default_rng(0)
    gold = [int(g) for g in rng.choice([1, 4], 240)]
    a = _eval_run(tmp_path, "weak", rng.random(240) < 0.6, gold)
    b = _eval_run(tmp_path, "strong", rng.random(240) < 0.9, gold)
    t = [int(g <= 2) for g in gold]

    def metrics(run):
        _, p = labels(load_predictions(run / "predictions_r0.jsonl"))
        return balanced_accuracy_score(t, p), matthews_corrcoef(t, p)

    (ba_a, mcc_a), (ba_b, mcc_b) = metrics(a), metrics(b)
    assert ba_b - ba_a > 0.2
    for first, second, sign in ((a, b, 1), (b, a, -1)):
        out = cli("report", "--compare", str(first), str(second)).stdout
        assert f"{second.name} − {first.name} (240 shared items" in out
        row = next(x for x in out.splitlines() if x.startswith("| all |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].startswith(f"{sign * (ba_b - ba_a):+.3f} [")
        assert cells[4].startswith(f"{sign * (mcc_b - mcc_a):+.3f} [")
        low, high = (float(x) for x in cells[2].split("[")[1].rstrip("]").split(","))
        assert (low > 0 and high > low) if sign > 0 else (high < 0 and low < high)  # the interval is on its side
        assert float(cells[3]) < 0.01  # p-value
        assert {x.split("|")[1].strip() for x in out.splitlines() if x.startswith("| ")} >= {"16k", "32k", "all"}


def test_report_table4_types_heatmap_and_paired_comparison(hf_run, tmp_path):
    r = cli("report", str(hf_run), "--out", str(tmp_path), "--compare", str(hf_run), str(hf_run))
    assert "| run | 512 | all |" in r.stdout and "## Hallucination types" in r.stdout
    assert "| all |" in r.stdout and "+0.000 [+0.000, +0.000] | 1.000" in r.stdout  # a run against itself
    for f in ("eval_report.md", "table4.csv", "types.csv"):
        assert (tmp_path / f).exists()
    assert (tmp_path / "type_recall.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("recipe", ["qwen3_8b", "qwen3_32b", "llama3_1_8b", "glm4_9b", "internlm2_5_20b"])
def test_each_recipe_model_is_evaluated_with_its_own_rope_scaling(recipe):
    got = model_config(EvalConfig(model="/models/x", data="d", recipe=recipe))
    assert got.rope_scaling == load_config(recipe).model.rope_scaling and got.path == "/models/x"
    if recipe.startswith("llama"):  # not the reference script's Qwen YaRN settings
        assert got.rope_scaling["rope_type"] == "llama3" and got.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("args, message", [
    (["data=x.jsonl"], "model= is required"),
    (["model=m", "data={data}", "backend=openai"], "backend=openai needs base_url="),
    (["model=m", "data={data}", "promt=end"], "unknown key 'promt' (did you mean 'prompt'?)"),
    (["model=m", "data=/nope.jsonl"], "data=/nope.jsonl: file not found"),
    (["model=m", "data={data}", "method=ragg"], "'method' must be one of"),
])
def test_bad_eval_arguments(data, args, message):
    args = [a.format(data=data) for a in args]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        parse_eval_args(args)


def test_hf_backend_loads_the_recipe_rope_scaling(tiny_model_dir, tmp_path):
    """What the HF backend builds, not just the config it is given: a base model evaluated with
    recipe=qwen3_8b runs YaRN x4 on its own rope_theta; a checkpoint that carries it already is unchanged."""
    from transformers import AutoConfig

    from longsft.eval.backends import HFBackend

    path = str(tiny_model_dir("qwen3"))
    theta = AutoConfig.from_pretrained(path).rope_parameters["rope_theta"]
    backend = HFBackend(model_config(EvalConfig(model=path, data="d", recipe="qwen3_8b", tokenizer="qwen")), 4,
                        dtype="fp32")
    rope = backend.model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["rope_theta"] == theta
    assert backend.model.model.rotary_emb.rope_type == "yarn" and backend.model.model.rotary_emb.attention_scaling > 1
    backend.model.save_pretrained(tmp_path / "trained")
    again = HFBackend(model_config(EvalConfig(model=str(tmp_path / "trained"), data="d", recipe="qwen3_8b",
                                              tokenizer="qwen")), 4, dtype="fp32")
    assert again.model.config.rope_parameters == rope
    assert backend.generate("Hello").gen_tokens > 0
    # every prefill batch is a new shape: cuDNN is kept out of SDPA unless the recipe's model section asks
    import dataclasses

    import torch

    assert not torch.backends.cuda.cudnn_sdp_enabled()
    cfg = dataclasses.replace(model_config(EvalConfig(model=path, data="d", tokenizer="qwen")), sdpa_cudnn=True)
    try:
        HFBackend(cfg, 4, dtype="fp32")
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the backends above left it


def test_hf_backend_says_when_bf16_is_slow_on_this_cpu(tiny_model_dir, capsys, monkeypatch):
    """`longsft eval`/`serve` with dtype=bf16 where PyTorch's CPU bf16 matmuls are slow say fp32 is faster
    there (the test answered both ways); with a fast path, or in fp32, nothing is said."""
    import torch

    from longsft.eval import backends

    cfg = model_config(EvalConfig(model=str(tiny_model_dir("qwen3")), data="d", recipe="tiny", tokenizer="qwen"))
    for fast in (False, True):
        monkeypatch.setattr(backends, "fast_bf16", lambda fast=fast: fast)
        assert backends.HFBackend(cfg, 4, dtype="bf16").model.dtype == torch.bfloat16
        said = "dtype=fp32 is faster on this machine" in capsys.readouterr().err
        assert said == (not fast and not torch.cuda.is_available()), fast
    monkeypatch.setattr(backends, "fast_bf16", lambda: False)
    backends.HFBackend(cfg, 4, dtype="fp32")
    assert "dtype=fp32 is faster" not in capsys.readouterr().err


@pytest.mark.parametrize("recipe, model_json", [("qwen3_8b", "Qwen3-8B.json"),
                                                ("llama3_1_8b", "Llama-3.1-8B-Instruct.json")])
def test_vllm_rope_override_keeps_the_models_rope_theta(tmp_path, recipe, model_json):
    """vLLM sets a dict override on the HF config as it is (setattr). A ``rope_scaling`` override
    drops rope_theta under transformers 5; the merged ``rope_parameters`` keeps it."""
    import shutil

    from transformers import AutoConfig

    from longsft.eval.backends import vllm_engine_args

    shutil.copy(ROOT / "recipes" / "models" / model_json, tmp_path / "config.json")
    cfg = EvalConfig(model=str(tmp_path), data="d", recipe=recipe, tokenizer="qwen", tensor_parallel=2)
    args = vllm_engine_args(model_config(cfg), cfg.max_model_len, cfg.tensor_parallel)
    assert args["tensor_parallel_size"] == 2 and "max_model_len" not in args and args["tokenizer"] is None
    assert vllm_engine_args(model_config(cfg), 65536)["max_model_len"] == 65536
    scaling = load_config(recipe).model.rope_scaling
    hf = AutoConfig.from_pretrained(tmp_path)
    theta = hf.rope_parameters["rope_theta"]
    for key, value in args["hf_overrides"].items():
        setattr(hf, key, value)
    assert hf.rope_parameters["rope_theta"] == theta and hf.rope_parameters["rope_type"] == scaling["rope_type"]
    assert hf.rope_parameters["factor"] == scaling["factor"]
    old = AutoConfig.from_pretrained(tmp_path)
    old.rope_scaling = dict(scaling)  # what the backend passed before
    assert old.rope_parameters.get("rope_theta") is None, "transformers no longer drops rope_theta here"


def test_vllm_settings_are_checked(data):
    cfg = parse_eval_args(["model=m", f"data={data}", "backend=vllm", "max_model_len=65536", "tensor_parallel=2"])
    assert cfg.max_model_len == 65536 and cfg.tensor_parallel == 2
    with pytest.raises(ConfigError, match="tensor_parallel=0 must be >= 1"):
        parse_eval_args(["model=m", f"data={data}", "tensor_parallel=0"])
    with pytest.raises(ConfigError, match="max_model_len=-1 must be >= 0"):
        parse_eval_args(["model=m", f"data={data}", "max_model_len=-1"])
