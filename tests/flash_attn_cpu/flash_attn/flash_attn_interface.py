"""``_flash_attn_forward`` / ``_flash_attn_backward`` with flash-attn 2.6's signatures, on CPU."""

import torch

from longsft.train.parallel.kernels import CPU_KERNEL


def _heads_first(t: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[b, s, h, d] -> [b, h * groups, s, d] (grouped K/V heads repeated for the kernel)."""
    t = t.transpose(1, 2)
    return t.repeat_interleave(groups, 1).contiguous() if groups > 1 else t.contiguous()


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    assert dropout_p == 0 and window_size_left == -1 and window_size_right == -1 and not softcap
    groups = q.shape[2] // k.shape[2]
    out, lse = CPU_KERNEL.fwd(_heads_first(q), _heads_first(k, groups), _heads_first(v, groups), causal, softmax_scale)
    return out.transpose(1, 2).contiguous(), lse.float(), None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    groups = q.shape[2] // k.shape[2]
    gq, gk, gv = CPU_KERNEL.bwd(_heads_first(dout), _heads_first(q), _heads_first(k, groups), _heads_first(v, groups),
                            _heads_first(out), softmax_lse.contiguous(), causal, softmax_scale)
    if groups > 1:  # fold the repeated heads back onto their K/V head
        gk, gv = (g.unflatten(1, (-1, groups)).sum(2) for g in (gk, gv))
    dq.copy_(gq.transpose(1, 2))
    dk.copy_(gk.transpose(1, 2))
    dv.copy_(gv.transpose(1, 2))
    return None


def _segment_mask(lq: int, lk: int, causal: bool, dtype) -> torch.Tensor | None:
    """flash-attn's causal mask for lq queries over lk keys: aligned to the bottom-right corner."""
    if not causal:
        return None
    allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    return torch.zeros(lq, lk, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]


def _segments(cu_q, cu_k):
    for i in range(len(cu_q) - 1):
        yield slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None):
    """q [tokens_q, h, d], k/v [tokens_k, hk, d] -> out [tokens_q, h, d], lse [h, tokens_q] (fp32)."""
    assert dropout_p == 0 and window_size_left == -1 and window_size_right == -1 and not softcap
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for sq, sk in _segments(cu_seqlens_q, cu_seqlens_k):
        qs, ks, vs = (_heads_first(t[None], g) for t, g in ((q[sq], 1), (k[sk], groups), (v[sk], groups)))
        mask = _segment_mask(qs.shape[2], ks.shape[2], causal, q.dtype)
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, False, attn_mask=mask,
                                                                         scale=softmax_scale)
        out[sq], lse[:, sq] = o[0].transpose(0, 1), l[0]
    return out, lse, None, None


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None):
    groups = q.shape[1] // k.shape[1]
    for sq, sk in _segments(cu_seqlens_q, cu_seqlens_k):
        qs, ks, vs = (_heads_first(t[None], g) for t, g in ((q[sq], 1), (k[sk], groups), (v[sk], groups)))
        mask = _segment_mask(qs.shape[2], ks.shape[2], causal, q.dtype)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(dout[sq][None]), qs, ks, vs, _heads_first(out[sq][None]),
            softmax_lse[None, :, sq].contiguous(), 0.0, False, attn_mask=mask, scale=softmax_scale)
        if groups > 1:
            gk, gv = (g.unflatten(1, (-1, groups)).sum(2) for g in (gk, gv))
        dq[sq] = gq[0].transpose(0, 1)
        dk[sk] = gk[0].transpose(0, 1)
        dv[sk] = gv[0].transpose(0, 1)
    return None
