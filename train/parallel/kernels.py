"""Block kernels of the ring: PyTorch's own fused attention ops, which return the log-sum-exp.

Each :class:`BlockKernel` runs one block's forward and backward:

- on CPU, ``aten::_scaled_dot_product_flash_attention_for_cpu``;
- on CUDA with fp16/bf16, cuDNN's ``aten::_scaled_dot_product_cudnn_attention`` where PyTorch's own
  SDPA puts it first (Hopper and Blackwell with cuDNN > 9.15: 1.7-2.3x FlashAttention-2 there) and
  the shape fits it, else ``aten::_scaled_dot_product_flash_attention`` (FA2 class); both take
  grouped K/V heads as they are;
- on CUDA with fp32, the memory-efficient kernel, because neither takes fp32.

:func:`choose` makes that choice from the device's facts (a pure function, tested on CPU);
``parallel.attention_kernel`` forces one. :func:`merge` combines partial outputs by their
log-sum-exp in fp32. The private aten ops are called through :mod:`longsft.train.common.compat`,
which checks their schemas.
"""

from __future__ import annotations

import functools
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
    ``masks``: packed documents run as one masked call per block (the CPU kernel); otherwise as one call per
    document of the block (:mod:`.doc_blocks`). ``graph_per_shape``: the kernel builds an execution graph
    the first time it meets a shape (cuDNN: others report hundreds of milliseconds each), so the trainer rounds
    micro-batch lengths up to a few (:func:`~longsft.train.parallel.layout.pad_multiple`). Each CUDA call is checked
    against the kernel's own argument rules in ``tests/cuda_contract.py``.
    """

    name: str
    fwd: Callable
    bwd: Callable
    gqa: bool
    masks: bool = False
    graph_per_shape: bool = False


def _cpu_fwd(q, k, v, causal, scale):
    return aten_op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, causal, scale=scale)


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    return aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(dout, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _flash_fwd(q, k, v, causal, scale):
    # flash_api.cpp mha_fwd: fp16/bf16 only, h % hk == 0, head dim a multiple of 8 ("ensured by padding": SDPA
    # pads it, this private op does not) and <= 256; lse [b, h, sq] fp32, unpadded
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


def _cudnn_fwd(q, k, v, causal, scale):
    # MHA.cpp run_cudnn_SDP_fprop: fp16/bf16 (the graph assumes half unless bf16: never fp32), grouped K/V
    # heads as they are, causal aligned top-left (the ring's causal blocks are square); lse [b, h, sq, 1] fp32
    r = aten_op("_scaled_dot_product_cudnn_attention")(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1].squeeze(-1)


def _cudnn_bwd(dout, q, k, v, out, lse, causal, scale):
    # cuDNN caches the backward graph by q/k/v shapes and strides only: out, dout and lse must have the same
    # layout on every call (contiguous here). cum_seq_q/k undefined (None): not nested; max_q/max_k are the
    # sequence lengths (graph key). The philox state (int64, as the forward makes it) is read only with dropout.
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    return aten_op("_scaled_dot_product_cudnn_attention_backward")(
        dout.contiguous(), q, k, v, out.contiguous(), lse.unsqueeze(-1).contiguous(), seed, seed, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale)


CPU_KERNEL = BlockKernel("cpu_flash", _cpu_fwd, _cpu_bwd, gqa=True, masks=True)
CUDNN_KERNEL = BlockKernel("cuda_cudnn", _cudnn_fwd, _cudnn_bwd, gqa=True, graph_per_shape=True)
FLASH_KERNEL = BlockKernel("cuda_flash", _flash_fwd, _flash_bwd, gqa=True)
EFFICIENT_KERNEL = BlockKernel("cuda_efficient", _efficient_fwd, _efficient_bwd, gqa=False)
KERNELS = {"cudnn": CUDNN_KERNEL, "flash": FLASH_KERNEL, "efficient": EFFICIENT_KERNEL}
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaFacts:
    """What the kernel choice depends on: ``capability`` (major, minor), ``cudnn`` version (e.g. 91900)."""

    capability: tuple[int, int]
    cudnn: int


def cudnn_refuses(dtype: torch.dtype, head_dim: int, facts: CudaFacts) -> str | None:
    """Why cuDNN's attention cannot run this block (None: it can). From PyTorch's sdp_utils.cpp
    ``check_cudnn_*``: fp16/bf16, sm80-sm121, head dim a multiple of 8 and <= 128 (256 on sm90 from
    cuDNN 9.10)."""
    if dtype not in HALF:
        return f"cuDNN attention takes fp16/bf16, not {dtype}"
    if not (8, 0) <= facts.capability <= (12, 1):
        return f"cuDNN attention needs sm80-sm121 (this GPU is sm{facts.capability[0]}{facts.capability[1]})"
    widest = 256 if facts.capability[0] == 9 and facts.cudnn >= 91000 else 128
    if head_dim % 8 or head_dim > widest:
        return f"cuDNN attention needs a head dim that is a multiple of 8 and <= {widest} (it is {head_dim})"
    return None


def flash_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether PyTorch's private flash op takes blocks of ``dtype`` and ``head_dim`` (``mha_fwd``'s checks)."""
    return dtype in HALF and head_dim % 8 == 0 and head_dim <= 256


