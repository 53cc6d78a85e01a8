"""What this CPU computes natively. bf16 matmuls keep pace with fp32 only where the CPU has bf16 dot
products (``avx512_bf16``, ``amx_bf16``); elsewhere (AVX2 machines: AMD Zen 3, older Intel) PyTorch
converts and runs them many times slower (``bench/cpu_bf16.py``)."""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's feature flags (None: no such file, as off Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("flags")), None)
    return frozenset(line.split(":", 1)[1].split()) if line else None


def native_bf16(flags: frozenset[str] | None) -> bool | None:
    """Whether ``flags`` include a bf16 dot-product instruction (None: flags unknown)."""
    return None if flags is None else any(f in flags for f in BF16_FLAGS)


def bf16_hint(bf16: bool, on_cuda: bool, flags: frozenset[str] | None, key: str) -> str | None:
    """A line for a bf16 model on a CPU without bf16 dot products, naming the setting ``key`` to change
    (None: fp32, a GPU, native bf16, or flags unknown)."""
    if not bf16 or on_cuda or native_bf16(flags) is not False:
        return None
    return ("bf16 on a CPU without bf16 dot products (no " + " or ".join(BF16_FLAGS) + "): its matmuls run many "
            f"times slower than fp32 here (bench/cpu_bf16.py); {key}=fp32 is faster on this machine")
