"""The ``torch`` backend: causal attention over a zigzag ring of SP ranks.

K/V blocks travel around the ring, and each block is attended with a :mod:`.kernels` block kernel.
The partial outputs are merged with their log-sum-exp. The backward pass is our own: each block's
gradient is computed by the kernel's backward with the *final* output and log-sum-exp. dQ stays
local, and dK/dV travel around the ring back to their owner.

We implement the ring instead of reusing ring-flash-attn's for two reasons:

- its ring/zigzag backward was seen wrong in fp32 on CPU;
- its import needs the flash-attn package, which neither CPU machines nor our GPU image have.

This version is right in fp32 and bf16 (tests/test_sequence_parallel.py).
"""

from __future__ import annotations

import torch

from longsft.train.parallel import comm
from longsft.train.parallel.kernels import BlockKernel, block_bwd, block_fwd, block_kernel, merge
from longsft.train.parallel.layout import SP


def _ring_pass(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Send to the next SP rank, receive from the previous one (a group of one keeps its own)."""
    if SP.size == 1:
        return tensors
    return comm.ring_shift(tensors, SP.ranks, SP.rank, SP.group)


def _pass_kv(k, v, docs):
    """Pass a K/V block (and its document ids, when packed) to the next rank."""
    if docs is None:
        return (*_ring_pass([k, v]), None)
    return tuple(_ring_pass([k, v, docs]))


def _plan(step: int, c: int, groups: int, kc, vc, docs, dc):
    """This ring step's block for the zigzag layout (local chunks r and 2sp-1-r, each of length c).

    Returns (query rows, key columns, causal, K, V, block doc ids): own chunks are causal over
    [r ; 2sp-1-r] (already in position order); an earlier rank's chunk ``src`` is seen by every
    local query but its late twin by none; a later rank's two chunks are seen only by our late
    chunk. ``groups`` > 1: GQA heads are repeated here and folded back in the backward.
    """
    src = (SP.rank - step) % SP.size
    if step == 0:
        qs, ks, causal = slice(None), slice(None), True
    elif src < SP.rank:
        qs, ks, causal = slice(None), slice(None, c), False
    else:
        qs, ks, causal = slice(c, None), slice(None), False
    kk = kc.repeat_interleave(groups, 1) if groups > 1 else kc
    vv = vc.repeat_interleave(groups, 1) if groups > 1 else vc
    blk_docs = None if docs is None else (docs[:, qs], dc[:, ks])
    return qs, ks, causal, kk[:, :, ks].contiguous(), vv[:, :, ks].contiguous(), blk_docs


class _ZigzagRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, docs, kernel):
        # q [b, h, s, d]; k, v [b, hk, s, d]; s = 2c (two zigzag chunks); docs [b, s] or None
        groups = 1 if kernel.gqa and docs is None else q.shape[1] // k.shape[1]  # masked blocks: repeated
        c = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kc, vc, dc = k, v, docs
        for step in range(SP.size):
            qs, ks, causal, kk, vv, blk_docs = _plan(step, c, groups, kc, vc, docs, dc)
            blk_out, blk_lse = block_fwd(kernel, q[:, :, qs].contiguous(), kk, vv, causal, scale, blk_docs)
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            if step < SP.size - 1:
                kc, vc, dc = _pass_kv(kc, vc, dc)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.scale, ctx.kernel, ctx.groups = scale, kernel, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        scale, kernel, groups, c = ctx.scale, ctx.kernel, ctx.groups, q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        kc, vc, dc = k, v, docs
        for step in range(SP.size):
            qs, ks, causal, kk, vv, blk_docs = _plan(step, c, groups, kc, vc, docs, dc)
            dq_b, dk_b, dv_b = block_bwd(kernel, dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(), kk, vv,
                                          out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale,
                                          blk_docs)
            dq[:, :, qs] += dq_b.float()
            if groups > 1:  # fold the repeated heads back onto their KV head
                dk_b = dk_b.unflatten(1, (-1, groups)).sum(2)
                dv_b = dv_b.unflatten(1, (-1, groups)).sum(2)
            dk_acc[:, :, ks] += dk_b.float()
            dv_acc[:, :, ks] += dv_b.float()
            if step < SP.size - 1:
                kc, vc, dc = _pass_kv(kc, vc, dc)
            dk_acc, dv_acc = _ring_pass([dk_acc, dv_acc])  # after the last pass they are home
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None, None, None


def zigzag_ring_attention(q, k, v, scale: float | None = None, doc_ids: torch.Tensor | None = None,
                          kernel: BlockKernel | None = None) -> torch.Tensor:
    """Causal attention of zigzag-sharded q/k/v across the SP group. [b, h, s_local, d] -> same.

    ``doc_ids`` [b, s_local]: packed documents; a token only sees earlier tokens of its document.
    ``kernel``: the block kernel (default: :func:`block_kernel` for q's device and dtype).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    kernel = kernel or block_kernel(q.device.type, q.dtype)
    docs = None if doc_ids is None else doc_ids.contiguous()
    return _ZigzagRing.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, docs, kernel)
