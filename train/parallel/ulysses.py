"""Backend ``ulysses``: DeepSpeed-Ulysses' scheme on longsft's zigzag shards.

Each layer runs an all-to-all from sequence shards to head shards, one fused causal kernel over the
whole sequence (the ring's, :mod:`.kernels`), and an all-to-all back. A fixed permutation puts the zigzag chunks in position
order. We implement it here instead of using DeepSpeed's ``UlyssesSPAttentionHF``, for three reasons:

- that one replaces the process-wide ``sdpa`` entry of transformers' registry;
- it needs its own data-loader adapter and an ``mpu``, which changes DeepSpeed's gradient averaging;
- it lost the document boundaries of packed inputs.

This one shares the data path, the loss normalisation and the checks of the ring. It also holds
:func:`per_document_attention`, the attention of packed documents over whole sequences.
"""

from __future__ import annotations

import functools
import math

import torch

from longsft.train.parallel import comm
from longsft.train.parallel.context import ONE_RANK, Documents, SequenceParallel
from longsft.train.parallel.kernels import block_kernel
from longsft.train.parallel.layout import spans, zigzag_index


def per_document_attention(q, k, v, scale: float | None, doc_spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Causal SDPA inside each document of whole (unsplit) sequences. q [b, h, s, d]; ``doc_spans``: each
    row's [start, end) per document (found once per batch: :attr:`Documents.spans`)."""
    import torch.nn.functional as F

    gqa = k.shape[1] != q.shape[1]
    rows = []
    for b, row in enumerate(doc_spans):
        parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                is_causal=True, scale=scale, enable_gqa=gqa)
                 for s, e in row]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


# --------------------------------------------------------------------------- ulysses


class _AllToAll(torch.autograd.Function):
    """all-to-all between sequence shards [b, h, s_local, d] (all heads, our tokens) and head shards
    [b, h/sp, sp*s_local, d] (our heads, every rank's tokens in rank order); the backward is the
    inverse exchange."""

    @staticmethod
    def forward(ctx, x, to_heads: bool, sp: SequenceParallel):
        ctx.to_heads, ctx.sp = to_heads, sp
        return _seq_to_heads(sp, x) if to_heads else _heads_to_seq(sp, x)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(ctx.sp, grad) if ctx.to_heads else _seq_to_heads(ctx.sp, grad)), None, None


