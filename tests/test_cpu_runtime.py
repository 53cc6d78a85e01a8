"""CPU ranks' process settings: huge pages for the large tensors glibc maps (GLIBC_TUNABLES)."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

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
