"""What this CPU computes fast. PyTorch sends bf16 matmuls to oneDNN on CPUs with AVX-512 (bw/vl/dq) or
``avx_ne_convert``, natively with ``avx512_bf16`` or AMX; elsewhere (AVX2 only: AMD Zen 3, older Intel)
it falls back to a path many times slower than fp32 (``bench/cpu_bf16.py``)."""

from __future__ import annotations

from pathlib import Path

from longsft.train.common.compat import mkldnn_bf16

BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_fields(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's ``key: value`` fields of ``cpuinfo`` (empty: no such file, as off Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def bf16_dot(fields: dict[str, str]) -> bool | None:
    """Whether the CPU has bf16 dot-product instructions (x86 ``flags``, Arm ``Features``: ``bf16``);
    None: neither line."""
    flags = fields.get("flags")
    if flags is not None:
        return any(f in flags.split() for f in BF16_DOT_FLAGS)
    features = fields.get("Features")
    return None if features is None else "bf16" in features.split()


def fast_bf16() -> bool | None:
    """Whether bf16 matmuls take a fast path here (PyTorch's own test; None: unknown)."""
    return mkldnn_bf16()


def bf16_hint(bf16: bool, on_cuda: bool, fast: bool | None, key: str) -> str | None:
    """A line for a bf16 model on a CPU where bf16 matmuls take PyTorch's slow path, naming the setting
    ``key`` to change (None: fp32, a GPU, a fast bf16 path, or unknown)."""
    if not bf16 or on_cuda or fast is not False:
        return None
    return (f"bf16 on a CPU without AVX-512 or bf16 instructions: PyTorch's bf16 matmuls run many times slower "
            f"than fp32 here (bench/cpu_bf16.py); {key}=fp32 is faster on this machine")
