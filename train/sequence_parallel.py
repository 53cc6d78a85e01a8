"""Sequence parallelism: one sequence split over the ``sp_size`` ranks of an SP group.

Data path (:func:`shard_batch`): a collated batch (labels already shifted, position_ids already
built) is padded to a multiple of ``2 * sp_size`` and split in the zigzag layout: the sequence is
cut into ``2 * sp`` chunks and SP rank ``r`` holds chunks ``r`` and ``2*sp - 1 - r``, which gives
every rank the same amount of causal attention work.

Attention (:func:`zigzag_ring_attention`): the ``torch`` backend. K/V blocks travel around the
ring; each block is attended with PyTorch's own fused kernel that also returns the log-sum-exp
(:class:`BlockKernel`: ``aten::_scaled_dot_product_flash_attention_for_cpu`` on CPU; on CUDA
``..._flash_attention`` for fp16/bf16, with grouped K/V heads as they are, and the memory-efficient
kernel for fp32, which flash does not take), and the partial outputs are merged with their
log-sum-exp in fp32. The backward pass is our
own: each block's gradient is computed by the kernel's backward with the *final* output and
log-sum-exp, dQ stays local and dK/dV travel around the ring back to their owner. We implement the
ring rather than reuse ring-flash-attn's because its ring/zigzag backward was seen wrong in fp32
on CPU, and because its import needs the flash-attn package that neither CPU machines nor our GPU
image have; this version is right in fp32 and bf16 (tests/test_sequence_parallel.py).

Backend ``ring_flash_attn`` (:func:`ring_flash_attention`): ring-flash-attn's own zigzag ring on
flash-attn's kernels, the usual GPU path, for users who have flash-attn. Its forward and backward
are ring-flash-attn's; flash-attn takes bf16/fp16 only, and the fp32 backward seen wrong is
refused with it (``model.dtype=fp32`` is a config error for this backend). Packed documents use its
llama3 varlen function on contiguous shards (K/V all-gathered, documents as cu_seqlens).

Backend ``ulysses`` (:func:`ulysses_attention`): DeepSpeed-Ulysses' scheme — all-to-all from
sequence shards to head shards, local causal SDPA over the whole sequence, all-to-all back — on
the same zigzag shards (a fixed permutation puts positions in order). We implement it here rather
than use DeepSpeed's ``UlyssesSPAttentionHF``: that one replaces the process-wide ``sdpa`` entry of
transformers' registry, needs its own data-loader adapter and an ``mpu`` (changing DeepSpeed's
gradient averaging), and lost document boundaries of packed inputs; this one shares the data path,
loss normalisation and checks of the ring.

The attention is registered in transformers' attention registry under ``longsft_sp``; no
transformers function is patched. Outside :func:`active` (e.g. ``generate`` in validation) it is
plain SDPA over an unsplit sequence.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import comm
from .config import ConfigError

ATTN_NAME = "longsft_sp"
BACKENDS = ("torch", "ring_flash_attn", "ulysses")


def check_heads(backend: str, sp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Ulysses splits attention heads over the SP group: they must divide evenly."""
    if backend == "ulysses" and sp_size > 1 and num_heads % sp_size:
        raise ConfigError(f"parallel.sp_backend=ulysses splits the model's {num_heads} attention heads over "
                          f"sp_size={sp_size} ranks, which does not divide them; use an sp_size that divides "
                          f"{num_heads}, or parallel.sp_backend=torch (the ring has no such limit)")


@dataclass
class _State:
    backend: str = "torch"
    group: object = None
    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = ()
    active: bool = False
    doc_ids: torch.Tensor | None = None  # [batch, s_local] when documents are packed
    varlen: tuple = (None, None)  # (doc_ids, per-row llama3 cu_seqlens plans) of the current batch


_SP = _State()


def check_backend(backend: str, sp_size: int, packing: bool = False) -> None:
    """Fail at start-up, with the fix, for a backend that cannot run here."""
    if packing and sp_size > 1 and backend == "torch" and torch.cuda.is_available():
        raise ConfigError("data.packing with the torch ring on GPUs needs per-block document masks, which "
                          "PyTorch's CUDA flash kernel lacks; use parallel.sp_backend=ulysses or ring_flash_attn, or "
                          "data.packing=false")
    if sp_size == 1 or backend == "torch":
        return
    if backend == "ring_flash_attn":
        for package, pip in (("flash_attn", "flash-attn"), ("ring_flash_attn", "ring-flash-attn")):
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"parallel.sp_backend=ring_flash_attn needs the {pip} package (GPUs): pip install "
                                  f"{pip}, or parallel.sp_backend=torch, the same zigzag ring on PyTorch's fused kernels")
        return
    if backend == "ulysses":
        return
    raise ConfigError(f"unknown parallel.sp_backend {backend!r}; one of {list(BACKENDS)}")


