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
from longsft.train.parallel.context import ONE_RANK, Documents, SequenceParallel
from longsft.train.parallel.doc_blocks import Piece, block_pieces, pieces_bwd, pieces_fwd
from longsft.train.parallel.kernels import BlockKernel, block_bwd, block_fwd, block_kernel, merge_
from longsft.train.parallel.layout import zigzag_index


def _start_pass(sp: SequenceParallel, tensors: list[torch.Tensor]) -> comm.Pending:
    """Start passing ``tensors`` to the next SP rank (receiving the previous rank's)."""
    return comm.ring_shift_start(tensors, sp.ranks, sp.rank, sp.group)


def _blocks(sp: SequenceParallel, kv: list[torch.Tensor]):
    """Yield (step, [K, V(, doc ids)] of that step's source rank) around the ring. The next block's
    transfer starts before the current one is yielded, so it travels while the caller computes."""
    for step in range(sp.size):
        pending = _start_pass(sp, kv) if step < sp.size - 1 else None
        yield step, kv
        if pending is not None:
            kv = pending.wait()


def block_slices(rank: int, size: int, step: int, c: int) -> tuple[slice, slice, bool]:
    """SP rank ``rank``'s block at ring ``step`` of ``size`` ranks, for the zigzag layout (local chunks
    r and 2sp-1-r, each of length c): (query rows, key columns of the source rank's shard, causal).

    Own chunks are causal over [r ; 2sp-1-r] (already in position order); an earlier rank's chunk
    ``src`` is seen by every local query but its late twin by none; a later rank's two chunks are
    seen only by our late chunk.
    """
    src = (rank - step) % size
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(None, c), False
    return slice(c, None), slice(None), False


def block_plan(rank: int, size: int, step: int, c: int, groups: int, kc, vc, docs, dc):
    """:func:`block_slices`, applied: (query rows, key columns, causal, K, V, block doc ids).
    ``groups`` > 1: GQA heads are repeated here and folded back in the backward."""
    qs, ks, causal = block_slices(rank, size, step, c)
    kk = kc.repeat_interleave(groups, 1) if groups > 1 else kc
    vv = vc.repeat_interleave(groups, 1) if groups > 1 else vc
    blk_docs = None if docs is None else (docs[:, qs], dc[:, ks])
    return qs, ks, causal, kk[:, :, ks].contiguous(), vv[:, :, ks].contiguous(), blk_docs


def _kv(k, v, docs) -> list[torch.Tensor]:
    return [k, v] if docs is None else [k, v, docs]


def doc_plan(docs: Documents, sp: SequenceParallel) -> tuple[tuple[Piece, ...], ...]:
    """Each ring step's pieces of packed documents (:mod:`.doc_blocks`), for a kernel that takes no mask:
    every SP rank's document ids gathered and read on the host once per batch (every layer asks), kept
    on ``docs``."""
    if docs.ring_pieces is None:
        shards = torch.stack(comm.all_gather(docs.ids, sp.group) if sp.size > 1 else [docs.ids]).cpu()  # one sync
        _check_contiguous(shards)  # every rank holds the same ids: all raise together, none waits in the ring
        ids = [shard.tolist() for shard in shards]  # [sp][b][s_local]
        c = len(ids[sp.rank][0]) // 2
        plan = []
        for step in range(sp.size):
            qs, ks, causal = block_slices(sp.rank, sp.size, step, c)
            src = (sp.rank - step) % sp.size
            plan.append(block_pieces([row[qs] for row in ids[sp.rank]], [row[ks] for row in ids[src]], causal))
        docs.ring_pieces = tuple(plan)
    return docs.ring_pieces


def _check_contiguous(shards: torch.Tensor) -> None:
    """Every document one run in position order: ``shards`` [sp, b, s_local], the SP ranks' zigzag shards."""
    sp, b, n = shards.shape
    whole = torch.empty(b, sp * n, dtype=shards.dtype)
    whole[:, torch.cat([zigzag_index(sp * n, sp, r) for r in range(sp)])] = shards.transpose(0, 1).reshape(b, -1)
    for row in whole:
        if 1 + int((row[1:] != row[:-1]).sum()) != row.unique().numel():
            raise ValueError("packed document ids must be contiguous in position order (one run per document); "
                             "a row repeats an id after another document")


def _fwd(kernel, q, k, v, causal, scale, blk_docs, pieces):
    if pieces is not None:
        return pieces_fwd(kernel, q, k, v, scale, pieces)
    return block_fwd(kernel, q, k, v, causal, scale, blk_docs)


def _bwd(kernel, dout, q, k, v, out, lse, causal, scale, blk_docs, pieces):
    if pieces is not None:
        return pieces_bwd(kernel, dout, q, k, v, out, lse, scale, pieces)
    return block_bwd(kernel, dout, q, k, v, out, lse, causal, scale, blk_docs)


