"""GPU: what a new shape costs each attention kernel, the model's own SDPA (cuDNN allowed or kept out)
and the ring's block kernels, over lengths that vary as unpacked samples do.

    python bench/gpu_sdpa_shapes.py [--smoke]      (one GPU; bench/gpu.sh runs it; --smoke: CPU, tiny shapes)

cuDNN's attention builds an execution graph for every new shape and keeps it for the process; flash
and the memory-efficient kernel build nothing. Each row runs its calls over ``n`` lengths it has not
seen (after one warm-up call at another length), then over the same lengths again: ``first_s`` minus
``again_s`` over ``n`` is what a new shape costs. Rows:

- ``train``: the model's own attention in training, SmolLM2-135M's heads (9 query, 3 KV, head dim 64),
  batch 1, no mask (causal, grouped K/V): forward and backward, 1K-2K tokens (issue 34's GPU run);
- ``prefill``: a generation batch's prefill, 8 left-padded prompts with a boolean mask, K/V heads
  repeated (as transformers does with a mask): forward only;
- ``ring``: longsft's ring on one rank with each block kernel (cuDNN, flash), Qwen3-8B's heads, 16K-17K
  tokens: the same question for ``parallel.attention_kernel``.

``sdpa`` rows run with ``model.sdpa_cudnn`` true (PyTorch's choice: cuDNN first on Hopper/Blackwell) and
false (longsft's default, :mod:`longsft.train.model.sdpa`), and name the kernel PyTorch picked. Each
pair's outputs (dq, or the prefill's output) are compared. Writes bench/results/gpu_sdpa_shapes.json
(``_smoke`` on CPU) after every row; no FLOP figures (the point is the fixed cost of a shape).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
BUDGET_S = 30  # the last row to start by then (bench/gpu.sh gives the step 45 s; the longest row, the cuDNN
# ring's new 16K shapes, is expected to take a few seconds)


def sync() -> None:
    """Wait for the GPU's queued work (timings end there); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_picked(q, k, v, mask, gqa: bool) -> str:
    """The kernel PyTorch's SDPA dispatch picks for these tensors under the current flags."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, mask is None, enable_gqa=gqa)
    known = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    return next((b.name.lower() for b in known if int(b) == choice), str(choice))  # (SDPBackend is no iterable)


def passes(call, lengths: list[int]) -> tuple[float, float, torch.Tensor]:
    """(seconds over ``lengths`` first seen, seconds over the same again, the first length's result)."""
    times, first = [], None
    for _ in range(2):
        t0 = time.perf_counter()
        for s in lengths:
            out = call(s)
            first = out if first is None else first
        sync()
        times.append(time.perf_counter() - t0)
    return times[0], times[1], first


def inputs(s: int, heads: int, kv: int, dim: int, batch: int, device, dtype, grad: bool):
    """q [batch, heads, s, dim], k and v [batch, kv, s, dim], seeded by ``s``; q requires grad if ``grad``."""
    g = torch.Generator(device=device).manual_seed(s)
    q, k, v = (torch.randn(batch, n, s, dim, device=device, dtype=dtype, generator=g) for n in (heads, kv, kv))
    return q.requires_grad_(grad), k, v


def span(first: int, step: int, n: int) -> list[int]:
    """``n`` lengths from ``first``, ``step`` apart."""
    return [first + i * step for i in range(n)]


def main() -> None:
    t_all = time.time()
    from machine import describe

    from longsft.train.model.sdpa import use_sdpa_cudnn
    from longsft.train.parallel.kernels import CPU_KERNEL, CUDNN_KERNEL, FLASH_KERNEL
    from longsft.train.parallel.ring import zigzag_ring_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: a check of this script")
    smoke = ap.parse_args().smoke
    if not smoke and not torch.cuda.is_available():
        print("gpu_sdpa_shapes.py: needs a GPU (or --smoke)", file=sys.stderr)
        sys.exit(2)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    n = 3 if smoke else 12
    small = (9, 3, 64) if not smoke else (3, 1, 16)
    big = (32, 8, 128) if not smoke else (4, 2, 16)
    rows = []
    out = ROOT / "bench" / "results" / ("gpu_sdpa_shapes_smoke.json" if smoke else "gpu_sdpa_shapes.json")

    def train(s, heads=small):  # -> dq
        """One training attention call, forward and backward."""
        q, k, v = inputs(s, *heads, 1, device, dtype, True)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        return q.grad

    def prefill(s, heads=small, batch=8):  # -> out
        """One generation batch's prefill: left-padded prompts, a boolean mask, K/V heads repeated."""
        q, k, v = inputs(s, *heads, batch, device, dtype, False)
        k, v = (t.repeat_interleave(heads[0] // heads[1], dim=1) for t in (k, v))
        pad = torch.arange(s, device=device)[None, :] >= (torch.arange(batch, device=device) * 7)[:, None]
        mask = (pad[:, None, None, :] & torch.ones(s, s, dtype=torch.bool, device=device).tril())
        mask[..., 0] |= ~pad[:, None, :]  # a padding row attends to the first column (no empty row)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def ring(s, kernel):  # -> dq
        """longsft's ring on one rank with ``kernel``, forward and backward."""
        q, k, v = inputs(s, *big, 1, device, dtype, True)
        zigzag_ring_attention(q, k, v, kernel=kernel).sum().backward()
        return q.grad

    def record(row: dict) -> None:
        """Add ``row`` and write the results file whole (a cut-off step keeps its rows)."""
        rows.append(row)
        print(row, flush=True)
        out.write_text(json.dumps({"benchmark": "gpu_sdpa_shapes", "rows": rows, "machine": describe(),
                                   "note": "first_s: calls at lengths not seen before; again_s: the same calls "
                                           "again; new_shape_s = (first_s - again_s) / n"}, indent=2) + "\n")

    def measure(name: str, call, lengths: list[int], warm: int, picked: str, **extra) -> torch.Tensor | None:
        """Time ``call`` over ``lengths`` twice after a warm-up at ``warm``; the row, and the first result."""
        if time.time() - t_all > BUDGET_S:
            record({"row": name, "skipped": "out of time"})
            return None
        call(warm)
        sync()
        first, again, result = passes(call, lengths)
        record({"row": name, "kernel": picked, "n": len(lengths), "lengths": [lengths[0], lengths[-1]],
                "first_s": round(first, 4), "again_s": round(again, 4),
                "new_shape_s": round((first - again) / len(lengths), 4), **extra})
        return result

    def compare(a, b, row: str) -> None:  # b: the last row's result; a: ``row``'s
        if a is not None and b is not None:
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            rows[-1].update({"rel_err_vs": row, "rel_err": err, "pass": err < tol})
            record(rows.pop())

    base = 64 if smoke else 1024

    def sdpa_pair(name: str, call, lengths: list[int], warm: int, masked: bool) -> None:
        """The model's own SDPA over ``lengths`` with cuDNN kept out, then allowed; outputs compared."""
        results = {}
        for cudnn in (False, True):  # cuDNN last: the graphs it builds stay in this process
            use_sdpa_cudnn(cudnn)
            q, k, v = inputs(lengths[0], *small, 8 if masked else 1, device, dtype, not masked)
            if masked:
                k, v = (t.repeat_interleave(small[0] // small[1], dim=1) for t in (k, v))
            mask = torch.ones(q.shape[0], 1, q.shape[2], q.shape[2], dtype=torch.bool, device=device) \
                if masked else None
            picked = kernel_picked(q, k, v, mask, not masked)
            results[cudnn] = measure(f"{name} sdpa_cudnn={str(cudnn).lower()}", call, lengths, warm, picked)
        compare(results[False], results[True], f"{name} sdpa_cudnn=false")
        use_sdpa_cudnn(False)

    # the order of what matters most: issue 34's training, the ring of the main job, then generation's prefill
    sdpa_pair("train", train, span(base, 5 if smoke else 83, n), base - 8, False)
    lengths = span(64 if smoke else 16384, 8 if smoke else 96, max(2, n // 2))
    kernels = [CPU_KERNEL] if smoke else [FLASH_KERNEL, CUDNN_KERNEL]
    results = {k.name: measure(f"ring sp=1 {k.name}", lambda s, k=k: ring(s, k), lengths, lengths[0] - 16, k.name)
               for k in kernels}
    if not smoke:
        compare(results[FLASH_KERNEL.name], results[CUDNN_KERNEL.name], f"ring sp=1 {FLASH_KERNEL.name}")
    sdpa_pair("prefill", prefill, span(base + 512, 3 if smoke else 41, n), base + 500, True)
    print("| row | kernel | n | first pass s | again s | per new shape s |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "skipped" not in r:
            print(f"| {r['row']} | {r['kernel']} | {r['n']} | {r['first_s']:.3f} | {r['again_s']:.3f} | "
                  f"{r['new_shape_s']:.4f} |")
    print(f"wrote {out}")
    sys.exit(0 if all(r.get("pass", True) for r in rows) else 1)


if __name__ == "__main__":
    main()
