"""GPU: Liger's fused linear cross-entropy against longsft's chunked loss (values, gradients, memory).

    python bench/gpu_loss.py            (bench/gpu.sh runs it; needs the liger-kernel wheel)
    python bench/gpu_loss.py --smoke    (CPU: a check of the script; tests/liger_cpu on PYTHONPATH adds
                                         the Liger rows)

A Qwen3-shaped model (hidden 1024, 4 layers, the real 151,936-token vocabulary), bf16, one
sequence of 8K tokens whose last 4K are targets. Paths: naive (full logits of the targets),
chunked (model.loss_chunk_tokens=1024) and liger (model.loss_kernel=liger), each on the plain
model and under DeepSpeed ZeRO-3 on one GPU (the LM head weight partitioned, gathered around the
fused module's forward and again for its backward). One model (built on the GPU) serves the three
plain rows and one ZeRO-3 engine the three ZeRO-3 rows, their gradients cleared between paths; the
model is built with Liger's module attached (``build_model`` does it before ZeRO-3 hooks the model),
which the naive and chunked paths do not call. Reported: loss and every parameter gradient's
relative error against the naive path of the same model (compared on the GPU), the peak memory of
the loss forward+backward above what was allocated before it, and each row's seconds. Writes
bench/results/gpu_loss.json (``--smoke``: gpu_loss_smoke.json) after every row.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

SHAPE = ["model.config.hidden_size=1024", "model.config.intermediate_size=3072", "model.config.num_hidden_layers=4",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "model.config.head_dim=128",
         "model.config.tie_word_embeddings=false", "parallel.sp_size=1", "optim.grad_accum=1",
         "deepspeed.config=zero3", "deepspeed.torch_adam=true"]
# --smoke: narrow layers (the real vocabulary kept), so that the CPU check of the script takes a minute
SMOKE = ["model.config.hidden_size=128", "model.config.intermediate_size=384", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.head_dim=32"]


def make_batch(seq: int, device: str) -> dict:
    from longsft.train.data.encoding import IGNORE

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (1, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 2] = IGNORE
    batch = {"input_ids": ids, "position_ids": torch.arange(seq)[None], "attention_mask": torch.ones_like(ids),
             "shift_labels": torch.cat([labels[:, 1:], torch.full((1, 1), IGNORE)], 1)}
    return {k: v.to(device) for k, v in batch.items()}


def grads(module, zero3: bool) -> dict:
    """name -> this path's full gradient, on the model's device (ZeRO-3: gathered, fp32)."""
    if zero3:
        from deepspeed.utils import safe_get_full_grad

        return {name: safe_get_full_grad(p) for name, p in module.named_parameters()}
    return {name: p.grad for name, p in module.named_parameters()}


def run(model, zero3: bool, kernel: str, chunk: int, batch: dict, device: str) -> dict:
    """One loss forward+backward of ``model`` (the engine under ZeRO-3), its gradients cleared first."""
    from longsft.train.model.loss import token_loss_sum

    if zero3:
        model.optimizer.zero_grad(set_to_none=True)  # also: the next backward overwrites the grad partitions
    else:
        model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    loss, n = token_loss_sum(model, batch, chunk, kernel=kernel)
    (model.backward(loss) if zero3 else loss.backward())
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    return {"loss": loss.item(), "n": n, "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from machine import describe, write_result

    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    os.environ.update(onestep.rendezvous_env())
    from longsft.train.common.compat import without_zero3_init
    from longsft.train.config.recipes import load_config
    from longsft.train.model.build import build_model
    from longsft.train.parallel import distributed

    distributed.init(1)
    dtype, seq = ("fp32", 512) if a.smoke else ("bf16", 8192)
    paths = [("naive", "torch", 0), ("chunked", "torch", 1024)]
    try:
        import liger_kernel  # noqa: F401  (--smoke: tests/liger_cpu on PYTHONPATH runs its rows on CPU)

        paths.append(("liger", "liger", 0))
    except ImportError:
        print("liger-kernel is not installed: its rows are missing", flush=True)
    loss_kernel = "liger" if paths[-1][0] == "liger" else "torch"
    # the kernel in the config: build_model attaches Liger's loss module before ZeRO-3 hooks the model
    cfg = load_config("tiny", [*SHAPE, *(SMOKE if a.smoke else []), f"model.dtype={dtype}", f"stages.0.seq_len={seq}",
                               f"model.loss_kernel={loss_kernel}"])
    batch = make_batch(seq, device)
    rows, machine = [], describe()
    tol_loss, tol_grad = (1e-5, 1e-4) if dtype == "fp32" else (1e-2, 5e-2)  # bf16: logits rounded differently
    out = "gpu_loss_smoke" if a.smoke else "gpu_loss"

    def save() -> None:  # rewritten after every row: a cut-off run keeps what it measured
        write_result(out, {"benchmark": "gpu_loss", "dtype": dtype, "tokens": seq, "rows": rows,
                           "tolerance": {"loss": tol_loss, "grad": tol_grad},
                           "elapsed_s": time.perf_counter() - t_start, "machine": machine})

    for zero3 in (False, True):
        t0 = time.perf_counter()
        print(f"started {'ZeRO-3 engine' if zero3 else 'plain model'}", flush=True)
        try:
            if zero3:
                model = onestep.zero3_engine(cfg, total_steps=1)
                module = model.module
            else:
                with without_zero3_init(), torch.device(device):  # random initialisation on the GPU
                    model = module = build_model(cfg.model, seed=cfg.seed)
        except Exception as e:  # its rows cannot run; the other model's still do
            rows.append({"path": "build", "zero3": zero3, "pass": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-2000:], "elapsed_s": time.perf_counter() - t0})
            print(rows[-1]["trace"], flush=True)
            save()
            continue
        build_s = time.perf_counter() - t0
        print(f"built in {build_s:.1f} s", flush=True)
        ref = None
        try:
            for name, kernel, chunk in paths:
                t0 = time.perf_counter()
                row = {"path": name, "zero3": zero3}
                try:
                    r = run(model, zero3, kernel, chunk, batch, device)
                    got = grads(module, zero3)
                    if ref is None:  # the naive path: the reference, kept on the device
                        ref = {"loss": r["loss"], "grads": {k: g.detach().float().clone() for k, g in got.items()}}
                    errs = {k: ((got[k].float() - g).norm() / g.norm().clamp_min(1e-12)).item()
                            for k, g in ref["grads"].items()}
                    del got
                    worst = max(errs, key=errs.get)
                    row.update(loss=r["loss"], targets=r["n"],
                               loss_rel_err=abs(r["loss"] - ref["loss"]) / abs(ref["loss"]),
                               max_grad_rel_err=errs[worst], worst_grad=worst,
                               peak_mib=r["peak"] / 2**20 if r["peak"] is not None else None)
                    row["pass"] = row["loss_rel_err"] < tol_loss and row["max_grad_rel_err"] < tol_grad
                except Exception as e:  # a failed row is a result too; the next path still runs
                    row.update({"pass": False, "error": f"{type(e).__name__}: {e}",
                                "trace": traceback.format_exc()[-2000:]})
                row["elapsed_s"] = time.perf_counter() - t0
                if name == paths[0][0]:
                    row["build_s"] = build_s
                rows.append(row)
                print(json.dumps(row)[:800], flush=True)
                save()
        finally:
            ref = None
            if zero3:
                model.destroy()
            del model, module
            if device == "cuda":
                torch.cuda.empty_cache()
    print("\n| path | ZeRO-3 | loss | loss rel err | max grad rel err | peak MiB | s |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "loss" not in r:
            print(f"| {r['path']} | {r['zero3']} | failed | | | | {r['elapsed_s']:.1f} |")
            continue
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] else "-"
        print(f"| {r['path']} | {r['zero3']} | {r['loss']:.4f} | {r['loss_rel_err']:.1e} | "
              f"{r['max_grad_rel_err']:.1e} | {peak} | {r['elapsed_s']:.1f} |")
    distributed.shutdown()
    failed = [f"{r['path']} zero3={r['zero3']}" for r in rows if not r["pass"]]
    print(f"outside tolerance: {failed or 'none'}; {time.perf_counter() - t_start:.1f} s in all")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