def choose(dtype: torch.dtype, head_dim: int, facts: CudaFacts, want: str = "auto") -> BlockKernel:
    """The CUDA block kernel for ``dtype`` and ``head_dim`` on a GPU with ``facts``; ``want``: auto,
    cudnn, flash or efficient (``parallel.attention_kernel``; a forced kernel that cannot run is an error).

    auto: cuDNN where PyTorch's SDPA itself puts it first (sm9x/sm10x with cuDNN > 9.15, as its
    ``select_sdp_backend``) and it takes the block; else flash for fp16/bf16 (head dim a multiple of 8, <= 256:
    ``flash_api.cpp`` ``mha_fwd``; SDPA pads other head dims, the private op does not); else
    the memory-efficient kernel (fp32, wider heads).
    """
    if want == "auto":
        if facts.capability[0] in (9, 10) and facts.cudnn > 91500 and cudnn_refuses(dtype, head_dim, facts) is None:
            return CUDNN_KERNEL
        return FLASH_KERNEL if flash_takes(dtype, head_dim) else EFFICIENT_KERNEL
    if want not in KERNELS:
        raise ValueError(f"parallel.attention_kernel={want!r}: one of auto, {', '.join(KERNELS)}")
    why = {"cudnn": cudnn_refuses(dtype, head_dim, facts),
           "flash": None if flash_takes(dtype, head_dim) else
           f"flash attention takes fp16/bf16 and head dims that are multiples of 8 up to 256 ({dtype}, {head_dim})",
           "efficient": None}[want]
    if why:
        raise ValueError(f"parallel.attention_kernel={want}: {why}; use auto")
    return KERNELS[want]


@functools.cache
def cuda_facts(index: int) -> CudaFacts:
    """The facts :func:`choose` needs about CUDA device ``index``."""
    return CudaFacts(tuple(torch.cuda.get_device_capability(index)), torch.backends.cudnn.version() or 0)


def block_kernel(device_type: str, dtype: torch.dtype, want: str = "auto", head_dim: int = 128,
                 device_index: int | None = None) -> BlockKernel:
    """The fused kernel the ring and Ulysses use for ``head_dim`` tensors of ``dtype`` on ``device_type``
    (CUDA: :func:`choose` on the current device's facts; ``want`` forces a kernel there)."""
    if device_type == "cuda":
        index = torch.cuda.current_device() if device_index is None else device_index
        return choose(dtype, head_dim, cuda_facts(index), want)
    if device_type == "cpu":
        if want != "auto":
            raise ValueError(f"parallel.attention_kernel={want} chooses among the kernels of CUDA GPUs; this "
                             "machine runs PyTorch's CPU kernel (use auto)")
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
    if docs is not None:  # packed documents: an explicit mask (the CPU kernel: ``BlockKernel.masks``)
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


def merge_(out, lse, blk_out, blk_lse) -> None:
    """Add a block's partial softmax-attention into ``out`` and ``lse`` in place (fp32), by their
    log-sum-exp: out [b, h, s, d], lse [b, h, s], views of the row's accumulators.

    ``out += sigmoid(blk_lse - lse) * (blk_out - out)`` and ``lse -= logsigmoid(lse - blk_lse)``: two
    passes over ``out`` (torch's context parallelism merges in this form). ``lse`` must be finite (the
    ring's first block, the causal diagonal, gives every row its own key); a block row that sees no key
    (``blk_lse`` -inf) leaves the row as it was.
    """
    weight = torch.sigmoid(blk_lse - lse).unsqueeze(-1)
    out.lerp_(blk_out.to(out.dtype), weight)
    lse.sub_(torch.nn.functional.logsigmoid(lse - blk_lse))
