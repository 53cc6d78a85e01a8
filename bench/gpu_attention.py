"""GPU: throughput of the `torch` SP backend's attention path vs plain SDPA, bf16, 16K-100K tokens.

    python bench/gpu_attention.py            (one GPU; bench/gpu.sh runs it)

Shapes of one Qwen3-8B attention layer (32 query heads, 8 KV heads, head dim 128), batch 1.
`sdpa` is torch's fused causal attention (forward + backward). `ring(sp=1)` is longsft's ring
attention on one rank: the same fused kernels called through our own autograd function (block
forward returning log-sum-exp, fp32 merge, block backward from the final out/lse), so the ratio
is the overhead our path adds to each ring block. TFLOP/s counts causal attention as
2 * 2 * s^2 * h * d / 2 forward and 2.5x that backward. Writes bench/results/gpu_attention.json.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def timed(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    from machine import describe

    from longsft.train.parallel.ring import zigzag_ring_attention

    assert torch.cuda.is_available(), "needs a GPU"
    h, hk, dh = 32, 8, 128
    rows = []
    for s in (16384, 32768, 65536, 102400):
        q = torch.randn(1, h, s, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, hk, s, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, hk, s, dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)

        def sdpa():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

        def ring():
            zigzag_ring_attention(q, k, v).backward(dout)

        flops = 2 * 2 * s * s * h * dh / 2 * 3.5
        t_sdpa, t_ring = timed(sdpa), timed(ring)
        with torch.no_grad():
            err = ((zigzag_ring_attention(q, k, v).float() -
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float()).norm() /
                   F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float().norm()).item()
        rows.append({"tokens": s, "sdpa_s": t_sdpa, "ring_s": t_ring, "sdpa_tflops": flops / t_sdpa / 1e12,
                     "ring_tflops": flops / t_ring / 1e12, "ring_vs_sdpa": t_sdpa / t_ring, "rel_err": err,
                     "pass": err < 2e-2})  # both bf16: rounding only
        out = ROOT / "bench" / "results" / "gpu_attention.json"  # rewritten per row: a cut-off run keeps its rows
        out.write_text(json.dumps({"benchmark": "gpu_attention", "rows": rows, "machine": describe()}, indent=2) + "\n")
        del q, k, v, dout
        torch.cuda.empty_cache()
    print("| tokens | SDPA s | ring(sp=1) s | SDPA TFLOP/s | ring TFLOP/s | ring/SDPA speed | rel err |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['sdpa_s']:.3f} | {r['ring_s']:.3f} | {r['sdpa_tflops']:.0f} | "
              f"{r['ring_tflops']:.0f} | {r['ring_vs_sdpa']:.2f} | {r['rel_err']:.1e} |")
    print(f"wrote {out}")
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
