"""GPU: Liger's fused linear cross-entropy against longsft's chunked loss (values, gradients, memory).

    python bench/gpu_loss.py            (bench/gpu.sh runs it; needs the liger-kernel wheel)
    python bench/gpu_loss.py --smoke    (CPU: the torch paths only, a check of the script)

A Qwen3-shaped model (hidden 1024, 4 layers, the real 151,936-token vocabulary), bf16, one
sequence of 8K tokens whose last 4K are targets. Paths: naive (full logits of the targets),
chunked (model.loss_chunk_tokens=1024) and liger (model.loss_kernel=liger), each on the plain
model and under DeepSpeed ZeRO-3 on one GPU (the LM head weight partitioned, gathered around the
fused module's forward and again for its backward). Reported: loss and every parameter gradient's
relative error against the naive path, and the peak memory of the loss forward+backward. Writes bench/results/gpu_loss.json.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

SHAPE = ["model.config.hidden_size=1024", "model.config.intermediate_size=3072", "model.config.num_hidden_layers=4",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "model.config.head_dim=128",
         "model.config.tie_word_embeddings=false", "parallel.sp_size=1", "optim.grad_accum=1",
         "deepspeed.config=zero3", "deepspeed.torch_adam=true"]


def run(zero3: bool, kernel: str, chunk: int, dtype: str, seq: int, device: str) -> dict:
    from longsft.train.config import load_config
    from longsft.train.data.encoding import IGNORE
    from longsft.train.model.build import build_model
    from longsft.train.model.loss import token_loss_sum

    # the kernel in the config too: build_model attaches Liger's loss module before ZeRO-3 hooks the model
    cfg = load_config("tiny", [*SHAPE, f"model.dtype={dtype}", f"stages.0.seq_len={seq}", f"model.loss_kernel={kernel}"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (1, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 2] = IGNORE
    batch = {"input_ids": ids, "position_ids": torch.arange(seq)[None], "attention_mask": torch.ones_like(ids),
             "shift_labels": torch.cat([labels[:, 1:], torch.full((1, 1), IGNORE)], 1)}
    batch = {k: v.to(device) for k, v in batch.items()}
    if zero3:
        model = onestep.zero3_engine(cfg, total_steps=1)
        module = model.module
    else:
        model = module = build_model(cfg.model).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss, n = token_loss_sum(model, batch, chunk, kernel=kernel)
    (model.backward(loss) if zero3 else loss.backward())
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    grads = {}
    for name, p in module.named_parameters():
        if zero3:
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        else:
            g = p.grad
        grads[name] = g.detach().float().cpu().clone()
    return {"loss": loss.item(), "n": n, "peak": peak, "grads": grads}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from machine import write_result

    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    os.environ.update(onestep.rendezvous_env())
    from longsft.train.parallel import distributed

    distributed.init(1)
    dtype, seq = ("fp32", 512) if a.smoke else ("bf16", 8192)
    paths = [("naive", "torch", 0), ("chunked", "torch", 1024)]
    try:
        import liger_kernel  # noqa: F401  (--smoke: tests/liger_cpu on PYTHONPATH runs its rows on CPU)

        paths.append(("liger", "liger", 0))
    except ImportError:
        print("liger-kernel is not installed: its rows are missing")
    rows = []
    tol_loss, tol_grad = (1e-5, 1e-4) if dtype == "fp32" else (1e-2, 5e-2)  # bf16: logits rounded differently
    for zero3 in (False, True):
        ref = None
        for name, kernel, chunk in paths:
            r = run(zero3, kernel, chunk, dtype, seq, device)
            ref = ref or r
            errs = [((r["grads"][k] - g).norm() / g.norm().clamp_min(1e-12)).item() for k, g in ref["grads"].items()]
            row = {"path": name, "zero3": zero3, "loss": r["loss"], "targets": r["n"],
                   "loss_rel_err": abs(r["loss"] - ref["loss"]) / abs(ref["loss"]), "max_grad_rel_err": max(errs),
                   "peak_mib": r["peak"] / 2**20 if r["peak"] else None}
            row["pass"] = row["loss_rel_err"] < tol_loss and row["max_grad_rel_err"] < tol_grad
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not a.smoke:  # rewritten after every row: a cut-off run keeps what it measured
                write_result("gpu_loss", {"benchmark": "gpu_loss", "dtype": dtype, "tokens": seq, "rows": rows,
                                          "tolerance": {"loss": tol_loss, "grad": tol_grad}})
    print("\n| path | ZeRO-3 | loss | loss rel err | max grad rel err | peak MiB |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] else "-"
        print(f"| {r['path']} | {r['zero3']} | {r['loss']:.4f} | {r['loss_rel_err']:.1e} | "
              f"{r['max_grad_rel_err']:.1e} | {peak} |")
    distributed.shutdown()
    failed = [f"{r['path']} zero3={r['zero3']}" for r in rows if not r["pass"]]
    print("outside tolerance:", failed or "none")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
