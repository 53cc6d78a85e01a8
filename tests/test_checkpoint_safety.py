"""A run directory is data, not code: a planted pickle is refused (and never runs), resuming still
round-trips exactly, and exported models are inference-ready and readable by colleagues (umask).

The runs are the real CLI on one process (ZeRO-3 + CPU offload over gloo, the tiny recipe).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, TEST_OVERRIDES, assert_same_run, torchrun

from longsft.train.common.errors import DataError
from longsft.train.common.io import UMASK
from longsft.train.parallel.distributed import Dist, ParallelDims
from longsft.train.training import checkpoint
from longsft.train.training.preempt import EXIT_STOPPED, STOP_FILE

LAUNCH = str(ROOT / "launch" / "curriculum.py")
ARGS = ["recipe=tiny", "parallel.sp_size=1", *TEST_OVERRIDES[:-1],
        "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 3, validate: false}]"]
OPTIM, MODEL = "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _train(run_dir, check=True):
    return torchrun([LAUNCH, f"run_dir={run_dir}", *ARGS], nproc=1, check=check, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(reference run of 3 steps, the same run stopped on request after step 1 with its checkpoint), umask 022."""
    root = tmp_path_factory.mktemp("safety")
    ref, stopped = root / "ref", root / "stopped"
    old = os.umask(0o022)
    try:
        _train(ref)
        stopped.mkdir()  # a run directory (its config) with a stop already requested
        (stopped / "config.yaml").write_text((ref / "config.yaml").read_text().replace(str(ref), str(stopped)))
        (stopped / STOP_FILE).touch()
        r = _train(stopped, check=False)
    finally:
        os.umask(old)
    assert r.returncode == EXIT_STOPPED, r.stderr[-3000:]
    return ref, stopped


def _clone(src, dst):
    """A copy of run dir ``src``: checkpoint files hard-linked (nothing writes them in place)."""
    link = lambda a, b: os.link(a, b) if a.endswith((".pt", ".safetensors")) else shutil.copy2(a, b)  # noqa: E731
    shutil.copytree(src, dst, copy_function=link)
    cfg = dst / "config.yaml"
    cfg.write_text(cfg.read_text().replace(str(src), str(dst)))
    return dst / "stages" / "a" / "ckpt" / "step_0000001"


class Planted:
    """What an attacker writes: unpickling it runs a shell command (here: creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _plant(path, marker):
    """Replace ``path`` with a pickle that runs code, and fix the manifest as an attacker could."""
    path.unlink(missing_ok=True)  # a new file: the hard-linked original stays intact
    torch.save({"optimizer_state_dict": Planted(marker), "python": Planted(marker)}, path)
    manifest = json.loads((path.parent / checkpoint.MANIFEST).read_text())
    manifest["files"] = {p.name: p.stat().st_size for p in path.parent.iterdir() if p.name != checkpoint.MANIFEST}
    (path.parent / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_resume_round_trips(runs, tmp_path):
    ref, stopped = runs
    tag = _clone(stopped, tmp_path / "run")
    assert sorted(p.name for p in tag.iterdir()) == sorted([checkpoint.MANIFEST, "rng_rank00000.safetensors", MODEL,
                                                           OPTIM])
    r = _train(tmp_path / "run")
    assert f"resumed from {tag} at step 1" in r.stdout
    assert_same_run(ref, tmp_path / "run", "a")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rng_rank00000.pt", MODEL, OPTIM])
def test_planted_pickle_is_refused_and_never_runs(runs, tmp_path, name):
    tag = _clone(runs[1], tmp_path / "run")
    marker = tmp_path / "PWNED"
    _plant(tag / name, marker)
    r = _train(tmp_path / "run", check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"longsft: {tag / name}: refused to load: its pickle names posix.system" in r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()
    assert tag.is_dir()  # left for inspection


def test_loaders_refuse_a_planted_pickle_by_themselves(tmp_path):
    """Behind the scan (:func:`checkpoint.vet`): the loads themselves are weights_only."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker, bad = tmp_path / "PWNED", tmp_path / "rng_rank00000.pt"
    torch.save({"python": Planted(marker)}, bad)

    class Engine:  # the two things safe_loading asks of a DeepSpeedEngine
        checkpoint_engine = TorchCheckpointEngine()

        def load_universal_checkpoint(self):
            return False

    engine = Engine()
    checkpoint.safe_loading(engine)
    checkpoint.safe_loading(engine)  # idempotent
    with pytest.raises(DataError, match=f"{bad}: refused to load: its pickle names posix.system"):
        engine.checkpoint_engine.load(str(bad), map_location="cpu")
    with pytest.raises(DataError, match=f"{bad}: refused to load"):
        checkpoint._load_rng(tmp_path, 0)
    with pytest.raises(DataError, match=f"{bad}: refused to load"):
        checkpoint.vet(tmp_path)
    assert not marker.exists()