def setup(group, ranks: list[int], rank: int, backend: str = "torch") -> None:
    """Remember this rank's SP group and register the attention function (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _SP.group, _SP.ranks, _SP.size, _SP.rank = group, tuple(ranks), len(ranks), ranks.index(rank)
    _SP.backend = backend
    if backend == "ring_flash_attn" and len(ranks) > 1:
        _ring_flash_attn_func()  # import now: a broken install fails here, not in the first forward
    AttentionInterface.register(ATTN_NAME, sp_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sp_mask)


@contextlib.contextmanager
def active(enabled: bool = True, doc_ids: torch.Tensor | None = None):
    """Inside: attention layers expect zigzag-sharded sequences (and, with ``doc_ids``, packed
    documents that must not see each other)."""
    prev = _SP.active, _SP.doc_ids
    _SP.active = enabled and (_SP.size > 1 or doc_ids is not None)
    _SP.doc_ids = doc_ids
    try:
        yield
    finally:
        _SP.active, _SP.doc_ids = prev


# --------------------------------------------------------------------------- data


def zigzag_index(seq_len: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """Positions held by ``sp_rank``: chunks r and 2*sp-1-r of ``2*sp`` equal chunks. [seq_len / sp]"""
    c = seq_len // (2 * sp_size)
    first = torch.arange(sp_rank * c, (sp_rank + 1) * c)
    second = torch.arange((2 * sp_size - 1 - sp_rank) * c, (2 * sp_size - sp_rank) * c)
    return torch.cat([first, second])


def shard_batch(batch: dict[str, torch.Tensor], sp_size: int, sp_rank: int, pad_id: int,
                layout: str = "zigzag") -> dict[str, torch.Tensor]:
    """Pad ``[batch, seq]`` tensors to a multiple of 2*sp and keep this rank's zigzag part (or, with
    ``layout="contiguous"``, its contiguous slice).

    Labels were shifted before this split (each position carries its own next-token target) and
    position_ids were built on the whole sequence, so RoPE and the loss need no communication.
    Padding goes at the end; causal attention never lets a real token see it, so the attention
    mask is dropped.
    """
    if sp_size == 1:
        return batch
    n = batch["input_ids"].shape[1]
    target = -(-n // (2 * sp_size)) * (2 * sp_size)
    fill = {"input_ids": pad_id, "shift_labels": -100, "attention_mask": 0, "doc_ids": -1}
    out = {}
    c = target // sp_size
    idx = zigzag_index(target, sp_size, sp_rank) if layout == "zigzag" else torch.arange(sp_rank * c, (sp_rank + 1) * c)
    for key, t in batch.items():
        if target > n:
            if key == "position_ids":
                extra = t[:, -1:] + torch.arange(1, target - n + 1)
            else:
                extra = torch.full((t.shape[0], target - n), fill[key], dtype=t.dtype)
            t = torch.cat([t, extra], dim=1)
        out[key] = t[:, idx]
    out.pop("attention_mask")
    return out


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
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _flash_fwd(q, k, v, causal, scale):
    # flash_api.cpp mha_fwd: fp16/bf16 only, h % hk == 0, head dim <= 256; lse [b, h, sq] fp32, unpadded
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _flash_bwd(dout, q, k, v, out, lse, causal, scale):
    # cum_seq_q/k must be undefined (None): _flash_attention_backward takes the varlen kernel for any
    # *defined* tensor, an empty one included, and fails there. The philox state (uint64, as the forward
    # returns it) is read only with dropout.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp rows to this (kernel_forward.h kAlignLSE)


def _efficient_fwd(q, k, v, causal, scale):
    # memory-efficient kernel (fp32 as well as fp16/bf16; equal head counts); its lse is [b, h, ceil32(sq)]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                            scale=scale)
    return out, lse[..., : q.shape[2]]


def _efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    # the backward reads the lse in the forward's padded layout (row stride a multiple of 8)
    n = q.shape[2]
    padded = lse.new_full((*lse.shape[:2], -(-n // LSE_ALIGN) * LSE_ALIGN), float("inf"))
    padded[..., :n] = lse
    seed = torch.empty((), dtype=torch.int64)  # as the forward returns it without dropout; read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
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


def _block_fwd(kernel: BlockKernel, q, k, v, causal: bool, scale: float, docs=None):
    """One block: out [b, h, s, d], lse [b, h, s] (fp32). ``docs`` = (doc ids of q rows, of k)."""
    if docs is not None:  # packed documents: an explicit mask (CPU kernel only, checked at start-up)
        mask, empty = _block_mask(docs[0], docs[1], causal, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                              scale=scale)
        # the kernel reports lse 0 for a row with no visible key; it must weigh nothing in the merge
        return out.masked_fill(empty[:, None, :, None], 0), lse.masked_fill(empty[:, None], float("-inf"))
    return kernel.fwd(q, k, v, causal, scale)


def _block_bwd(kernel: BlockKernel, dout, q, k, v, out, lse, causal: bool, scale: float, docs=None):
    """Gradients of one block given the *final* ``out`` and ``lse`` of the full attention row."""
    if docs is not None:
        mask, _ = _block_mask(docs[0], docs[1], causal, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    return kernel.bwd(dout, q, k, v, out, lse, causal, scale)


def _merge(out, lse, blk_out, blk_lse):
    """Combine two partial softmax-attentions by their log-sum-exp (fp32). out [b,h,s,d], lse [b,h,s]."""
    new = torch.logaddexp(lse, blk_lse)
    a = torch.exp(lse - new).nan_to_num(0.0)  # nan only where both are -inf (no key seen yet)
    b = torch.exp(blk_lse - new).nan_to_num(0.0)
    return out * a.unsqueeze(-1) + blk_out.float() * b.unsqueeze(-1), new


def _ring_pass(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Send to the next SP rank, receive from the previous one (a group of one keeps its own)."""
    if _SP.size == 1:
        return tensors
    return comm.ring_shift(tensors, _SP.ranks, _SP.rank, _SP.group)


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
    src = (_SP.rank - step) % _SP.size
    if step == 0:
        qs, ks, causal = slice(None), slice(None), True
    elif src < _SP.rank:
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
        for step in range(_SP.size):
            qs, ks, causal, kk, vv, blk_docs = _plan(step, c, groups, kc, vc, docs, dc)
            blk_out, blk_lse = _block_fwd(kernel, q[:, :, qs].contiguous(), kk, vv, causal, scale, blk_docs)
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            if step < _SP.size - 1:
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
        for step in range(_SP.size):
            qs, ks, causal, kk, vv, blk_docs = _plan(step, c, groups, kc, vc, docs, dc)
            dq_b, dk_b, dv_b = _block_bwd(kernel, dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(), kk, vv,
                                          out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale,
                                          blk_docs)
            dq[:, :, qs] += dq_b.float()
            if groups > 1:  # fold the repeated heads back onto their KV head
                dk_b = dk_b.unflatten(1, (-1, groups)).sum(2)
                dv_b = dv_b.unflatten(1, (-1, groups)).sum(2)
            dk_acc[:, :, ks] += dk_b.float()
            dv_acc[:, :, ks] += dv_b.float()
            if step < _SP.size - 1:
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


