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
    from longsft.train.model import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory, tokenizer):
    from longsft.train.sample_data import write_sample_data

    out = tmp_path_factory.mktemp("sample")
    write_sample_data(out, tokenizer, ["512", "1k"], n_per_language=6, n_validation=2)
    return out


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
