"""Shared fixtures: the real Qwen tokenizer (built offline once), the tiny recipe's sample data,
and a runner for the real multi-process curriculum."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One cache for the whole session: the converted tokenizer and DeepSpeed's JIT-built ops.
os.environ.setdefault("LONGSFT_CACHE", str(ROOT / ".cache" / "longsft"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))


@pytest.fixture(scope="session")
def tokenizer():
    from longsft.train.model.build import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory, tokenizer):
    from longsft.train.datagen.sample_data import write_sample_data

    out = tmp_path_factory.mktemp("sample")
    write_sample_data(out, tokenizer, ["512", "1k"], n_per_language=6, n_validation=2)
    return out


def skip_or_fail(what: str, why: str | None) -> None:
    """Skip a test whose real dependency (``what``: SLURM daemons, root) is missing here, with ``why``;
    under CI (``LONGSFT_CI=1``, set by ``.ci/run``) fail instead: CI has them, and a skip there would
    let the SLURM and disk-full tests drop out of CI unnoticed."""
    if not why:
        return
    if os.environ.get("LONGSFT_CI") == "1":
        pytest.fail(f"CI must run the {what} tests, but: {why}", pytrace=False)
    pytest.skip(why)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``longsft ARGV`` in this process: (exit status, stdout, stderr); a traceback fails the test."""
    from longsft.launch.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` and its bytes: compare before/after to show nothing was lost."""
    files = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")) if Path(root).is_dir() else [Path(root)]:
            if p.is_file():
                files[str(p)] = p.read_bytes()
    return files


def record_writes(monkeypatch, module) -> list[str]:
    """The paths ``module`` writes through its ``atomic_write_text`` / ``atomic_write_json``, in order (the
    writes still happen)."""
    order = []
    for name in ("atomic_write_text", "atomic_write_json"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda path, *a, _real=real, **k: (order.append(str(path)), _real(path, *a, **k)))
    return order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script_args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node=nproc <script_args>`` in the repo root and return the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           *script_args] if nproc > 1 else [sys.executable, *script_args]
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=e)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    return r


# A small curriculum for tests: the tiny recipe with less data and fewer steps.
TEST_OVERRIDES = ["data.sample_size=4", "validation.max_new_tokens=16", "logging.progress=false",
                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 4, validate: false},"
                  " {name: b, bucket: 1k, seq_len: 1024, max_steps: 4, every_steps: 2}]"]


# Two stages, b checkpointing at steps 2 and 4 (each validation): what the SLURM tests interrupt and resume
TWO_STAGES = [*TEST_OVERRIDES[:-1], ("stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2, validate: false},"
                                     " {name: b, bucket: 1k, seq_len: 1024, max_steps: 4, every_steps: 2}]")]


@pytest.fixture(scope="session")
def two_stage_ref(tmp_path_factory):
    """TWO_STAGES uninterrupted on one node, 2 ranks (sp=2): what every interrupted or multi-node
    2-rank run of it must equal."""
    ref = tmp_path_factory.mktemp("two_stage_ref") / "run"
    torchrun([str(ROOT / "launch" / "curriculum.py"), "recipe=tiny", f"run_dir={ref}", *TWO_STAGES])
    return ref


def steps_logged(run_dir, stage: str) -> int:
    """The highest training step of ``stage`` in ``run_dir``'s metrics so far (0: none yet)."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    steps = [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if m["stage"] == stage and m["kind"] == "train":
            steps.append(m["step"])
    return max(steps)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: a saved tiny random model of an HF architecture (qwen3 or llama; tied LM head or not), built once each."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    made = {}

    def make(arch: str = "qwen3", tied: bool = True, init: float = 0.02):
        """``init``: the weights' std (HF's initializer_range); at 0.02 greedy decoding repeats one token
        whatever the prompt, at 0.5 what it generates depends on the prompt."""
        if (arch, tied, init) not in made:
            out = tmp_path_factory.mktemp(f"model_{arch}{'' if tied else '_untied'}{'' if init == 0.02 else init}")
            extra = {"head_dim": 16} if arch == "qwen3" else {}
            cfg = AutoConfig.for_model(arch, vocab_size=151936, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=tied, initializer_range=init, **extra)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
            made[arch, tied, init] = out
        return made[arch, tied, init]

    return make


def reference_step(model_dir, data, dp: int, overrides: list[str]) -> dict:
    """tests/dist/step_grads.py's plain-PyTorch reference, in this process (no launcher, no DeepSpeed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_grads", ROOT / "tests" / "dist" / "step_grads.py")
    step_grads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_grads)
    return step_grads.reference_step(str(model_dir), str(data), dp, list(overrides))


def compare_steps(ref, got_path, rel_loss=1e-6, rel_grad=1e-5):
    """Assert a reference step (reference_step's dict) and a step_grads.py output agree: loss and every
    parameter gradient."""
    import torch

    a, b = ref, torch.load(got_path)
    assert b["loss"] == pytest.approx(a["loss"], rel=rel_loss)
    assert set(a["grads"]) == set(b["grads"])
    worst = 0.0
    for name, g in a["grads"].items():
        err = ((b["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert err < rel_grad, f"{name}: relative gradient error {err:.2e}"
        worst = max(worst, err)
    return worst


def run_metrics(run_dir, stage: str | None = None) -> dict:
    """metrics.jsonl as {(kind, step): record}, newest record per step (a resumed run re-logs steps)."""
    import json

    recs = (json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    return {(m["kind"], m["step"]): m for m in recs if stage is None or m["stage"] == stage}


def assert_same_run(ref_dir, run_dir, stage: str | None = None) -> None:
    """An interrupted-and-resumed run logged exactly what the uninterrupted one did."""
    ref, got = run_metrics(ref_dir, stage), run_metrics(run_dir, stage)
    assert set(ref) == set(got)
    for key, m in ref.items():
        if key[0] == "train":
            assert got[key]["loss"] == pytest.approx(m["loss"], rel=1e-6), key
        else:
            assert got[key]["balanced_accuracy"] == m["balanced_accuracy"], key
            assert got[key]["val_loss"] == pytest.approx(m["val_loss"], rel=1e-6), key