def _ring_flash_attn_func(name: str = "zigzag_ring_flash_attn"):
    """A module of ring-flash-attn (``zigzag_ring_flash_attn`` or ``llama3_flash_attn_varlen``),
    imported without the package's ``__init__``.

    ring-flash-attn 0.1.8's ``__init__`` imports its Hugging Face adapter, which imports a helper that
    transformers 5 moved (``is_flash_attn_greater_or_equal_2_10``); we use only the ring functions
    (our own attention-registry entry replaces the adapter), so the package is registered bare and
    its ring modules imported directly. Nothing of transformers is patched.
    """
    if f"ring_flash_attn.{name}" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None or importlib.util.find_spec("flash_attn") is None:
            check_backend("ring_flash_attn", 2)  # raises with the fix
        if "ring_flash_attn" not in sys.modules:
            package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(
                "ring_flash_attn", None, is_package=True))
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules["ring_flash_attn"] = package
    return importlib.import_module(f"ring_flash_attn.{name}")


def ring_flash_attention(q, k, v, scale: float | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """ring-flash-attn on flash-attn kernels (GPU). [b, h, s_local, d] -> same.

    Unpacked: its zigzag ring on the zigzag shards of :func:`shard_batch`. Packed (``doc_ids``
    [b, s_local]): its llama3 varlen function on contiguous shards (see :func:`layout`): K/V are
    all-gathered and each document attends causally within itself. flash-attn's layout is
    [b, s, h, d] ([tokens, h, d] for varlen); grouped K/V heads are passed as they are.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if doc_ids is None:
        ring = _ring_flash_attn_func().zigzag_ring_flash_attn_func
        return ring(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
                    causal=True, group=_SP.group).transpose(1, 2)
    llama3 = _ring_flash_attn_func("llama3_flash_attn_varlen")
    rows = []
    for b, (cu_q, cu_k, max_q, max_k, k_slice) in enumerate(_varlen_plans(doc_ids, llama3)):
        out = llama3.llama3_flash_attn_varlen_func(
            q[b].transpose(0, 1), k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(), cu_q, cu_k,
            max_q, max_k, heads_k_stride=k.shape[1], local_k_slice=k_slice, softmax_scale=scale, causal=True,
            group=_SP.group)
        rows.append(out.transpose(0, 1))  # [s_local, h, d] -> [h, s_local, d]
    return torch.stack(rows)


def _varlen_plans(doc_ids: torch.Tensor, llama3) -> list[tuple]:
    """Per row: this rank's cu_seqlens for q and k, max lengths and the K slice (cached per batch)."""
    if _SP.varlen[0] is doc_ids:
        return _SP.varlen[1]
    full = torch.cat(comm.all_gather(doc_ids, _SP.group), dim=1)  # contiguous shards: rank order is position order
    plans = []
    for row in full:
        bounds = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.numel()]
        cu = torch.tensor(bounds, dtype=torch.int32, device=doc_ids.device)
        plans.append(llama3.llama3_flash_attn_prepare_cu_seqlens(cu, True, _SP.rank, _SP.size))
    _SP.varlen = (doc_ids, plans)
    return plans


