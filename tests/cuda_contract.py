"""The argument rules of PyTorch's CUDA attention kernels, checked on meta tensors (no GPU here).

PyTorch's meta kernels compute output shapes but skip the CUDA kernels' own checks, so a call that
crashes on the first GPU step passes on meta. :class:`CudaAttentionContract` intercepts each fused
attention op and applies the checks the CUDA code makes, read from PyTorch's sources:

- ``aten/src/ATen/native/transformers/cuda/attention.cu`` / ``flash_attn/flash_api.cpp`` ``mha_fwd``,
  ``mha_bwd``: q/k/v fp16 or bf16 ("FlashAttention only support fp16 and bf16 data type"), last
  stride 1, head dim a multiple of 8 ("this is ensured by padding!": SDPA pads, the private op does not)
  and <= 256, query heads a multiple of K/V heads; the log-sum-exp fp32 ``[b, h, sq]``;
- ``attention_backward.cu`` ``_flash_attention_backward``: ``if (cumulative_sequence_length_q.defined())``
  selects ``mha_varlen_bwd`` (3-D inputs, ``batch_size = cu_seqlens_q.numel() - 1 > 0``): a dense
  call must pass them undefined (None), never an empty tensor;
- ``mem_eff_attention/kernel_forward.h`` / ``kernel_backward.h`` and ``attention_backward.cu``
  ``_efficient_attention_backward``: fp32/fp16/bf16, equal query and K/V heads (torch 2.13), a
  log-sum-exp of at least ``sq`` rows per head whose head stride is a multiple of 8 (the forward pads
  it to a multiple of 32);
- ``aten/src/ATen/native/cudnn/MHA.cpp`` ``run_cudnn_SDP_fprop`` / ``_bprop`` and ``sdp_utils.cpp``
  ``check_cudnn_*`` (torch 2.11 and 2.13 alike): fp16/bf16 only (the graph assumes half unless bf16:
  fp32 is silently wrong), last stride 1, head dim a multiple of 8 and <= 256, query heads a multiple
  of K/V heads; the backward's log-sum-exp fp32 ``[b, h, sq, 1]`` as the forward returns it,
  ``cum_seq_q/k`` undefined (``defined()`` selects the nested path), ``max_q/max_k`` the real lengths
  (the graph cache key), and out, grad_out and the log-sum-exp contiguous: the backward graph is cached
  by q/k/v shapes and strides alone, so the other tensors must keep one layout on every call.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ContractViolation(AssertionError):
    """A CUDA kernel would reject (or crash on) this call."""


def _require(ok: bool, op: str, why: str) -> None:
    if not ok:
        raise ContractViolation(f"{op}: {why}")


def _qkv(op: str, q, k, v, dtypes, gqa: bool) -> None:
    _require(q.dim() == k.dim() == v.dim() == 4, op, "q/k/v must be [b, h, s, d]")
    _require(q.dtype in dtypes and k.dtype == v.dtype == q.dtype, op, f"dtype {q.dtype} not in {dtypes}")
    _require(all(t.stride(-1) == 1 for t in (q, k, v)), op, "q/k/v need stride(-1) == 1")
    _require(q.shape[-1] <= 256 and k.shape[-1] == q.shape[-1], op, "head dim must match and be <= 256")
    _require(k.shape[1] == v.shape[1] and q.shape[0] == k.shape[0], op, "k/v heads and batch must match")
    if gqa:
        _require(q.shape[1] % k.shape[1] == 0, op, "query heads must be a multiple of K/V heads")
    else:
        _require(q.shape[1] == k.shape[1], op, "query and K/V head counts must be equal")


def _cudnn_qkv(op: str, q, k, v) -> None:
    _qkv(op, q, k, v, FLASH_DTYPES, gqa=True)
    _require(q.shape[-1] % 8 == 0, op, f"head dim {q.shape[-1]} must be a multiple of 8")
    # sdp_utils.cpp check_cudnn_tensor_shapes: "cudnn SDPA does not support sequence length 1" (s_q or s_k)
    _require(k.shape[2] != 1 and q.shape[2] > 1, op, "cuDNN takes no sequence of length 1 and no empty query")


class CudaAttentionContract(TorchDispatchMode):
    """Check every fused attention call made under it; ``calls`` counts them per op."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        check = getattr(self, "_" + name.split(".")[0].lstrip("_"), None)
        if check is not None:
            check(name, *args, **kwargs)
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **kwargs)

    def _scaled_dot_product_flash_attention(self, op, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                            scale=None):
        _qkv(op, q, k, v, FLASH_DTYPES, gqa=True)
        _require(q.shape[-1] % 8 == 0, op, f"head dim {q.shape[-1]} must be a multiple of 8 (mha_fwd)")
        _require(dropout_p == 0.0 and not return_debug_mask, op, "no dropout / debug mask expected")

    def _scaled_dot_product_flash_attention_backward(self, op, dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q,
                                                     max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                                     scale=None):
        _require(cum_seq_q is None and cum_seq_k is None, op,
                 "cum_seq_q/k must be undefined (None) for [b, h, s, d] inputs: a defined tensor, even an empty one, "
                 "selects mha_varlen_bwd, which fails ('batch size must be positive')")
        _qkv(op, q, k, v, FLASH_DTYPES, gqa=True)
        _require(q.shape[-1] % 8 == 0, op, f"head dim {q.shape[-1]} must be a multiple of 8 (mha_bwd)")
        _require(dout.shape == q.shape == out.shape and dout.dtype == out.dtype == q.dtype, op, "dout/out like q")
        _require(lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3]) and lse.is_contiguous(), op,
                 f"logsumexp must be contiguous fp32 {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
        _require(max_q == q.shape[2] and max_k == k.shape[2], op, "max_q/max_k must be the sequence lengths")

    def _scaled_dot_product_cudnn_attention(self, op, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                            is_causal=False, return_debug_mask=False, scale=None):
        _cudnn_qkv(op, q, k, v)
        _require(attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask, op,
                 "the ring needs the log-sum-exp, no bias, no dropout, no debug mask")
        _require(not is_causal or q.shape[2] == k.shape[2], op, "causal blocks must be square (cuDNN aligns top-left)")

    def _scaled_dot_product_cudnn_attention_backward(self, op, dout, q, k, v, out, lse, philox_seed, philox_offset,
                                                     attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                                     is_causal, scale=None):
        _cudnn_qkv(op, q, k, v)
        _require(cum_seq_q is None and cum_seq_k is None and attn_bias is None, op,
                 "cum_seq_q/k and attn_bias must be undefined (None) for dense [b, h, s, d] inputs")
        _require(max_q == q.shape[2] and max_k == k.shape[2], op, "max_q/max_k must be the sequence lengths")
        _require(dout.shape == q.shape == out.shape and dout.dtype == out.dtype == q.dtype, op, "dout/out like q")
        _require(lse.dtype == torch.float32 and tuple(lse.shape) == (*q.shape[:3], 1), op,
                 f"logsumexp must be fp32 {(*q.shape[:3], 1)} as the forward returns it, got {tuple(lse.shape)}")
        _require(dout.is_contiguous() and out.is_contiguous() and lse.is_contiguous(), op,
                 "out, grad_out and logsumexp must be contiguous (one layout on every call: the backward graph is "
                 "cached by q/k/v strides alone)")
        _require(philox_seed.dtype == philox_offset.dtype == torch.int64 and philox_seed.dim() == 0, op,
                 "philox seed/offset are 0-dim int64")

    def _scaled_dot_product_efficient_attention(self, op, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                                is_causal=False, scale=None):
        _qkv(op, q, k, v, EFFICIENT_DTYPES, gqa=False)
        _require(compute_log_sumexp and dropout_p == 0.0, op, "the ring needs the log-sum-exp, and no dropout")

    def _scaled_dot_product_efficient_attention_backward(self, op, dout, q, k, v, attn_bias, out, lse, philox_seed,
                                                         philox_offset, dropout_p, grad_input_mask, is_causal=False,
                                                         scale=None):
        _qkv(op, q, k, v, EFFICIENT_DTYPES, gqa=False)
        _require(lse.dtype == torch.float32 and lse.dim() == 3 and tuple(lse.shape[:2]) == tuple(q.shape[:2]), op,
                 "logsumexp must be fp32 [b, h, >= sq]")
        _require(lse.shape[2] >= q.shape[2] and lse.stride(1) % 8 == 0, op,
                 f"logsumexp needs >= {q.shape[2]} rows and a head stride multiple of 8, got {tuple(lse.shape)} "
                 f"stride {lse.stride()} (pass it padded as the forward returns it)")
        _require(philox_seed.dtype == philox_offset.dtype == torch.int64, op, "philox seed/offset are int64")
