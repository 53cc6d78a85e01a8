"""GPU: the `torch` SP backend's attention (forward + backward) vs one SDPA call, bf16, 32K-128K tokens.

    python bench/gpu_attention.py [--smoke]      (one GPU; bench/gpu.sh runs it; --smoke: CPU, tiny shapes)

Shapes of one Qwen3-8B attention layer (32 query heads, 8 KV heads, head dim 128), batch 1, the
same total tokens for every row:

- ``sdpa``: torch's fused causal attention over the whole sequence on one GPU; the row names the
  kernel SDPA picks (``torch._fused_sdp_choice``);
- ``ring sp=1 <kernel>``: longsft's ring attention on one rank (its autograd function: one block
  kernel call forward and one backward), for each CUDA block kernel (cuDNN, flash): what our path
  adds to a kernel call, and which kernel ``parallel.attention_kernel=auto`` should take;
- ``ring sp=8 <kernel>``: the blocks an 8-rank zigzag ring computes, every rank's in turn on this one
  GPU (no transfers: there is one GPU), with the ring's merges and backward: the kernels' efficiency
  at the block sizes a node of 8 GPUs runs. On 8 GPUs each rank does 1/8 of this work at once.

TFLOP/s counts causal attention as 2 * 2 * s^2 * h * d / 2 forward and 2.5x that backward; MFU is
that rate over the GPU's data-sheet dense bf16 peak (machine.NOMINAL_BF16_TFLOPS), goal >= 45% at
>= 32K. Writes bench/results/gpu_attention.json after every row.
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
MFU_GOAL = 0.45


def timed(fn, reps: int):
    """(median seconds of ``reps`` calls after a warm-up, the last call's result)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], result


def ring_blocks(q, k, v, dout, sp: int, kernel) -> torch.Tensor:
    """Forward and backward of every rank's blocks of a zigzag ring of ``sp`` ranks, one rank after
    another (each block's K/V taken from its source rank's shard instead of received), as
    :class:`~longsft.train.parallel.ring._ZigzagRing` computes them. Returns dq."""
    from longsft.train.parallel.kernels import block_bwd, block_fwd, merge_
    from longsft.train.parallel.layout import zigzag_index
    from longsft.train.parallel.ring import block_plan

    s = q.shape[2]
    shards = [zigzag_index(s, sp, r).to(q.device) for r in range(sp)]
    c, scale = s // (2 * sp), q.shape[-1] ** -0.5
    dq = torch.empty_like(q)
    for r in range(sp):
        ql, dl = q[:, :, shards[r]], dout[:, :, shards[r]]
        late = ql[:, :, c:].contiguous()
        out = torch.empty(ql.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(ql.shape[:3], dtype=torch.float32, device=q.device)
        blocks = []
        for step in range(sp):
            src = shards[(r - step) % sp]
            qs, ks, causal, kk, vv, _ = block_plan(r, sp, step, c, 1, k[:, :, src], v[:, :, src], None, None)
            blocks.append((qs, ks, causal, kk, vv))
            bo, bl = block_fwd(kernel, ql if qs.start is None else late, kk, vv, causal, scale)
            if step == 0:
                out.copy_(bo)
                lse.copy_(bl)
            else:
                merge_(out[:, :, qs], lse[:, :, qs], bo, bl)
        out = out.to(q.dtype)
        whole = (dl.contiguous(), ql, out, lse)
        parts = (whole, tuple(t[:, :, c:].contiguous() for t in whole))
        dq_r = torch.zeros(ql.shape, dtype=torch.float32, device=q.device)
        for qs, ks, causal, kk, vv in blocks:
            d_o, q_b, o_b, l_b = parts[qs.start is not None]
            g = block_bwd(kernel, d_o, q_b, kk, vv, o_b, l_b, causal, scale)
            dq_r[:, :, qs].add_(g[0])  # dK/dV would travel home; their cost is in the kernel
        dq[:, :, shards[r]] = dq_r.to(q.dtype)
    return dq


def sdpa_kernel_name(q, k, v) -> str:
    """The kernel torch's SDPA picks for causal GQA attention on these tensors (cudnn, flash, ...)."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
    return next((b.name.lower() for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                           SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if int(b) == choice), str(choice))


def main() -> None:
    from machine import describe, nominal_bf16_tflops

    from longsft.train.parallel.kernels import CPU_KERNEL, CUDNN_KERNEL, FLASH_KERNEL, block_kernel
    from longsft.train.parallel.ring import zigzag_ring_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: a check of this script")
    ap.add_argument("--lengths", type=int, nargs="*", help="tokens per row (default 32K, 64K, 128K)")
    a = ap.parse_args()
    smoke = a.smoke
    assert smoke or torch.cuda.is_available(), "needs a GPU (or --smoke)"
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    h, hk, dh = (4, 2, 16) if smoke else (32, 8, 128)
    lengths, sps, reps = ([256, 512], [2], 1) if smoke else (a.lengths or [32768, 65536, 131072], [8], 2)
    peak = None if smoke else nominal_bf16_tflops(torch.cuda.get_device_name(0))
    kernels = [CPU_KERNEL] if smoke else [CUDNN_KERNEL, FLASH_KERNEL]
    auto = block_kernel(device, dtype, "auto", dh).name
    rows, out = [], ROOT / "bench" / "results" / ("gpu_attention_smoke.json" if smoke else "gpu_attention.json")
    for s in lengths:
        g = torch.Generator(device=device).manual_seed(s)
        q, k, v = (torch.randn(1, n, s, dh, device=device, dtype=dtype, generator=g) for n in (h, hk, hk))
        dout = torch.randn(q.shape, device=device, dtype=dtype, generator=g)
        qg = q.clone().requires_grad_()
        flops = 2 * 2 * s * s * h * dh / 2 * 3.5
        sdpa_kernel = sdpa_kernel_name(q, k, v)

        def sdpa():  # -> dq
            qg.grad = None
            F.scaled_dot_product_attention(qg, k, v, is_causal=True, enable_gqa=True).backward(dout)
            return qg.grad

        def ring(kernel):
            qg.grad = None
            zigzag_ring_attention(qg, k, v, kernel=kernel).backward(dout)
            return qg.grad

        runs = {f"sdpa ({sdpa_kernel})": sdpa}
        for kernel in kernels:
            runs[f"ring sp=1 {kernel.name}"] = lambda kernel=kernel: ring(kernel)
            runs.update({f"ring sp={n} {kernel.name}": (lambda n=n, kernel=kernel: ring_blocks(q, k, v, dout, n, kernel))
                         for n in sps})
        want = sdpa().float()
        for name, fn in runs.items():
            row = {"tokens": s, "run": name, "kernel": name.split()[-1].strip("()")}
            try:
                t, dq = timed(fn, reps)
            except RuntimeError as e:  # a kernel that refuses this shape or GPU: say so, measure the rest
                rows.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "pass": False})
                print(rows[-1], flush=True)
                continue
            err = ((dq.float() - want).norm() / want.norm()).item()
            tflops = flops / t / 1e12
            base = next(r["seconds"] for r in rows if r["tokens"] == s and r["run"].startswith("sdpa")) \
                if not name.startswith("sdpa") else t
            rows.append({**row, "seconds": t, "tflops": tflops, "mfu": tflops / peak if peak else None,
                         "vs_sdpa": base / t, "dq_rel_err": err,  # vs_sdpa > 1: faster than one SDPA call
                         "pass": err < (2e-2 if dtype == torch.bfloat16 else 1e-4)})
            print(rows[-1], flush=True)
            out.write_text(json.dumps({"benchmark": "gpu_attention", "mfu_goal": MFU_GOAL, "nominal_bf16_tflops": peak,
                                       "auto_kernel": auto, "rows": rows, "machine": describe()}, indent=2) + "\n")
        del q, k, v, dout, qg
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("| tokens | run | s (fwd+bwd) | TFLOP/s | MFU | speed vs SDPA | dq rel err |\n|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tokens']} | {r['run']} | {r['error']} | | | | |")
            continue
        mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "–"
        print(f"| {r['tokens']} | {r['run']} | {r['seconds']:.3f} | {r['tflops']:.1f} | {mfu} | {r['vs_sdpa']:.2f} | "
              f"{r['dq_rel_err']:.1e} |")
    print(f"wrote {out}")
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
