"""Backend ``ring_flash_attn``: ring-flash-attn's zigzag ring on flash-attn's kernels.

This is the usual GPU path, for users who have flash-attn. Its forward and backward are
ring-flash-attn's. flash-attn takes bf16/fp16 only. Its fp32 backward was seen wrong, so
``model.dtype=fp32`` is a config error for this backend. Packed documents use its llama3 varlen
function on contiguous shards: K/V are all-gathered and the documents are passed as cu_seqlens.
"""

from __future__ import annotations

import importlib.util

import torch

from longsft.train.common.compat import import_bare
from longsft.train.config.backends import check_backend
from longsft.train.parallel import comm
from longsft.train.parallel.context import Documents, SequenceParallel


def ring_flash_module(name: str = "zigzag_ring_flash_attn"):
    """A module of ring-flash-attn (``zigzag_ring_flash_attn`` or ``llama3_flash_attn_varlen``),
    imported without the package's ``__init__`` (:func:`~longsft.train.common.compat.import_bare`).

    ring-flash-attn 0.1.8's ``__init__`` imports its Hugging Face adapter, which imports a helper that
    transformers 5 moved (``is_flash_attn_greater_or_equal_2_10``); we use only the ring functions
    (our own attention-registry entry replaces the adapter). Nothing of transformers is patched.
    """
    if importlib.util.find_spec("ring_flash_attn") is None or importlib.util.find_spec("flash_attn") is None:
        check_backend("ring_flash_attn", 2)  # raises with the fix
    return import_bare("ring_flash_attn", name, "ring-flash-attn")


def ring_flash_attention(sp: SequenceParallel, q, k, v, scale: float | None = None,
                         docs: Documents | None = None) -> torch.Tensor:
    """ring-flash-attn on flash-attn kernels (GPU), over ``sp``'s group. [b, h, s_local, d] -> same.

    Unpacked: its zigzag ring on the zigzag shards of :func:`shard_batch`. Packed (``docs``, ids
    [b, s_local]): its llama3 varlen function on contiguous shards (``SequenceParallel.layout``): K/V are
    all-gathered and each document attends causally within itself. flash-attn's layout is
    [b, s, h, d] ([tokens, h, d] for varlen); grouped K/V heads are passed as they are.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if docs is None:
        ring = ring_flash_module().zigzag_ring_flash_attn_func
        return ring(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
                    causal=True, group=sp.group).transpose(1, 2)
    llama3 = ring_flash_module("llama3_flash_attn_varlen")
    rows = []
    for b, (cu_q, cu_k, max_q, max_k, k_slice) in enumerate(_varlen_plans(sp, docs, llama3)):
        out = llama3.llama3_flash_attn_varlen_func(
            q[b].transpose(0, 1), k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(), cu_q, cu_k,
            max_q, max_k, heads_k_stride=k.shape[1], local_k_slice=k_slice, softmax_scale=scale, causal=True,
            group=sp.group)
        rows.append(out.transpose(0, 1))  # [s_local, h, d] -> [h, s_local, d]
    return torch.stack(rows)


def _varlen_plans(sp: SequenceParallel, docs: Documents, llama3) -> list[tuple]:
    """Per row: this rank's cu_seqlens for q and k, max lengths and the K slice (made once per batch, kept
    on ``docs``)."""
    if docs.varlen is not None:
        return docs.varlen
    full = torch.cat(comm.all_gather(docs.ids, sp.group), dim=1)  # contiguous shards: rank order is position order
    plans = []
    for row in full:
        bounds = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist(), row.numel()]
        cu = torch.tensor(bounds, dtype=torch.int32, device=docs.ids.device)
        plans.append(llama3.llama3_flash_attn_prepare_cu_seqlens(cu, True, sp.rank, sp.size))
    docs.varlen = plans
    return plans
