"""The fixed per-step cost of longsft's training step on one rank, and DeepSpeed's levers against it.

    python bench/step_overhead.py              (CPU, a few minutes on 2 cores)
    python bench/step_overhead.py --smoke      (CPU, one round: a check of this script)
    python bench/step_overhead.py --gpu        (one GPU: the Qwen3-1.7B shape at 16K; bench/gpu.sh runs it)

On CPU the model has Qwen3-1.7B's 28 layers (so its module and hook count) at tiny widths, so the
step's fixed costs are most of it: ZeRO-3's per-module hooks and gathers, host syncs, the optimizer,
Python between kernels. Every row runs in this one process, on the same sequence, with the trainer's
loss code and torch's AdamW:

- ``plain``: no DeepSpeed (``loss.backward()``, clipping, ``AdamW.step``): the floor;
- ``zero3``: ``ds_configs/zero3.json`` with DeepSpeed's hooks on every module (``deepspeed.layer_hooks=false``);
- ``zero3 layer hooks``: as longsft ships it, one hook per decoder layer (``deepspeed.layer_hooks=true``);
- ``zero3 granularity``: ``stage3_module_granularity_threshold`` set, so that DeepSpeed runs one
  fetch/release hook for a whole decoder layer instead of one per submodule;
- ``zero3 persistent``: ``stage3_param_persistence_threshold`` above every weight: nothing is
  gathered or released, what is left is the hooks' own cost;
- ``zero3 prefetch``: ``stage3_prefetch_bucket_size`` of a whole layer (the shipped one is 0.9 h^2).

With ``--gpu`` the first three rows run by default (``--rows`` names others), to fit a minute.

Per row: the median seconds per optimizer step over the timed steps, and from one profiled step
the counts of aten ops, host syncs (``aten::_local_scalar_dense``: ``.item()``, ``.tolist()``) and
collectives. Writes bench/results/step_overhead{,_gpu}.json after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

CPU_SHAPE = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 28, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 131072}
ZERO3 = ROOT / "ds_configs" / "zero3.json"


def levers(hidden: int, layer_params: int) -> dict[str, dict]:
    """Row name -> zero_optimization keys changed from the shipped zero3.json."""
    return {"zero3": {},
            "zero3 layer hooks": {},  # deepspeed.layer_hooks (one hook per decoder layer), longsft's default
            "zero3 granularity": {"stage3_module_granularity_threshold": layer_params // 2},
            "zero3 persistent": {"stage3_param_persistence_threshold": 10 * layer_params},
            "zero3 prefetch": {"stage3_prefetch_bucket_size": 2 * layer_params}}


def ds_json(changes: dict, folder: Path, name: str) -> Path:
    """A copy of zero3.json with ``changes`` in its zero_optimization block. Keys the trainer fills from
    the recipe (persistence, prefetch) are set after it: ``engine.build_ds_config`` keeps explicit values."""
    ds = json.loads(ZERO3.read_text())
    ds["zero_optimization"].update(changes)
    path = folder / (name.replace(" ", "_") + ".json")
    path.write_text(json.dumps(ds))
    return path


def counts(prof) -> dict:
    """Per-step event counts from a profiled step."""
    events = prof.key_averages()
    total = {"aten_ops": 0, "host_syncs": 0, "collectives": 0}
    for e in events:
        if e.key.startswith("aten::"):
            total["aten_ops"] += e.count
        if e.key == "aten::_local_scalar_dense":
            total["host_syncs"] += e.count
        if any(w in e.key for w in ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                                    "broadcast", "_reduce_scatter_base")) and not e.key.startswith("aten::"):
            total["collectives"] += e.count
    return total


def plain_stepper(cfg, batch, attention=None):
    """A step of the same model and loss code without DeepSpeed."""
    import torch

    from longsft.train.common.compat import without_zero3_init
    from longsft.train.model.build import build_model
    from longsft.train.model.loss import token_loss_sum

    with without_zero3_init(), torch.device(batch["input_ids"].device):  # an earlier row's ZeRO-3 config must
        model = build_model(cfg.model, seed=cfg.seed)  # not partition this model; built where the batch is
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss, n = token_loss_sum(model, batch, cfg.model.loss_chunk_tokens)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, lambda: None


def ds_stepper(cfg, batch, attention):
    engine = onestep.zero3_engine(cfg, total_steps=100)
    return (lambda: onestep.step(engine, cfg, batch, attention)), engine.destroy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="one GPU, the Qwen3-1.7B shape at 16K tokens")
    ap.add_argument("--smoke", action="store_true", help="one round, two steps: a check of this script")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    a = ap.parse_args()
    import torch
    from gpu_train import QWEN3_1_7B
    from machine import describe, write_result

    from longsft.train.config.recipes import load_config
    from longsft.train.parallel import distributed

    os.environ.update(onestep.rendezvous_env(**({} if a.gpu else {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})))
    shape, dtype = (QWEN3_1_7B, "bf16") if a.gpu else (CPU_SHAPE, "fp32")
    seq = a.seq or (16384 if a.gpu else 512)
    steps, rounds = (2, 1) if a.smoke else ((3, 1) if a.gpu else (4, 3))
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    layer_params = h * (2 * q + 2 * kv) + 3 * h * inter
    base = [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={dtype}", "parallel.sp_size=1",
            "deepspeed.torch_adam=true", "optim.grad_accum=1", f"stages.0.seq_len={seq}", "model.loss_chunk_tokens=4096"]
    d = distributed.init(1)
    sync = torch.cuda.synchronize if a.gpu else (lambda: None)
    names = ["plain", *levers(h, layer_params)]
    default = names[:3] if a.gpu else names  # on the GPU the first three fit bench/gpu.sh's minute
    names = [n for n in names if n in (a.rows or default)]
    times: dict[str, list[float]] = {n: [] for n in names}
    rows: dict[str, dict] = {}
    out = "step_overhead_gpu" if a.gpu else ("step_overhead_smoke" if a.smoke else "step_overhead")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # interleaved: each round runs every row once, so drift hits them alike
            for name in names:
                extra = [] if name == "plain" else [f"deepspeed.config={ds_json(levers(h, layer_params)[name], Path(tmp), name)}",
                                                    f"deepspeed.layer_hooks={str(name == 'zero3 layer hooks').lower()}"]
                cfg = load_config("tiny", [*base, *extra])
                batch = onestep.one_sequence(cfg, seq, d)
                step, close = (plain_stepper if name == "plain" else ds_stepper)(cfg, batch, d.attention)
                step()  # warm-up
                for _ in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    step()
                    sync()
                    times[name].append(time.perf_counter() - t0)
                if r == 0:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        step()
                        sync()
                    rows[name] = {"row": name, "changes": {} if name == "plain" else levers(h, layer_params)[name],
                                  **counts(prof)}
                close()
                del step, close
                ts = sorted(times[name])
                rows[name].update(step_s=ts[len(ts) // 2], steps=len(ts))
                plain = rows.get("plain", {}).get("step_s")
                for row in rows.values():
                    row["vs_plain"] = row["step_s"] / plain if plain else None
                write_result(out, {"benchmark": "step_overhead", "shape": shape, "dtype": dtype, "seq": seq,
                                   "rounds": r + 1, "rows": list(rows.values()), "machine": describe()})
    print("\n| row | s / step | x plain | aten ops | host syncs | collectives |\n|---|---:|---:|---:|---:|---:|")
    for row in rows.values():
        ratio = f"{row['vs_plain']:.2f}" if row.get("vs_plain") else "-"
        print(f"| {row['row']} | {row['step_s']:.3f} | {ratio} | {row['aten_ops']} | {row['host_syncs']} | "
              f"{row['collectives']} |")
    distributed.shutdown()


if __name__ == "__main__":
    main()
