"""GPU: the CUDA first-contact checks, each pass/fail with its figures (one GPU, about half a minute).

    python bench/gpu_checks.py           (bench/gpu.sh runs it)
    python bench/gpu_checks.py --smoke   (CPU: every check the CPU can run, as a check of the script;
                                          put tests/liger_cpu on PYTHONPATH for the Liger check)

Fast checks first, each with its own deadline (a slow or hung check is marked timed out and the
others still run), ``started <check>`` and its seconds printed, the results file rewritten after each:

- ``nccl_device``: a one-rank NCCL group refuses a CPU tensor (what the trainer's statistics were)
  and takes one made on ``comm.device()`` (``--smoke``: gloo, which takes both: the code path only);
- ``liger_zero_rows``: Liger's fused loss (real kernel) on a rank with no answer token: loss 0 and zero
  gradients, not a division by zero;
- ``ring``: longsft's ring on one rank (no process group, as ``gpu_attention.py`` calls it) against
  SDPA, forward and backward, Qwen3-8B heads (32 query, 8 K/V, dim 128) at 4K tokens: bf16 and fp16
  through the flash kernel (its backward with undefined ``cum_seq``), fp32 through the memory-efficient
  kernel (padded log-sum-exp); and ``packed_bf16``: packed documents (one-token ones among them) as the
  CUDA kernels take them, one dense piece per document (``train/parallel/doc_blocks.py``; a row of one
  document gives cuDNN its whole-block piece, the others go to flash), against SDPA with the documents' mask;
- ``last_hidden_state``: the loss path's GPU memory at the LM head with ``model.offload_activations``:
  keeping every layer's output (``output_hidden_states=True``) against the last one only; the
  difference should be about layers x tokens x hidden x 2 bytes (8 layers of hidden 1024 at 16K
  tokens, built on the GPU: 256 MiB).
Writes bench/results/gpu_checks.json (``--smoke``: gpu_checks_smoke.json) after every check.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

# seconds each check may take on the GPU (CUDA/NCCL start-up and Triton compiles included), and the
# whole script's budget: bench/gpu.sh gives the step a few seconds more
DEADLINES = {"nccl_device": 10, "liger_zero_rows": 15, "ring": 12, "last_hidden_state": 15}
BUDGET_S = 34
GRACE_S = 3  # a check stuck in native code past its deadline + this: results written, process ends


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
    out["packed_bf16" if device == "cuda" else "packed_float32"] = _packed_ring(device)
    return {**out, "pass": all(r["pass"] for r in out.values())}


def _packed_ring(device: str) -> dict:
    """Packed documents through the ring on one rank (the CUDA kernels: a dense piece per document): row 0
    one document (a piece as large as the block: cuDNN's where it is chosen), row 1 five, two of one token
    (flash's)."""
    from longsft.train.parallel.context import ONE_RANK, Documents
    from longsft.train.parallel.doc_blocks import piece_kernel
    from longsft.train.parallel.kernels import block_kernel
    from longsft.train.parallel.ring import doc_plan, zigzag_ring_attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s = 4096 if device == "cuda" else 256
    lengths = torch.tensor([1, s // 6, 1, s // 2, s - s // 6 - s // 2 - 2])
    docs = torch.stack([torch.zeros(s, dtype=torch.long), torch.repeat_interleave(torch.arange(5), lengths)]).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(2, n, s, 128, device=device, generator=g) for n in (32, 8, 8))
    dout = torch.randn(2, 32, s, 128, device=device, generator=g)
    allowed = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(s, s, dtype=torch.bool,
                                                                              device=device).tril()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=allowed, enable_gqa=True)  # fp32 reference
    want.backward(dout)
    got = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    kernel = block_kernel(device, dtype)
    documents = Documents(docs)
    res = zigzag_ring_attention(*got, docs=documents, kernel=kernel)
    res.backward(dout.to(dtype))
    errs = {"out": rel(res, want), "dq": rel(got[0].grad, ref[0].grad), "dk": rel(got[1].grad, ref[1].grad),
            "dv": rel(got[2].grad, ref[2].grad)}
    used = sorted({piece_kernel(kernel, p, (s, s)).name for p in doc_plan(documents, ONE_RANK)[0]})
    return {"kernel": kernel.name, "piece_kernels": used if not kernel.masks else "masked blocks",
            "documents": [[s], lengths.tolist()], **errs,
            "pass": max(errs.values()) < (1e-4 if dtype == torch.float32 else 2e-2)}


def check_nccl_device(device: str) -> dict:
    import torch.distributed as dist

    from longsft.train.parallel import comm

    backend = "nccl" if device == "cuda" else "gloo"  # gloo (--smoke): takes CPU tensors, the code path only
    os.environ.update(onestep.rendezvous_env())
    dist.init_process_group(backend)
    try:
        try:
            dist.all_reduce(torch.zeros(2))  # the trainer's statistics before comm.py
            cpu_refused = None
        except RuntimeError as e:
            cpu_refused = str(e).splitlines()[0][:200]
        t = torch.ones(2, device=comm.device())
        dist.all_reduce(t)
        summed = t.tolist() == [1.0, 1.0]
        return {"backend": backend, "cpu_tensor_error": cpu_refused, "comm_device": str(comm.device()),
                "pass": summed and (cpu_refused is not None or backend != "nccl")}
    finally:
        dist.destroy_process_group()


def check_liger_zero_rows(device: str) -> dict:
    from longsft.train.model.loss import FusedHeadLoss

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    head = torch.nn.Linear(1024, 151936, bias=False, device=device, dtype=dtype)
    hidden = torch.zeros(0, 1024, device=device, dtype=dtype, requires_grad=True)
    loss = FusedHeadLoss(head)(hidden, torch.zeros(0, dtype=torch.long, device=device))
    loss.backward()
    return {"loss": loss.item(), "head_grad_abs_max": head.weight.grad.abs().max().item(),
            "pass": loss.item() == 0 and not head.weight.grad.any()}


def check_last_hidden_state(device: str) -> dict:
    from longsft.train.config.recipes import load_config
    from longsft.train.model import loss as L
    from longsft.train.model.build import build_model
    from longsft.train.parallel.distributed import Dist, ParallelDims

    layers, hidden, seq = (8, 1024, 16384) if device == "cuda" else (2, 64, 256)
    cfg = load_config("tiny", ["model.dtype=bf16" if device == "cuda" else "model.dtype=fp32",
                               f"model.config.num_hidden_layers={layers}", f"model.config.hidden_size={hidden}",
                               f"model.config.intermediate_size={3 * hidden}", "model.config.head_dim=128"])
    with torch.device(device):  # random initialisation on the GPU, not the CPU
        model = build_model(cfg.model)
    d = Dist(rank=0, local_rank=0, dims=ParallelDims(1, 1), device=torch.device(device))
    batch = onestep.one_sequence(cfg, seq, d, answer=seq // 2)
    at_head = {}
    keep = L.LAST_HIDDEN_STATE
    try:
        for name, setting in (("all_hidden_states", True), ("last_only", keep)):
            L.LAST_HIDDEN_STATE = setting
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()

            def note(*_, name=name):  # memory when the LM head first runs (the end of the model's forward)
                at_head.setdefault(name, torch.cuda.memory_allocated() if device == "cuda" else 0)

            hook = model.get_output_embeddings().register_forward_pre_hook(note)
            try:
                loss, _ = L.token_loss_sum(model, batch, chunk_tokens=1024, offload_activations=True)
            finally:
                hook.remove()
            loss.backward()
    finally:
        L.LAST_HIDDEN_STATE = keep
    saved = at_head["all_hidden_states"] - at_head["last_only"]
    expected = layers * seq * hidden * (2 if device == "cuda" else 4)  # embedding output + L-1 layer outputs
    return {"layers": layers, "tokens": seq, "last_hidden_state_setting": str(keep), "bytes_at_head": at_head,
            "saved_bytes": saved, "expected_bytes": expected,
            "pass": device != "cuda" or abs(saved - expected) < 0.1 * expected}


class CheckTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CheckTimeout()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from machine import describe, write_result

    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    checks = {"nccl_device": check_nccl_device}
    try:
        import liger_kernel  # noqa: F401  (--smoke: tests/liger_cpu on PYTHONPATH)

        checks["liger_zero_rows"] = check_liger_zero_rows
    except ImportError:
        print("liger-kernel is not installed: liger_zero_rows is pending", flush=True)
    checks.update(ring=check_ring, last_hidden_state=check_last_hidden_state)
    results: dict = {}
    out = "gpu_checks_smoke" if a.smoke else "gpu_checks"
    lock = threading.Lock()
    machine: dict = {}

    def save() -> None:  # rewritten after every check: a cut-off run keeps what it checked
        with lock:
            if not machine:  # described once (it imports deepspeed)
                machine.update(describe())
            write_result(out, {"benchmark": "gpu_checks", "device": device, "checks": results,
                               "elapsed_s": time.perf_counter() - t_start, "machine": machine})

    def stuck(name: str, t0: float) -> None:  # the deadline's alarm could not interrupt native code
        results[name] = {"pass": False, "timed_out": True, "elapsed_s": time.perf_counter() - t0,
                         "error": "still running in native code past its deadline: the process ended here"}
        print(f"{name}: stuck past its deadline; ending the process", flush=True)
        save()
        os._exit(124)

    signal.signal(signal.SIGALRM, _alarm)
    for name, fn in checks.items():
        left = BUDGET_S - (time.perf_counter() - t_start) - 1
        limit = min(DEADLINES[name], left) if not a.smoke else 300
        t0 = time.perf_counter()
        if limit < 1:
            results[name] = {"pass": False, "skipped": "no time left in the step's budget", "elapsed_s": 0.0}
            print(f"{name}: skipped (budget spent)", flush=True)
            save()
            continue
        print(f"started {name} (deadline {limit:.0f} s)", flush=True)
        watchdog = threading.Timer(limit + GRACE_S, stuck, (name, t0))
        watchdog.daemon = True
        watchdog.start()
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            results[name] = fn(device)
        except CheckTimeout:
            results[name] = {"pass": False, "timed_out": True, "error": f"over its {limit:.0f} s deadline"}
        except Exception as e:  # a failed check is a result too; the others still run
            results[name] = {"pass": False, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-2000:]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            watchdog.cancel()
        if device == "cuda":
            torch.cuda.empty_cache()
        results[name]["elapsed_s"] = time.perf_counter() - t0
        print(f"{name} ({results[name]['elapsed_s']:.1f} s)", json.dumps(results[name], default=str)[:600], flush=True)
        save()
    failed = [n for n, r in results.items() if not r.get("pass")]
    print(f"failed: {failed or 'none'}; {time.perf_counter() - t_start:.1f} s in all")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
