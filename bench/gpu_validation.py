"""GPU: the validation hook's generation speed (greedy ``generate`` on a whole, unsplit prompt).

    python bench/gpu_validation.py           (bench/gpu.sh runs it)
    python bench/gpu_validation.py --smoke   (CPU, a tiny shape: checks the script)

A Qwen3-1.7B-shaped model (random weights), bf16, one GPU. Prompts of 16K and 32K tokens, as the
hook sees them (``generate`` with a KV cache, no sequence parallelism). Per row: prefill seconds
(``max_new_tokens=1``), decode tokens/s over the next tokens, and peak memory. Paths: the plain model;
the trainer's ZeRO-3 engine (one rank: each new token gathers every layer's weights); ZeRO-3 with
parameters offloaded to the host (``zero3_offload``, the recipes' setting: each token copies the
weights over PCIe), on the 16K prompt with fewer new tokens. Writes bench/results/gpu_validation.json.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402
from gpu_train import QWEN3_1_7B, SMOKE  # noqa: E402


def timed_generate(model, ids: torch.Tensor, new: int) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, use_cache=True, pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def measure(model, device: str, seq: int, new: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed_generate(model, ids[:, :256], 2)  # warm-up
    prefill = timed_generate(model, ids, 1)
    total = timed_generate(model, ids, new)
    return {"prompt_tokens": seq, "new_tokens": new, "prefill_s": prefill,
            "decode_tokens_per_s": (new - 1) / max(1e-9, total - prefill),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from longsft.train.config import load_config
    from longsft.train.model.build import build_model
    from longsft.train.parallel import distributed

    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    shape, dtype = (SMOKE, "fp32") if a.smoke else (QWEN3_1_7B, "bf16")
    lengths, new = ([512], 4) if a.smoke else ([16384, 32768], 64)
    base = [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={dtype}", "parallel.sp_size=1",
            "deepspeed.torch_adam=true", "optim.grad_accum=1"]
    os.environ.update(onestep.rendezvous_env())
    distributed.init(1)
    rows = []
    from machine import write_result

    def save():  # after every row: a cut-off run keeps what it measured
        if not a.smoke:
            write_result("gpu_validation", {"benchmark": "gpu_validation", "shape": shape, "dtype": dtype,
                                            "rows": rows})

    cfg = load_config("tiny", [*base, "deepspeed.config=zero3"])
    with torch.device(device):  # random initialisation on the GPU, not the CPU
        model = build_model(cfg.model).eval()
    model.config.use_cache = True
    vocab = model.config.vocab_size
    for seq in lengths:
        rows.append({"path": "plain", **measure(model, device, seq, new, vocab)})
        print(rows[-1], flush=True)
        save()
    del model
    for ds, seqs, n in (("zero3", lengths[:1], new), ("zero3_offload", lengths[:1], max(2, new // 8))):
        cfg = load_config("tiny", [*base, f"deepspeed.config={ds}"])
        engine = onestep.zero3_engine(cfg, total_steps=1)
        engine.module.eval()
        engine.module.config.use_cache = True
        for seq in seqs:
            rows.append({"path": ds, **measure(engine.module, device, seq, n, vocab)})
            print(rows[-1], flush=True)
            save()
        engine.destroy()
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n| path | prompt | new | prefill s | decode tokens/s | peak GiB |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['path']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['prefill_s']:.2f} | "
              f"{r['decode_tokens_per_s']:.1f} | {peak} |")
    distributed.shutdown()


if __name__ == "__main__":
    main()
