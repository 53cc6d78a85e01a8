"""Block kernels of the ring: PyTorch's own fused attention ops, which return the log-sum-exp.

Each :class:`BlockKernel` runs one block's forward and backward:

- on CPU, ``aten::_scaled_dot_product_flash_attention_for_cpu``;
- on CUDA with fp16/bf16, ``aten::_scaled_dot_product_flash_attention``, which takes grouped K/V
  heads as they are;
- on CUDA with fp32, the memory-efficient kernel, because flash does not take fp32.

:func:`merge` combines partial outputs by their log-sum-exp in fp32. The private aten ops are
called through :mod:`longsft.train.common.compat`, which checks their schemas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from longsft.train.common.compat import aten_op

# --------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class BlockKernel:
    """A fused attention kernel that also returns the log-sum-exp: one ring block's forward and backward.

    ``fwd(q, k, v, causal, scale) -> (out [b, h, sq, d], lse [b, h, sq] fp32)``;
    ``bwd(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``, given the row's *final* out and lse.
    q [b, h, sq, d]; k, v [b, hk, sk, d]. ``gqa``: the kernel takes hk < h K/V heads itself (dk, dv come
    back per K/V head); otherwise the ring repeats K/V heads up to h and folds their gradients back.
    Each CUDA call is checked against the kernel's own argument rules in ``tests/cuda_contract.py``.
    """

    name: str
    fwd: Callable
    bwd: Callable
    gqa: bool


def _cpu_fwd(q, k, v, causal, scale):
    return aten_op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, causal, scale=scale)


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    return aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(dout, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _flash_fwd(q, k, v, causal, scale):
    # flash_api.cpp mha_fwd: fp16/bf16 only, h % hk == 0, head dim <= 256; lse [b, h, sq] fp32, unpadded
    r = aten_op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _flash_bwd(dout, q, k, v, out, lse, causal, scale):
    # cum_seq_q/k must be undefined (None): _flash_attention_backward takes the varlen kernel for any
    # *defined* tensor, an empty one included, and fails there. The philox state (uint64, as the forward
    # returns it) is read only with dropout.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten_op("_scaled_dot_product_flash_attention_backward")(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp rows to this (kernel_forward.h kAlignLSE)


def _efficient_fwd(q, k, v, causal, scale):
    # memory-efficient kernel (fp32 as well as fp16/bf16; equal head counts); its lse is [b, h, ceil32(sq)]
    out, lse, _, _ = aten_op("_scaled_dot_product_efficient_attention")(q, k, v, None, True, 0.0, causal,
                                                                            scale=scale)
    return out, lse[..., : q.shape[2]]


def _efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    # the backward reads the lse in the forward's padded layout (row stride a multiple of 8)
    n = q.shape[2]
    padded = lse.new_full((*lse.shape[:2], -(-n // LSE_ALIGN) * LSE_ALIGN), float("inf"))
    padded[..., :n] = lse
    seed = torch.empty((), dtype=torch.int64)  # as the forward returns it without dropout; read only with dropout
    dq, dk, dv, _ = aten_op("_scaled_dot_product_efficient_attention_backward")(
        dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


CPU_KERNEL = BlockKernel("cpu_flash", _cpu_fwd, _cpu_bwd, gqa=True)
FLASH_KERNEL = BlockKernel("cuda_flash", _flash_fwd, _flash_bwd, gqa=True)
EFFICIENT_KERNEL = BlockKernel("cuda_efficient", _efficient_fwd, _efficient_bwd, gqa=False)


def block_kernel(device_type: str, dtype: torch.dtype) -> BlockKernel:
    """The fused kernel the ring uses for tensors of ``dtype`` on ``device_type``.

    CUDA: flash for fp16/bf16 (its only dtypes), the memory-efficient kernel for fp32.
    """
    if device_type == "cuda":
        return FLASH_KERNEL if dtype in (torch.float16, torch.bfloat16) else EFFICIENT_KERNEL
    if device_type == "cpu":
        return CPU_KERNEL
    raise ValueError(f"ring attention has no kernel for {device_type} tensors")


def _block_mask(doc_q, doc_k, causal: bool, dtype):
    """Additive mask [b, 1, sq, sk] allowing same-document (and, if causal, earlier) keys, and the
    rows [b, sq] that may see no key of this block."""
    allowed = doc_q[:, :, None] == doc_k[:, None, :]
    if causal:
        allowed &= torch.ones(allowed.shape[1:], dtype=torch.bool, device=allowed.device).tril()
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
    return mask[:, None], ~allowed.any(-1)


def block_fwd(kernel: BlockKernel, q, k, v, causal: bool, scale: float, docs=None):
    """One block: out [b, h, s, d], lse [b, h, s] (fp32). ``docs`` = (doc ids of q rows, of k)."""
    if docs is not None:  # packed documents: an explicit mask (CPU kernel only, checked at start-up)
        mask, empty = _block_mask(docs[0], docs[1], causal, q.dtype)
        out, lse = aten_op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, False, attn_mask=mask,
                                                                              scale=scale)
        # the kernel reports lse 0 for a row with no visible key; it must weigh nothing in the merge
        return out.masked_fill(empty[:, None, :, None], 0), lse.masked_fill(empty[:, None], float("-inf"))
    return kernel.fwd(q, k, v, causal, scale)


def block_bwd(kernel: BlockKernel, dout, q, k, v, out, lse, causal: bool, scale: float, docs=None):
    """Gradients of one block given the *final* ``out`` and ``lse`` of the full attention row."""
    if docs is not None:
        mask, _ = _block_mask(docs[0], docs[1], causal, q.dtype)
        return aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    return kernel.bwd(dout, q, k, v, out, lse, causal, scale)


def merge(out, lse, blk_out, blk_lse):
    """Combine two partial softmax-attentions by their log-sum-exp (fp32). out [b,h,s,d], lse [b,h,s]."""
    new = torch.logaddexp(lse, blk_lse)
    a = torch.exp(lse - new).nan_to_num(0.0)  # nan only where both are -inf (no key seen yet)
    b = torch.exp(blk_lse - new).nan_to_num(0.0)
    return out * a.unsqueeze(-1) + blk_out.float() * b.unsqueeze(-1), new