def layout(packed: bool) -> str:
    """How :func:`shard_batch` splits sequences for the active backend: ``zigzag`` or ``contiguous``
    (ring-flash-attn's llama3 varlen ring for packed documents wants each rank's slice in order)."""
    return "contiguous" if packed and _SP.backend == "ring_flash_attn" and _SP.size > 1 else "zigzag"


def _spans(doc_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal document ids (documents are contiguous in position order)."""
    change = (torch.nonzero(doc_row[1:] != doc_row[:-1]).flatten() + 1).tolist()
    bounds = [0, *change, doc_row.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def per_document_attention(q, k, v, scale: float | None, doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal SDPA inside each document of whole (unsplit) sequences. q [b, h, s, d], doc_ids [b, s]."""
    import torch.nn.functional as F

    gqa = k.shape[1] != q.shape[1]
    rows = []
    for b in range(q.shape[0]):
        parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                is_causal=True, scale=scale, enable_gqa=gqa)
                 for s, e in _spans(doc_ids[b])]
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
    n = _SP.size
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [sp(dest), b, h/sp, s, d]
    recv = comm.all_to_all(send, _SP.group)  # [sp(source), b, h/sp, s, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x):
    b, hl, S, d = x.shape
    n = _SP.size
    send = x.reshape(b, hl, n, S // n, d).permute(2, 0, 1, 3, 4)  # [sp(dest), b, h/sp, s, d]
    recv = comm.all_to_all(send, _SP.group)  # [sp(source = head block), b, h/sp, s, d]
    return recv.transpose(0, 1).reshape(b, n * hl, S // n, d)


def ulysses_attention(q, k, v, scale: float | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention by head-splitting all-to-all (DeepSpeed-Ulysses' scheme) on zigzag shards.

    q [b, h, s_local, d]; k, v [b, hk, s_local, d]. After the all-to-all every rank holds the
    whole sequence for h/sp heads, in rank order of zigzag chunks; a fixed permutation restores
    position order for plain causal SDPA and is undone afterwards. KV heads are repeated up to the
    query heads only when they do not divide over the group.
    """
    import torch.nn.functional as F

    n, h, hk = _SP.size, q.shape[1], k.shape[1]
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
        gathered = torch.cat(comm.all_gather(doc_ids, _SP.group), dim=1)
        out = per_document_attention(qf, kf, vf, scale, gathered[:, to_pos])
    return _AllToAll.apply(out[:, :, order].contiguous(), False)


def sp_mask(**kwargs):
    """The attention mask transformers builds for ``longsft_sp``: none while :func:`active` (the ring,
    Ulysses and per-document attention take positions from the layout and documents from ``doc_ids``;
    the zigzag position jumps would otherwise make transformers build a [b, 1, s_local, s_local] mask
    for packed sequences that nothing reads), SDPA's otherwise (the unsplit fallback, e.g. generation)."""
    from transformers.masking_utils import sdpa_mask

    return None if _SP.active else sdpa_mask(**kwargs)


def sp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs):
    """transformers attention interface: query [b, h, s, d] -> output [b, s, h, d], no weights."""
    if not _SP.active:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("sequence-parallel attention does not support attention dropout")
    if _SP.size == 1:  # packed documents on one rank
        out = per_document_attention(query, key, value, scaling, _SP.doc_ids)
    else:
        attend = {"ulysses": ulysses_attention, "ring_flash_attn": ring_flash_attention}.get(
            _SP.backend, zigzag_ring_attention)
        out = attend(query, key, value, scaling, _SP.doc_ids)
    return out.transpose(1, 2).contiguous(), None
