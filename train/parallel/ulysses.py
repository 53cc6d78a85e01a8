"""Backend ``ulysses``: DeepSpeed-Ulysses' scheme on longsft's zigzag shards.

Each layer runs an all-to-all from sequence shards to head shards, a local causal SDPA over the
whole sequence, and an all-to-all back. A fixed permutation puts the zigzag chunks in position
order. We implement it here instead of using DeepSpeed's ``UlyssesSPAttentionHF``, for three reasons:

- that one replaces the process-wide ``sdpa`` entry of transformers' registry;
- it needs its own data-loader adapter and an ``mpu``, which changes DeepSpeed's gradient averaging;
- it lost the document boundaries of packed inputs.

This one shares the data path, the loss normalisation and the checks of the ring. It also holds
:func:`per_document_attention`, the attention of packed documents over whole sequences.
"""

from __future__ import annotations

import torch

from longsft.train.parallel import comm
from longsft.train.parallel.layout import SP, spans, zigzag_index


def per_document_attention(q, k, v, scale: float | None, doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal SDPA inside each document of whole (unsplit) sequences. q [b, h, s, d], doc_ids [b, s]."""
    import torch.nn.functional as F

    gqa = k.shape[1] != q.shape[1]
    rows = []
    for b in range(q.shape[0]):
        parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                is_causal=True, scale=scale, enable_gqa=gqa)
                 for s, e in spans(doc_ids[b])]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


# --------------------------------------------------------------------------- ulysses


class _AllToAll(torch.autograd.Function):
    """all-to-all between sequence shards [b, h, s_local, d] (all heads, our tokens) and head shards
    [b, h/sp, sp*s_local, d] (our heads, every rank's tokens in rank order); the backward is the
    inverse exchange."""

    @staticmethod
    def forward(ctx, x, to_heads: bool):
        ctx.to_heads = to_heads
        return _seq_to_heads(x) if to_heads else _heads_to_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(grad) if ctx.to_heads else _seq_to_heads(grad)), None


def _seq_to_heads(x):
    b, h, s, d = x.shape
    n = SP.size
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [sp(dest), b, h/sp, s, d]
    recv = comm.all_to_all(send, SP.group)  # [sp(source), b, h/sp, s, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x):
    b, hl, S, d = x.shape
    n = SP.size
    send = x.reshape(b, hl, n, S // n, d).permute(2, 0, 1, 3, 4)  # [sp(dest), b, h/sp, s, d]
    recv = comm.all_to_all(send, SP.group)  # [sp(source = head block), b, h/sp, s, d]
    return recv.transpose(0, 1).reshape(b, n * hl, S // n, d)


def ulysses_attention(q, k, v, scale: float | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention by head-splitting all-to-all (DeepSpeed-Ulysses' scheme) on zigzag shards.

    q [b, h, s_local, d]; k, v [b, hk, s_local, d]. After the all-to-all every rank holds the
    whole sequence for h/sp heads, in rank order of zigzag chunks; a fixed permutation restores
    position order for plain causal SDPA and is undone afterwards. KV heads are repeated up to the
    query heads only when they do not divide over the group.
    """
    import torch.nn.functional as F

    n, h, hk = SP.size, q.shape[1], k.shape[1]
    if hk % n:
        k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    S = q.shape[2] * n
    order = torch.cat([zigzag_index(S, n, r) for r in range(n)]).to(q.device)  # gathered slot -> position
    to_pos = torch.argsort(order)
    qf, kf, vf = (_AllToAll.apply(t.contiguous(), True)[:, :, to_pos] for t in (q, k, v))
    if doc_ids is None:
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale,
                                             enable_gqa=kf.shape[1] != qf.shape[1])
    else:
        gathered = torch.cat(comm.all_gather(doc_ids, SP.group), dim=1)
        out = per_document_attention(qf, kf, vf, scale, gathered[:, to_pos])
    return _AllToAll.apply(out[:, :, order].contiguous(), False)
