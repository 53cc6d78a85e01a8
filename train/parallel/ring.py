"""The ``torch`` backend: causal attention over a zigzag ring of SP ranks.

K/V blocks travel around the ring, and each block is attended with a :mod:`.kernels` block kernel.
The partial outputs are merged with their log-sum-exp. The backward pass is our own: each block's
gradient is computed by the kernel's backward with the *final* output and log-sum-exp. dQ stays
local, and dK/dV travel around the ring back to their owner (in fp32: each rank adds its share on
the way, and bf16 sums would lose it). Every transfer is started before the block it overlaps is
computed: the next K/V block travels during the current block's kernel, and in the backward the
dK/dV accumulators travel while the next block's gradients are computed (they are added on arrival).

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


def _start_pass(tensors: list[torch.Tensor]) -> comm.Pending:
    """Start passing ``tensors`` to the next SP rank (receiving the previous rank's)."""
    return comm.ring_shift_start(tensors, SP.ranks, SP.rank, SP.group)


def _blocks(kv: list[torch.Tensor]):
    """Yield (step, [K, V(, doc ids)] of that step's source rank) around the ring. The next block's
    transfer starts before the current one is yielded, so it travels while the caller computes."""
    for step in range(SP.size):
        pending = _start_pass(kv) if step < SP.size - 1 else None
        yield step, kv
        if pending is not None:
            kv = pending.wait()


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


def _kv(k, v, docs) -> list[torch.Tensor]:
    return [k, v] if docs is None else [k, v, docs]


class _ZigzagRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, docs, kernel, kept):
        # q [b, h, s, d]; k, v [b, hk, s, d]; s = 2c (two zigzag chunks); docs [b, s] or None
        # kept: (out, lse) of this very call, saved by the forward that a checkpoint now recomputes
        groups = 1 if kernel.gqa else q.shape[1] // k.shape[1]  # masked blocks run the CPU kernel: GQA too
        if kept is not None:
            out, lse = kept
        elif SP.size == 1:  # one rank (keep_attention): its one causal block is the whole attention, no merge
            _, _, causal, kk, vv, blk_docs = _plan(0, 0, groups, k, v, docs, docs)
            out, lse = block_fwd(kernel, q, kk, vv, causal, scale, blk_docs)
            lse = lse.float()
        else:
            c, (b, h, n, d) = q.shape[2] // 2, q.shape
            # [b, h, s, d] over [b, s, h, d] memory: the layer's transpose to [b, s, h * d] for its output
            # projection is then free, and that projection keeps the very tensor the backward keeps
            out = torch.zeros(b, n, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
            for step, blk in _blocks(_kv(k, v, docs)):
                kc, vc, dc = (*blk, None)[:3]
                qs, ks, causal, kk, vv, blk_docs = _plan(step, c, groups, kc, vc, docs, dc)
                blk_out, blk_lse = block_fwd(kernel, q[:, :, qs].contiguous(), kk, vv, causal, scale, blk_docs)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.scale, ctx.kernel, ctx.groups = scale, kernel, groups
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, docs = ctx.saved_tensors
        scale, kernel, groups, c = ctx.scale, ctx.kernel, ctx.groups, q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        travelling = None  # the dK/dV accumulators of the block we hold, on their way from the previous rank
        for step, blk in _blocks(_kv(k, v, docs)):
            kc, vc, dc = (*blk, None)[:3]
            qs, ks, causal, kk, vv, blk_docs = _plan(step, c, groups, kc, vc, docs, dc)
            dq_b, dk_b, dv_b = block_bwd(kernel, dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(), kk, vv,
                                          out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale,
                                          blk_docs)
            dq[:, :, qs] += dq_b.float()
            if groups > 1:  # fold the repeated heads back onto their KV head
                dk_b = dk_b.unflatten(1, (-1, groups)).sum(2)
                dv_b = dv_b.unflatten(1, (-1, groups)).sum(2)
            if travelling is not None:
                dkv = travelling.wait()
            dkv[0][:, :, ks] += dk_b.float()
            dkv[1][:, :, ks] += dv_b.float()
            travelling = _start_pass(dkv) if SP.size > 1 else None  # after the last pass they are home
        dk, dv = travelling.wait() if travelling is not None else dkv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def zigzag_ring(q, k, v, scale: float | None = None, doc_ids: torch.Tensor | None = None,
                kernel: BlockKernel | None = None, kept: tuple | None = None) -> tuple[torch.Tensor, tuple]:
    """Causal attention of zigzag-sharded q/k/v across the SP group: (out [b, h, s_local, d], kept).

    ``doc_ids`` [b, s_local]: packed documents; a token only sees earlier tokens of its document.
    ``kernel``: the block kernel (default: :func:`block_kernel` for q's device and dtype).
    ``kept``: what an earlier call on the same q/k/v returned (its out and log-sum-exp), when a
    checkpoint recomputes it: then nothing is computed or sent again.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    kernel = kernel or block_kernel(q.device.type, q.dtype)
    docs = None if doc_ids is None else doc_ids.contiguous()
    out, lse = _ZigzagRing.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, docs, kernel, kept)
    return out, (out.detach(), lse.detach())


def zigzag_ring_attention(q, k, v, scale: float | None = None, doc_ids: torch.Tensor | None = None,
                          kernel: BlockKernel | None = None) -> torch.Tensor:
    """:func:`zigzag_ring`'s output alone. [b, h, s_local, d]"""
    return zigzag_ring(q, k, v, scale, doc_ids, kernel)[0]
