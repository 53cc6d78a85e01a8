"""Sequence-parallel attention (zigzag ring, Ulysses) on N ranks vs full causal attention.

    torchrun --nproc_per_node=N tests/dist/ring_attention.py OUT.json [SP]

Writes the max relative error of the output and of dQ/dK/dV per (backend, dtype, seq_len, heads) case.
``torch_pieces``: the torch ring with the CPU kernel running packed documents as the CUDA kernels do (a
dense piece per document of a block, no mask: ``train/parallel/doc_blocks.py``); packed cases only.
Unpacked fp32 cases also run as a checkpointed layer with and without ``model.keep_attention``
(``kept``), counting the forward kernel calls of the forward plus the recompute.
"""

import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def forward_kernels(fn) -> int:
    """How many fused attention forward kernels ``fn()`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def main(out_path: str, sp_arg: str | None = None) -> None:
    from longsft.train.parallel import comm
    from longsft.train.parallel import distributed
    from longsft.train.parallel.attention import BACKENDS, attend_layer
    from longsft.train.parallel.context import Documents, Forward
    from longsft.train.parallel.kernels import CPU_KERNEL
    from longsft.train.parallel.ring_flash import ring_flash_attention
    from longsft.train.parallel.ulysses import ulysses_attention
    from longsft.train.parallel.layout import zigzag_index
    from longsft.train.parallel.ring import zigzag_ring_attention

    # SP over the whole world, or (a second argument) SP groups of that size side by side: then group ranks
    # differ from global ranks (ranks 2, 3 are SP ranks 0, 1 of the second group)
    d = distributed.init(int(sp_arg) if sp_arg else int(os.environ.get("WORLD_SIZE", "1")))
    n = d.sp.size
    results = []
    cases = [(torch.float32, 8 * n, 4, 4, None), (torch.float32, 24 * n, 4, 2, None), (torch.float32, 2 * n, 2, 1, None),
             # 8 query heads over 2 K/V heads: on 4 ranks Ulysses repeats K/V to lcm(2, 4) = 4 heads, not 8
             (torch.float32, 8 * n, 8, 2, None),
             (torch.bfloat16, 32 * n, 4, 2, None), (torch.bfloat16, 8 * n, 4, 4, None),
             # packed documents of uneven lengths, boundaries anywhere relative to the zigzag chunks
             (torch.float32, 24 * n, 4, 2, [5, 11, 1, 24 * n - 17]), (torch.bfloat16, 32 * n, 4, 2, [3, 32 * n - 3]),
             (torch.bfloat16, 24 * n, 4, 2, [5, 11, 1, 24 * n - 17]),
             # one-token documents, several documents in one zigzag chunk
             (torch.float32, 16 * n, 4, 2, [1, 1, 2, 3, 1, 16 * n - 8])]
    backends = ["torch", "torch_pieces", "ulysses"]
    if os.environ.get("LONGSFT_TEST_RING_FLASH_ATTN") and n > 1:  # tests/flash_attn_cpu on PYTHONPATH
        backends.append("ring_flash_attn")
    sp = {b: dataclasses.replace(d.sp, backend=b) for b in backends}  # the SP context, passed explicitly
    unmasked = dataclasses.replace(CPU_KERNEL, name="cpu_pieces", masks=False)
    attention = {"torch": lambda q, k, v, docs: zigzag_ring_attention(q, k, v, None, docs, sp=sp["torch"]),
                 "torch_pieces": lambda q, k, v, docs: zigzag_ring_attention(q, k, v, None, docs, unmasked,
                                                                             sp=sp["torch"]),
                 "ulysses": lambda q, k, v, docs: ulysses_attention(q, k, v, None, docs, sp=sp["ulysses"]),
                 "ring_flash_attn": lambda q, k, v, docs: ring_flash_attention(sp["ring_flash_attn"], q, k, v, None, docs)}
    for backend, (dtype, seq, heads, kv_heads, docs) in [(b, c) for b in backends for c in cases]:
        if (backend == "ulysses" and heads % n) or (backend == "ring_flash_attn" and dtype != torch.bfloat16) or \
                (backend == "torch_pieces" and not docs):
            continue  # ring_flash_attn: flash-attn's dtypes
        attend = attention[backend]
        g = torch.Generator().manual_seed(seq * 31 + heads)
        q = torch.randn(1, heads, seq, 16, generator=g)
        k = torch.randn(1, kv_heads, seq, 16, generator=g)
        v = torch.randn(1, kv_heads, seq, 16, generator=g)
        dout = torch.randn(1, heads, seq, 16, generator=g)
        # reference: one process, the whole sequence, in fp32
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        rep = heads // kv_heads
        doc_ids = torch.zeros(1, seq, dtype=torch.long)
        if docs:
            doc_ids[0] = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        allowed = (doc_ids[0, :, None] == doc_ids[0, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
        ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1),
                                             attn_mask=allowed)
        ref.backward(dout)
        contiguous = backend == "ring_flash_attn" and docs  # its llama3 varlen ring: rank slices in order
        idx = torch.arange(d.sp_rank * seq // n, (d.sp_rank + 1) * seq // n) if contiguous else \
            zigzag_index(seq, n, d.sp_rank)
        ql, kl, vl = (t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v))
        local_docs = Documents(doc_ids[:, idx]) if docs else None
        out = attend(ql, kl, vl, local_docs)
        out.backward(dout[:, :, idx].to(dtype))
        errs = {"out": rel(out, ref[:, :, idx].detach()), "dq": rel(ql.grad, qr.grad[:, :, idx]),
                "dk": rel(kl.grad, kr.grad[:, :, idx]), "dv": rel(vl.grad, vr.grad[:, :, idx])}
        worst = comm.all_gather_objects(errs)
        results.append({"backend": backend, "packed": bool(docs), "dtype": str(dtype), "seq": seq, "heads": heads, "kv_heads": kv_heads,
                        **{k: max(w[k] for w in worst) for k in errs}})
        if docs or dtype != torch.float32 or backend == "ring_flash_attn":
            continue
        for keep in (False, True):  # a checkpointed layer: its recompute reuses the forward's attention
            layer = torch.nn.Module()
            ql, kl, vl = (t[:, :, idx].requires_grad_() for t in (q, k, v))

            def step():
                fwd = Forward(sp[backend], keep_attention=keep)
                out = checkpoint(
                    lambda *qkv: attend_layer(fwd, layer, BACKENDS[backend], *qkv, None) * 2, ql, kl, vl,
                    use_reentrant=False)
                out.backward(dout[:, :, idx])
                assert not fwd.kept, "kept attention outlived its recompute"

            calls = forward_kernels(step)
            errs = {"dq": rel(ql.grad, 2 * qr.grad[:, :, idx]), "dk": rel(kl.grad, 2 * kr.grad[:, :, idx]),
                    "dv": rel(vl.grad, 2 * vr.grad[:, :, idx])}
            worst = comm.all_gather_objects(errs)
            results.append({"backend": backend, "packed": False, "dtype": str(dtype), "seq": seq, "heads": heads,
                            "kv_heads": kv_heads, "kept": keep, "forward_kernels": calls,
                            **{k: max(w[k] for w in worst) for k in errs}})
    if d.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
