"""Describe the machine a benchmark ran on (goes into every results JSON)."""

import os
import platform


def describe() -> dict:
    import torch
    import transformers

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None

    from longsft.train.common.cpu_features import bf16_dot, cpu_fields, fast_bf16

    fields = cpu_fields()
    mem = next((int(line.split()[1]) // 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), None)
    info = {"cpu": fields.get("model name") or platform.processor(), "cores": os.cpu_count(), "memory_gib": mem,
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": ds_version,
            "transformers": transformers.__version__,
            # the model name alone ("AMD EPYC") does not tell the CPUs apart whose bf16 figures differ many
            # times (bench/cpu_bf16.py): family/model, PyTorch's vector ISA, its bf16 path, bf16 instructions
            "cpu_family_model": f"{fields.get('cpu family')}/{fields.get('model')}" if "cpu family" in fields else None,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "onednn_bf16": fast_bf16(),
            "bf16_dot_instructions": bf16_dot(fields)}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    if os.environ.get("GLIBC_TUNABLES"):  # huge pages for CPU tensors (the Makefile's default) change CPU figures
        info["glibc_tunables"] = os.environ["GLIBC_TUNABLES"]
    return info


# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets: the usual MFU denominator.
NOMINAL_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "GH200": 989.4, "H100 NVL": 835.0,
                       "H100 PCIe": 756.0, "A100": 312.0, "L40S": 362.1, "B200": 2250.0, "B100": 1750.0}


def nominal_bf16_tflops(gpu_name: str) -> float | None:
    """The data-sheet dense bf16 peak of a GPU named like ``torch.cuda.get_device_name()`` (None: unknown)."""
    for key, tflops in NOMINAL_BF16_TFLOPS.items():
        if all(word in gpu_name for word in key.split()):
            return tflops
    return None


def bad_result_name(name: str) -> str | None:
    """Why ``name`` cannot name a results file (``bench/results/<name>.json``: a plain file name, nothing that
    leads out of that folder), or None."""
    if not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        return f"--json {name!r}: a plain file name (no folder, not starting with '.'): bench/results/<name>.json"
    return None


def write_result(name: str, result: dict, quiet: bool = False) -> None:
    """``bench/results/<name>.json`` (the machine described), and say where (``quiet``: not). Written whole or
    not at all (a temporary file renamed): a run cut off while it rewrites its partial results keeps the last."""
    import json
    import os
    from pathlib import Path

    if bad_result_name(name):
        raise ValueError(bad_result_name(name))
    out = Path(__file__).parent / "results" / f"{name}.json"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # (its own: a --report beside a run must not race it)
    tmp.write_text(json.dumps({**result, "machine": result.get("machine") or describe()}, indent=2) + "\n")
    os.replace(tmp, out)
    if not quiet:
        print(f"\nwrote {out}")
