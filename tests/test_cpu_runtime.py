"""CPU ranks' process settings: huge pages for the large tensors glibc maps (GLIBC_TUNABLES); the CPU's
bf16 support, read from its flags."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from longsft.train.common.cpu_features import bf16_hint, cpu_flags, native_bf16
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


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma
processor\t: 1
flags\t\t: fpu sse2 avx avx2 fma avx512_bf16
"""


def test_cpu_flags_and_the_bf16_hint(tmp_path):
    """The first processor's flags; a bf16 model on a CPU without bf16 dot products is told to use fp32
    (naming the caller's key), and nothing is said for fp32, a GPU, native bf16 or unknown flags."""
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    avx2 = cpu_flags(info)
    assert avx2 == {"fpu", "sse2", "avx", "avx2", "fma"} and native_bf16(avx2) is False
    assert cpu_flags(tmp_path / "missing") is None and native_bf16(None) is None
    hint = bf16_hint(True, False, avx2, "model.dtype")
    assert hint is not None and "model.dtype=fp32 is faster" in hint and "avx512_bf16" in hint
    assert "dtype=fp32" in bf16_hint(True, False, avx2, "dtype")
    amx = avx2 | {"amx_bf16"}
    assert native_bf16(amx) and bf16_hint(True, False, amx, "dtype") is None
    assert bf16_hint(False, False, avx2, "dtype") is None and bf16_hint(True, True, avx2, "dtype") is None
    assert bf16_hint(True, False, None, "dtype") is None
    real = cpu_flags()
    assert real is None or "sse2" in real or platform.machine() != "x86_64"
