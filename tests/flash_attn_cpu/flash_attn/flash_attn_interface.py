"""``_flash_attn_forward`` / ``_flash_attn_backward`` with flash-attn 2.6's signatures, on CPU."""

import torch

from longsft.train.sequence_parallel import _block_bwd, _block_fwd


def _heads_first(t: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[b, s, h, d] -> [b, h * groups, s, d] (grouped K/V heads repeated for the kernel)."""
    t = t.transpose(1, 2)
    return t.repeat_interleave(groups, 1).contiguous() if groups > 1 else t.contiguous()


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    assert dropout_p == 0 and window_size_left == -1 and window_size_right == -1 and not softcap
    groups = q.shape[2] // k.shape[2]
    out, lse = _block_fwd(_heads_first(q), _heads_first(k, groups), _heads_first(v, groups), causal, softmax_scale)
    return out.transpose(1, 2).contiguous(), lse.float(), None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    groups = q.shape[2] // k.shape[2]
    gq, gk, gv = _block_bwd(_heads_first(dout), _heads_first(q), _heads_first(k, groups), _heads_first(v, groups),
                            _heads_first(out), softmax_lse.contiguous(), causal, softmax_scale)
    if groups > 1:  # fold the repeated heads back onto their K/V head
        gk, gv = (g.unflatten(1, (-1, groups)).sum(2) for g in (gk, gv))
    dq.copy_(gq.transpose(1, 2))
    dk.copy_(gk.transpose(1, 2))
    dv.copy_(gv.transpose(1, 2))
    return None