def test_safe_loading_refuses_what_it_does_not_know(monkeypatch):
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from longsft.train.common import compat
    from longsft.train.common.errors import ConfigError

    class Engine:
        def __init__(self, ce, universal=False):
            self.checkpoint_engine, self.universal = ce, universal

        def load_universal_checkpoint(self):
            return self.universal

    class Other(TorchCheckpointEngine):
        pass

    with pytest.raises(ConfigError, match="checkpoint engine Other is not supported"):
        checkpoint.safe_loading(Engine(Other()))
    with pytest.raises(ConfigError, match="with load_universal is not supported"):
        checkpoint.safe_loading(Engine(TorchCheckpointEngine(), universal=True))
    monkeypatch.setitem(compat.SUPPORTED, "deepspeed", ">=0.20,<0.21")  # as if the installed one were out of range
    with pytest.raises(ConfigError, match=rf"deepspeed {deepspeed.__version__}: longsft loads DeepSpeed checkpoints "
                                          r"safely only .*; longsft supports deepspeed>=0.20,<0.21"):
        checkpoint.safe_loading(Engine(TorchCheckpointEngine()))


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_state_round_trips_without_pickle(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    random.gauss(0, 1)  # a cached gaussian is part of the state
    checkpoint._save_rng(tmp_path / "rng_rank00000.safetensors")
    expected = _draws()
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    checkpoint._load_rng(tmp_path, 0)
    assert _draws() == expected
    # the previous format (a pickle with numpy arrays) still loads, with weights_only=True
    (tmp_path / "rng_rank00000.safetensors").unlink()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / "rng_rank00000.pt")
    expected = _draws()
    checkpoint._load_rng(tmp_path, 0)
    assert _draws() == expected
    (tmp_path / "rng_rank00001.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{trunc")
    with pytest.raises(DataError, match="rng_rank00001.safetensors: unreadable RNG state"):
        checkpoint._load_rng(tmp_path, 1)


@pytest.mark.slow
def test_outputs_are_inference_ready_and_follow_the_umask(runs):
    from transformers import AutoModelForCausalLM

    ref, stopped = runs
    best = ref / "stages" / "a" / "best"
    for folder in (best, stopped / "stages" / "a" / "ckpt" / "step_0000001"):
        assert oct(folder.stat().st_mode & 0o777) == oct(0o755), folder
        for f in folder.iterdir():
            assert oct(f.stat().st_mode & 0o777) == oct(0o644), f
    assert json.loads((best / "config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(best)
    lengths = []
    model.model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    x = torch.arange(100, 150)[None]
    model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False)
    assert lengths == [50, 1, 1, 1]  # a KV cache: one new token per step, not the whole prefix again


def test_export_keeps_training_config_in_memory(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    class Engine:  # export_hf's view of a DeepSpeed engine without ZeRO-3
        module = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))

        def zero_optimization_partition_weights(self):
            return False

    engine = Engine()
    engine.module.config.use_cache = engine.module.generation_config.use_cache = False
    d = Dist(rank=0, local_rank=0, dims=ParallelDims(1, 1), device=torch.device("cpu"))
    checkpoint.export_hf(engine, tokenizer, d, tmp_path / "best", {"step": 1})
    assert engine.module.config.use_cache is False and engine.module.generation_config.use_cache is False
    assert json.loads((tmp_path / "best" / "config.json").read_text())["use_cache"] is True
    assert json.loads((tmp_path / "best" / "generation_config.json").read_text()).get("use_cache", True) is True
    for p in (tmp_path / "best", *(tmp_path / "best").iterdir()):
        assert p.stat().st_mode & 0o777 == (0o777 if p.is_dir() else 0o666) & ~UMASK, p


def test_a_run_restored_without_weights_is_set_aside_with_its_evaluations(tmp_path, monkeypatch):
    """bench/restore.py (a GPU run's state archive on a fresh machine): a run folder with a state but no
    weights is weightless, one with a checkpoint or exported weights is not; retraining renames the run and
    its evaluations (nothing deleted), twice without clobbering the first."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from restore import retrain, weightless

    run, ev = tmp_path / "run", tmp_path / "eval" / "first"
    (run / "stages" / "a").mkdir(parents=True)
    (run / "state.json").write_text("{}")
    ev.mkdir(parents=True)
    (ev / "generations.jsonl").write_text("{}\n")
    assert weightless(run) and not weightless(tmp_path / "absent")
    (run / "stages" / "a" / "model.safetensors").write_bytes(b"x")
    assert not weightless(run)
    (run / "stages" / "a" / "model.safetensors").unlink()
    retrain(run, [ev, tmp_path / "eval" / "never"])
    assert not run.exists() and (tmp_path / "run.restored" / "state.json").exists()
    assert (tmp_path / "eval" / "first.restored" / "generations.jsonl").exists()
    run.mkdir()
    (run / "state.json").write_text("{}")
    retrain(run, [])
    assert (tmp_path / "run.restored-1" / "state.json").exists() and (tmp_path / "run.restored").exists()


def test_a_run_stopped_by_sigterm_counts_its_cut_phase(tmp_path):
    """bench/wall.py: a benchmark stopped by SIGTERM (gpu_learn.sh's LIMIT) adds the seconds since its last
    finished phase to wall.json's cut_off, keeps the phases it had, twice adds up, and still ends by the
    signal (its status: -SIGTERM), also where the file cannot be read."""
    wall = tmp_path / "wall.json"
    wall.write_text(json.dumps({"data": 1.5}))
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT / 'bench')!r}); from wall import count_cut_off\n"
              f"from pathlib import Path; mark = time.time() - 2.0\n"
              f"count_cut_off(Path({str(wall)!r}), lambda: mark); print('ready', flush=True); time.sleep(60)\n")
    for expected in (2.0, 4.0):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        got = json.loads(wall.read_text())
        assert got["data"] == 1.5 and expected <= got["cut_off"] < expected + 10, got
    wall.write_text("")  # unreadable (never so from write_wall, which replaces it whole): not counted, still ends
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM and wall.read_text() == ""
