"""PyTorch's flex_attention (log-sum-exp returned) vs the ring's block kernel, on this machine's CPU.

    python bench/flex_attention.py [--tokens 2048 4096 8192] [--threads 1]

One ring block's shapes of the vs-ALST model (8 query heads, 2 KV heads, head dim 64, fp32), causal,
forward, and forward + backward, at each length; and packed documents (8 of them, uneven), which the
ring's CPU kernel runs with an [sq, sk] mask made from the document ids. Runs:

- ``aten``: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what the ring calls
  (:mod:`longsft.train.parallel.kernels`), GQA heads as they are; packed: with the additive mask;
- ``flex eager``: ``flex_attention(..., return_aux=AuxRequest(lse=True))`` uncompiled;
- ``flex compiled``: the same under ``torch.compile`` (the first call's compile time reported apart).

Also checks each against SDPA (output and dq). What the installed torch refuses on CPU is recorded
with its message, not timed (torch 2.13: eager flex has no backward on CPU; compiled flex on CPU
is inference-only and returns no log-sum-exp).
Writes bench/results/flex_attention.json.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))


def timed(fn, reps: int = 3) -> tuple[float, float]:
    """(first call's seconds, median of ``reps`` more)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return first, sorted(ts)[len(ts) // 2]


def _refusal(e: Exception) -> str:
    """The first line of a "not supported on CPU" refusal by the installed torch; anything else re-raised."""
    text = str(e)
    line = next((x.strip() for x in text.splitlines() if "support" in x), None)
    if line is None:
        raise e
    return line[line.find("NotImplementedError:") + len("NotImplementedError:"):].strip() \
        if "NotImplementedError:" in line else line


def main() -> None:
    from machine import write_result
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    from longsft.train.parallel.kernels import CPU_KERNEL, block_bwd, block_fwd

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: one SP rank's share of 2 cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, hk, d = 8, 2, 64
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    for s in args.tokens:
        g = torch.Generator().manual_seed(s)
        q, k, v, dout = (torch.randn(1, n, s, d, generator=g) for n in (h, hk, hk, h))
        lengths = torch.tensor([s // 8 + (7 if i % 2 else -7) for i in range(7)])
        lengths = torch.cat([lengths, torch.tensor([s - int(lengths.sum())])])
        docs = torch.repeat_interleave(torch.arange(8), lengths)[None]
        for packed in (False, True):
            allowed = torch.ones(s, s, dtype=torch.bool).tril() & ((docs[0, :, None] == docs[0, None, :]) if packed
                                                                   else True)
            qr = q.clone().requires_grad_()
            want = F.scaled_dot_product_attention(qr, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1),
                                                  attn_mask=allowed)
            want.backward(dout)

            def mask_mod(b, hh, qi, ki):
                return (qi >= ki) & (docs[b, qi] == docs[b, ki]) if packed else qi >= ki

            block_mask = create_block_mask(mask_mod, 1, None, s, s, device="cpu")

            def aten_fwd():
                blk = (docs, docs) if packed else None
                return block_fwd(CPU_KERNEL, q, k, v, True, d ** -0.5, blk)

            def aten_bwd():
                blk = (docs, docs) if packed else None
                out, lse = aten_fwd()
                return out, block_bwd(CPU_KERNEL, dout, q, k, v, out, lse, True, d ** -0.5, blk)[0]

            def flex_fwd(fn):
                def run():
                    out, aux = fn(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
                    assert aux.lse.shape == q.shape[:3]
                    return out
                return run

            def flex_bwd(fn):
                def run():
                    qq = q.clone().requires_grad_()
                    out, _ = fn(qq, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
                    out.backward(dout)
                    return out.detach(), qq.grad
                return run

            runs = {"aten": (aten_fwd, aten_bwd), "flex compiled": (flex_fwd(compiled), flex_bwd(compiled))}
            if s <= 4096:  # eager materialises [h, s, s] scores: slow and large
                runs["flex eager"] = (flex_fwd(flex_attention), flex_bwd(flex_attention))
            for name, (fwd, bwd) in runs.items():
                row = {"tokens": s, "packed": packed, "run": name, "fwd_s": None, "fwd_bwd_s": None}
                try:
                    row["first_call_s"], row["fwd_s"] = timed(fwd)
                    out = fwd()
                    out = out[0] if isinstance(out, tuple) else out
                    row["out_rel_err"] = ((out - want.detach()).norm() / want.norm()).item()
                    _, row["fwd_bwd_s"] = timed(bwd)
                    row["dq_rel_err"] = ((bwd()[1] - qr.grad).norm() / qr.grad.norm()).item()
                except Exception as e:  # noqa: BLE001 - only the installed torch's refusals, see _refusal
                    row["refused"] = _refusal(e)
                rows.append(row)
                print(row, flush=True)
    print("\n| tokens | packed | run | fwd s | vs aten | fwd+bwd s | vs aten | out err | dq err |\n"
          "|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next(x for x in rows if (x["tokens"], x["packed"], x["run"]) == (r["tokens"], r["packed"], "aten"))
        for key in ("fwd_s", "fwd_bwd_s"):
            r[key.replace("_s", "_vs_aten")] = r[key] / base[key] if r[key] is not None else None
        cells = [f"{r[k]:.3f}" if r[k] is not None else "–" for k in ("fwd_s", "fwd_vs_aten", "fwd_bwd_s", "fwd_bwd_vs_aten")]
        errs = [f"{r[k]:.1e}" if k in r else "–" for k in ("out_rel_err", "dq_rel_err")]
        print(f"| {r['tokens']} | {r['packed']} | {r['run']} | " + " | ".join(cells + errs) + " |"
              + (f" refused: {r['refused']}" if "refused" in r else ""))
    write_result("flex_attention", {"benchmark": "flex_attention", "threads": args.threads,
                                    "shape": {"heads": h, "kv_heads": hk, "head_dim": d, "dtype": "fp32"}, "rows": rows})


if __name__ == "__main__":
    main()
