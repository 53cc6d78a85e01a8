"""CPU ranks' process settings: huge pages for the large tensors glibc maps (GLIBC_TUNABLES); the CPU's
bf16 support, read from its flags."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from longsft.train.common.cpu_features import bf16_dot, bf16_hint, cpu_fields, fast_bf16
from longsft.train.parallel.distributed import HUGE_PAGES, huge_pages_hint

ROOT = Path(__file__).resolve().parents[1]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODE = THP.read_text() if THP.exists() else ""
GLIBC = platform.libc_ver()
NEW_GLIBC = GLIBC[0] == "glibc" and tuple(map(int, GLIBC[1].split(".")[:2])) >= (2, 35)

# page faults of one fresh 78 MB tensor (the tiny model's [vocab, hidden] embedding gradient)
FAULTS = """
import resource, torch
torch.zeros(151936, 128)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.zeros(151936, 128)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5)
"""


def faults(tunables: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout)


@pytest.mark.skipif(not NEW_GLIBC or "[madvise]" not in MODE, reason="needs glibc >= 2.35 and THP in madvise mode")
def test_huge_pages_setting_cuts_page_faults():
    """What the Makefile and the SLURM script export takes effect: a fresh large tensor faults in huge
    pages, not 4 KiB ones (18,993 faults for 78 MB without it)."""
    without, with_ = faults(None), faults(HUGE_PAGES)
    assert without > 15000, without
    assert with_ * 10 < without, (with_, without)


def test_huge_pages_hint(monkeypatch):
    """A CPU run without the setting is told how to set it, where it would change something."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    hint = huge_pages_hint()
    if NEW_GLIBC and "[madvise]" in MODE:
        assert hint is not None and f"export GLIBC_TUNABLES={HUGE_PAGES}" in hint
    else:
        assert hint is None
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=2:{HUGE_PAGES}")
    assert huge_pages_hint() is None


def test_launchers_set_huge_pages():
    """`make demo`/`make test` and the SLURM script export the same setting, keeping a user's own."""
    assert f"export GLIBC_TUNABLES ?= {HUGE_PAGES}\n" in (ROOT / "Makefile").read_text()
    sbatch = (ROOT / "launch" / "slurm" / "curriculum.sbatch").read_text()
    assert f"export GLIBC_TUNABLES=${{GLIBC_TUNABLES:-{HUGE_PAGES}}}" in sbatch


X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
flags\t\t: fpu sse2 avx avx2 fma avx512_bf16
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"


def test_cpu_fields_and_bf16_instructions(tmp_path):
    """The first processor's fields, x86 ``flags`` and Arm ``Features`` read for bf16 dot products."""
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    (tmp_path / "amx").write_text(X86.replace("avx2 fma\n", "avx2 fma amx_bf16\n", 1))
    x86 = cpu_fields(tmp_path / "x86")
    assert (x86["model name"], x86["cpu family"], x86["model"]) == ("AMD EPYC", "25", "1")
    assert x86["flags"] == "fpu sse2 avx avx2 fma" and bf16_dot(x86) is False  # processor 1's flags not read
    assert bf16_dot(cpu_fields(tmp_path / "amx")) is True and bf16_dot(cpu_fields(tmp_path / "arm")) is True
    assert cpu_fields(tmp_path / "missing") == {} and bf16_dot({}) is None
    if platform.system() == "Linux":
        assert bf16_dot(cpu_fields()) is not None  # this machine's own flags line is found


def test_bf16_hint_cases():
    """A bf16 model where PyTorch's bf16 matmuls are slow is told to use fp32 (naming the caller's key);
    nothing is said for fp32, a GPU, a fast path or an unknown one. PyTorch's own test answers here."""
    hint = bf16_hint(True, False, False, "model.dtype")
    assert hint is not None and "model.dtype=fp32 is faster" in hint
    assert "dtype=fp32 is faster" in bf16_hint(True, False, False, "dtype")
    for args in ((False, False, False), (True, True, False), (True, False, True), (True, False, None)):
        assert bf16_hint(*args, "dtype") is None, args
    assert fast_bf16() in (True, False)
    if platform.machine() == "x86_64" and "avx512bw" in cpu_fields().get("flags", "").split():
        assert fast_bf16() is True  # oneDNN takes bf16 on AVX-512 CPUs