class _ZigzagRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, docs, plan, kernel, kept, sp):
        # q [b, h, s, d]; k, v [b, hk, s, d]; s = 2c (two zigzag chunks); docs [b, s] (masked blocks) or None;
        # plan: each step's pieces of packed documents (a kernel without masks) or None
        # kept: (out, lse) of this very call, saved by the forward that a checkpoint now recomputes
        groups = 1 if kernel.gqa else q.shape[1] // k.shape[1]  # masked blocks run the CPU kernel: GQA too
        if kept is not None:
            out, lse = kept
        elif sp.size == 1:  # one rank (keep_attention): its one causal block is the whole attention, no merge
            _, _, causal, kk, vv, blk_docs = block_plan(0, 1, 0, 0, groups, k, v, docs, docs)
            out, lse = _fwd(kernel, q, kk, vv, causal, scale, blk_docs, plan and plan[0])
            lse = lse.float()
        else:
            c, (b, h, n, d) = q.shape[2] // 2, q.shape
            late = q[:, :, c:].contiguous()  # the late chunk's queries, once, for the blocks only they see
            # [b, h, s, d] over [b, s, h, d] memory: the layer's transpose to [b, s, h * d] for its output
            # projection is then free, and that projection keeps the very tensor the backward keeps
            out = torch.empty(b, n, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            for step, blk in _blocks(sp, _kv(k, v, docs)):
                kc, vc, dc = (*blk, None)[:3]
                qs, ks, causal, kk, vv, blk_docs = block_plan(sp.rank, sp.size, step, c, groups, kc, vc, docs, dc)
                blk_out, blk_lse = _fwd(kernel, q if qs.start is None else late, kk, vv, causal, scale, blk_docs,
                                        plan and plan[step])
                if step == 0:  # the causal diagonal: every row's first block (each row sees its own key)
                    out.copy_(blk_out)
                    lse.copy_(blk_lse)
                else:
                    merge_(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.scale, ctx.kernel, ctx.groups, ctx.sp, ctx.plan = scale, kernel, groups, sp, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, docs = ctx.saved_tensors
        scale, kernel, groups, sp, plan, c = ctx.scale, ctx.kernel, ctx.groups, ctx.sp, ctx.plan, q.shape[2] // 2
        # the kernels' inputs in one layout on every call (cuDNN caches its backward graph by q/k/v
        # strides alone), each made once: the whole rows, and the late chunk's rows
        whole = (dout.contiguous(), q, out.contiguous(), lse.contiguous())
        if sp.size == 1:  # one rank: one kernel call, its gradients as they come
            _, _, causal, kk, vv, blk_docs = block_plan(0, 1, 0, 0, groups, k, v, docs, docs)
            dq, dk, dv = _bwd(kernel, *whole[:2], kk, vv, *whole[2:], causal, scale, blk_docs, plan and plan[0])
            dk, dv = _fold(dk, groups), _fold(dv, groups)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None
        late = tuple(t[:, :, c:].contiguous() for t in whole)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        travelling = None  # the dK/dV accumulators of the block we hold, on their way from the previous rank
        for step, blk in _blocks(sp, _kv(k, v, docs)):
            kc, vc, dc = (*blk, None)[:3]
            qs, ks, causal, kk, vv, blk_docs = block_plan(sp.rank, sp.size, step, c, groups, kc, vc, docs, dc)
            dout_b, q_b, out_b, lse_b = whole if qs.start is None else late
            dq_b, dk_b, dv_b = _bwd(kernel, dout_b, q_b, kk, vv, out_b, lse_b, causal, scale, blk_docs,
                                    plan and plan[step])
            dq[:, :, qs].add_(dq_b)  # in place on the view (an indexed += would copy it back onto itself)
            dk_b, dv_b = _fold(dk_b, groups), _fold(dv_b, groups)
            if travelling is not None:
                dkv = travelling.wait()
            dkv[0][:, :, ks].add_(dk_b)
            dkv[1][:, :, ks].add_(dv_b)
            travelling = _start_pass(sp, dkv)  # after the last pass they are home
        dk, dv = travelling.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of K/V heads repeated ``groups`` times, summed back onto each K/V head (fp32). [b, hk, s, d]"""
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(2, dtype=torch.float32)


def zigzag_ring(q, k, v, scale: float | None = None, docs: Documents | torch.Tensor | None = None,
                kernel: BlockKernel | None = None, kept: tuple | None = None,
                sp: SequenceParallel = ONE_RANK) -> tuple[torch.Tensor, tuple]:
    """Causal attention of zigzag-sharded q/k/v across ``sp``'s group: (out [b, h, s_local, d], kept).

    ``docs``: packed documents (their ids [b, s_local], or the batch's :class:`Documents`, which keeps
    what every layer derives from them); a token only sees earlier tokens of its document. A kernel
    with masks (CPU) masks each block; the CUDA kernels run each block's documents as dense pieces.
    ``kernel``: the block kernel (default: :func:`block_kernel` for q's device and dtype).
    ``kept``: what an earlier call on the same q/k/v returned (its out and log-sum-exp), when a
    checkpoint recomputes it: then nothing is computed or sent again.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    kernel = kernel or block_kernel(q.device.type, q.dtype, sp.kernel, q.shape[-1])
    if isinstance(docs, torch.Tensor):
        docs = Documents(docs)
    ids = plan = None
    if docs is not None and kernel.masks:
        ids = docs.ids.contiguous()
    elif docs is not None:
        plan = doc_plan(docs, sp)
    out, lse = _ZigzagRing.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, ids, plan, kernel, kept, sp)
    return out, (out.detach(), lse.detach())


def zigzag_ring_attention(q, k, v, scale: float | None = None, docs: Documents | torch.Tensor | None = None,
                          kernel: BlockKernel | None = None, sp: SequenceParallel = ONE_RANK) -> torch.Tensor:
    """:func:`zigzag_ring`'s output alone. [b, h, s_local, d]"""
    return zigzag_ring(q, k, v, scale, docs, kernel, sp=sp)[0]
