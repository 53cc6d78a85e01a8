"""GPU: the CUDA first-contact checks, each pass/fail with its figures (one GPU, under a minute).

    python bench/gpu_checks.py           (bench/gpu.sh runs it)
    python bench/gpu_checks.py --smoke   (CPU: the checks that do not need CUDA, as a check of the script)

- ``ring``: longsft's ring on one rank (no process group, as ``gpu_attention.py`` calls it) against
  SDPA, forward and backward, Qwen3-8B heads (32 query, 8 K/V, dim 128) at 4K tokens: bf16 and fp16
  through the flash kernel (its backward with undefined ``cum_seq``), fp32 through the memory-efficient
  kernel (padded log-sum-exp);
- ``nccl_device``: a one-rank NCCL group refuses a CPU tensor (what the trainer's statistics were)
  and takes one made on ``comm.device()``;
- ``liger_zero_rows``: Liger's fused loss (real kernel) on a rank with no answer token: loss 0 and zero
  gradients, not a division by zero;
- ``last_hidden_state``: the loss path's GPU memory at the LM head with ``model.offload_activations``:
  keeping every layer's output (``output_hidden_states=True``) against the last one only; the
  difference should be about layers x tokens x hidden x 2 bytes.
Writes bench/results/gpu_checks.json.
"""

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check_ring(device: str) -> dict:
    from longsft.train.parallel.kernels import block_kernel
    from longsft.train.parallel.ring import zigzag_ring_attention

    out = {}
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else [torch.float32]
    for dtype in dtypes:
        g = torch.Generator(device=device).manual_seed(0)
        s = 4096 if device == "cuda" else 256
        q, k, v = (torch.randn(1, n, s, 128, device=device, generator=g) for n in (32, 8, 8))
        dout = torch.randn(1, 32, s, 128, device=device, generator=g)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)  # fp32 reference
        want.backward(dout)
        got = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        res = zigzag_ring_attention(*got)
        res.backward(dout.to(dtype))
        errs = {"out": rel(res, want), "dq": rel(got[0].grad, ref[0].grad), "dk": rel(got[1].grad, ref[1].grad),
                "dv": rel(got[2].grad, ref[2].grad)}
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        out[str(dtype).split(".")[1]] = {"kernel": block_kernel(device, dtype).name, **errs,
                                         "pass": max(errs.values()) < tol}
    return out


def check_nccl_device() -> dict:
    import torch.distributed as dist

    from longsft.train.parallel import comm

    os.environ.update(onestep.rendezvous_env())
    dist.init_process_group("nccl")
    try:
        try:
            dist.all_reduce(torch.zeros(2))  # the trainer's statistics before comm.py
            cpu_refused = None
        except RuntimeError as e:
            cpu_refused = str(e).splitlines()[0][:200]
        t = torch.ones(2, device=comm.device())
        dist.all_reduce(t)
        return {"cpu_tensor_error": cpu_refused, "comm_device": str(comm.device()),
                "pass": cpu_refused is not None and t.tolist() == [1.0, 1.0]}
    finally:
        dist.destroy_process_group()


def check_liger_zero_rows() -> dict:
    from longsft.train.model.loss import FusedHeadLoss

    head = torch.nn.Linear(1024, 151936, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.zeros(0, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    loss = FusedHeadLoss(head)(hidden, torch.zeros(0, dtype=torch.long, device="cuda"))
    loss.backward()
    return {"loss": loss.item(), "head_grad_abs_max": head.weight.grad.abs().max().item(),
            "pass": loss.item() == 0 and not head.weight.grad.any()}


def check_last_hidden_state(device: str) -> dict:
    from longsft.train.config import load_config
    from longsft.train.model import loss as L
    from longsft.train.model.build import build_model
    from longsft.train.parallel.distributed import Dist, ParallelDims

    layers, hidden, seq = (28, 1024, 16384) if device == "cuda" else (2, 64, 256)
    cfg = load_config("tiny", ["model.dtype=bf16" if device == "cuda" else "model.dtype=fp32",
                               f"model.config.num_hidden_layers={layers}", f"model.config.hidden_size={hidden}",
                               f"model.config.intermediate_size={3 * hidden}", "model.config.head_dim=128"])
    model = build_model(cfg.model).to(device)
    d = Dist(rank=0, local_rank=0, dims=ParallelDims(1, 1), device=torch.device(device))
    batch = onestep.one_sequence(cfg, seq, d, answer=seq // 2)
    at_head = {}
    keep = L.LAST_HIDDEN_STATE
    for name, setting in (("all_hidden_states", True), ("last_only", keep)):
        L.LAST_HIDDEN_STATE = setting
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        def note(*_, name=name):  # memory when the LM head first runs (inside the loss)
            at_head.setdefault(name, torch.cuda.memory_allocated() if device == "cuda" else 0)

        hook = model.get_output_embeddings().register_forward_pre_hook(note)
        loss, _ = L.token_loss_sum(model, batch, chunk_tokens=1024, offload_activations=True)
        hook.remove()
        loss.backward()
    L.LAST_HIDDEN_STATE = keep
    saved = at_head["all_hidden_states"] - at_head["last_only"]
    expected = layers * seq * hidden * (2 if device == "cuda" else 4)  # embedding output + L-1 layer outputs
    return {"layers": layers, "tokens": seq, "bytes_at_head": at_head, "saved_bytes": saved,
            "expected_bytes": expected, "pass": device != "cuda" or abs(saved - expected) < 0.1 * expected}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    checks = {"ring": lambda: check_ring(device), "last_hidden_state": lambda: check_last_hidden_state(device)}
    if device == "cuda":
        checks.update(nccl_device=check_nccl_device)
        try:
            import liger_kernel  # noqa: F401

            checks.update(liger_zero_rows=check_liger_zero_rows)
        except ImportError:
            print("liger-kernel is not installed: liger_zero_rows is pending")
    results = {}
    for name, fn in checks.items():
        try:
            results[name] = fn()
        except Exception as e:  # a failed check is a result too; the others still run
            results[name] = {"pass": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(name, json.dumps(results[name], default=str)[:600], flush=True)
        if not a.smoke:  # rewritten after every check: a cut-off run keeps what it checked
            from machine import write_result

            write_result("gpu_checks", {"benchmark": "gpu_checks", "checks": results})
    failed = [n for n, r in results.items() if not (r.get("pass") if "pass" in r else all(v["pass"] for v in r.values()))]
    print("failed:", failed or "none")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