def _seq_to_heads(sp: SequenceParallel, x):
    b, h, s, d = x.shape
    n = sp.size
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [sp(dest), b, h/sp, s, d]
    recv = comm.all_to_all(send, sp.group)  # [sp(source), b, h/sp, s, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(sp: SequenceParallel, x):
    b, hl, S, d = x.shape
    n = sp.size
    send = x.reshape(b, hl, n, S // n, d).permute(2, 0, 1, 3, 4)  # [sp(dest), b, h/sp, s, d]
    recv = comm.all_to_all(send, sp.group)  # [sp(source = head block), b, h/sp, s, d]
    return recv.transpose(0, 1).reshape(b, n * hl, S // n, d)


@functools.lru_cache(maxsize=8)  # every layer of every micro-step asks for the same few lengths
def _permutations(S: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, to_pos): gathered slot -> position (rank order of the ``size`` ranks' zigzag chunks), and its
    inverse. [S] each"""
    order = torch.cat([zigzag_index(S, size, r) for r in range(size)]).to(device)
    return order, torch.argsort(order)


def _whole_spans(sp: SequenceParallel, docs: Documents, to_pos: torch.Tensor) -> list[list[tuple[int, int]]]:
    """The documents' spans in the SP group's whole sequences, position order: the ids gathered and their
    spans found once per batch (every layer asks), kept on ``docs``."""
    if docs.whole_spans is None:
        whole = torch.cat(comm.all_gather(docs.ids, sp.group), dim=1)[:, to_pos]  # [b, S], position order
        docs.whole_spans = [spans(row) for row in whole]
    return docs.whole_spans


class _Ulysses(torch.autograd.Function):
    """All-to-all to head shards, one fused causal kernel over the whole sequence, all-to-all back.

    q [b, h, s, d], k/v [b, hk, s, d] (zigzag shards; hk divides over the group) -> out [b, h, s, d],
    and the head-sharded output and log-sum-exp [b, h/sp, S(, d)] for ``kept``.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, kernel, kept, sp):
        order, to_pos = _permutations(q.shape[2] * sp.size, sp.size, q.device)
        qf, kf, vf = (_seq_to_heads(sp, t.contiguous())[:, :, to_pos].contiguous() for t in (q, k, v))
        if kept is not None:  # a checkpoint's recompute: the forward's result, no kernel
            out_f, lse_f = kept
        else:
            groups = 1 if kernel.gqa else qf.shape[1] // kf.shape[1]
            out_f, lse_f = kernel.fwd(qf, kf.repeat_interleave(groups, 1) if groups > 1 else kf,
                                      vf.repeat_interleave(groups, 1) if groups > 1 else vf, True, scale)
        ctx.save_for_backward(qf, kf, vf, out_f, lse_f)
        ctx.scale, ctx.kernel, ctx.sp = scale, kernel, sp
        out = _heads_to_seq(sp, out_f[:, :, order].contiguous())
        ctx.mark_non_differentiable(out_f, lse_f)
        return out, out_f, lse_f

    @staticmethod
    def backward(ctx, dout, _dout_f, _dlse_f):
        qf, kf, vf, out_f, lse_f = ctx.saved_tensors
        sp = ctx.sp
        order, to_pos = _permutations(dout.shape[2] * sp.size, sp.size, dout.device)
        groups = 1 if ctx.kernel.gqa else qf.shape[1] // kf.shape[1]
        kk = kf.repeat_interleave(groups, 1) if groups > 1 else kf
        vv = vf.repeat_interleave(groups, 1) if groups > 1 else vf
        dout_f = _seq_to_heads(sp, dout.contiguous())[:, :, to_pos].contiguous()
        dq, dk, dv = ctx.kernel.bwd(dout_f, qf, kk, vv, out_f, lse_f, True, ctx.scale)
        if groups > 1:  # fold the repeated heads back onto their KV head
            dk, dv = dk.unflatten(1, (-1, groups)).sum(2), dv.unflatten(1, (-1, groups)).sum(2)
        back = (_heads_to_seq(sp, t[:, :, order].contiguous()) for t in (dq, dk, dv))
        return (*back, None, None, None, None)


def ulysses(q, k, v, scale: float | None = None, docs: Documents | None = None, kept: tuple | None = None,
            sp: SequenceParallel = ONE_RANK) -> tuple[torch.Tensor, tuple | None]:
    """Causal attention by head-splitting all-to-all (DeepSpeed-Ulysses' scheme) on zigzag shards:
    (out, kept).

    q [b, h, s_local, d]; k, v [b, hk, s_local, d]. After the all-to-all every rank holds the
    whole sequence for h/sp heads, in rank order of zigzag chunks; a fixed permutation restores
    position order for one fused causal kernel (:mod:`.kernels`: it takes grouped K/V heads as they
    are) and is undone afterwards. KV heads are repeated up to the query heads only when they do not
    divide over the group. ``kept``: the head-sharded output and log-sum-exp an earlier call on the
    same q/k/v returned, when a checkpoint recomputes it (no kernel runs; packed documents: none kept).
    ``docs``: the batch's packed documents (their ids: this rank's zigzag shard).
    """
    n, hk = sp.size, k.shape[1]
    if hk % n:  # repeated to the fewest heads that divide over the group (n and hk divide h, so lcm does)
        r = math.lcm(hk, n) // hk
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if docs is None:
        kernel = block_kernel(q.device.type, q.dtype, sp.kernel, q.shape[-1])
        out, out_f, lse_f = _Ulysses.apply(q, k, v, scale, kernel, kept, sp)
        return out, (out_f, lse_f)
    order, to_pos = _permutations(q.shape[2] * n, n, q.device)
    qf, kf, vf = (_AllToAll.apply(t.contiguous(), True, sp)[:, :, to_pos] for t in (q, k, v))
    out = per_document_attention(qf, kf, vf, scale, _whole_spans(sp, docs, to_pos))
    return _AllToAll.apply(out[:, :, order].contiguous(), False, sp), None


def ulysses_attention(q, k, v, scale: float | None = None, docs: Documents | None = None,
                      sp: SequenceParallel = ONE_RANK) -> torch.Tensor:
    """:func:`ulysses`'s output alone. [b, h, s_local, d]"""
    return ulysses(q, k, v, scale, docs, sp=sp)[0]
