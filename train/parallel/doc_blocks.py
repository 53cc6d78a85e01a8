"""Packed documents in a ring block without a mask: the block cut into one dense piece per document.

CUDA's fused kernels that return the log-sum-exp (cuDNN, flash, memory-efficient as the ring calls it)
take no mask, so a block of packed documents cannot be masked there. It need not be. Documents are
contiguous in position order, and a block's query rows and key columns are each in position order
(one rank's zigzag chunks, in order), so a document is one run of rows and one run of columns of
the block. Every (row, column) pair of one document is allowed, except in the causal diagonal block,
where rows and columns are the same tokens and a document's pair of runs is its own causal square.
Each row and each column therefore lies in at most one piece: the block's output and gradients are
its pieces side by side, and a row with no piece weighs nothing in the merge (log-sum-exp -inf).

One kernel call per piece (a document of the block), on contiguous copies of its rows: every kernel's
argument rules hold as for a whole block (causal pieces are square). cuDNN's attention gets only a
piece as large as its block (a document covering it, the common case for long documents); flash takes
the others. cuDNN builds an execution graph for every new shape (hundreds of milliseconds; PyTorch
caches them by shape and stride), so pieces of every document length would build graphs on every
step, while whole-block pieces have the few shapes of the unpacked ring. That also keeps cuDNN from a
piece of one query or one key, which PyTorch's SDPA never sends it (``sdp_utils.cpp``
``check_cudnn_tensor_shapes``: "cudnn SDPA does not support sequence length 1").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longsft.train.parallel.kernels import CUDNN_KERNEL, FLASH_KERNEL, BlockKernel


@dataclass(frozen=True)
class Piece:
    """One document's part of a block: batch row ``row``, query rows [q0, q1), key columns [k0, k1)."""

    row: int
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _runs(ids: list[int]) -> dict[int, tuple[int, int]]:
    """Each document id's [start, end) in ``ids``; an id in two runs is an error (not contiguous)."""
    runs: dict[int, tuple[int, int]] = {}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            if ids[start] in runs:
                raise ValueError(f"document id {ids[start]} appears in two runs of a ring block: packed documents "
                                 "must be contiguous in position order")
            runs[ids[start]] = (start, i)
            start = i
    return runs


def block_pieces(q_ids: list[list[int]], k_ids: list[list[int]], causal: bool) -> tuple[Piece, ...]:
    """The pieces of one block: ``q_ids`` [b][sq] the document of each query row, ``k_ids`` [b][sk] of
    each key column, both in position order; ``causal``: the diagonal block (rows and columns the same
    tokens)."""
    pieces = []
    for row, (qi, ki) in enumerate(zip(q_ids, k_ids, strict=True)):
        if causal and qi != ki:
            raise ValueError("a causal ring block has the same tokens as rows and columns")
        keys = _runs(ki)
        for doc, (q0, q1) in _runs(qi).items():
            if doc in keys:
                pieces.append(Piece(row, q0, q1, *keys[doc], causal))
    return tuple(pieces)


def piece_kernel(kernel: BlockKernel, piece: Piece, block: tuple[int, int]) -> BlockKernel:
    """The kernel for ``piece`` of a block of ``block`` = (query rows, key columns): cuDNN's only for a
    piece as large as the block (a few shapes, few cuDNN graphs), flash for the rest."""
    whole = (piece.q1 - piece.q0, piece.k1 - piece.k0) == block and min(block) > 1
    return FLASH_KERNEL if kernel is CUDNN_KERNEL and not whole else kernel


def _cut(t: torch.Tensor, piece: Piece, rows: bool) -> torch.Tensor:
    """A piece's query rows (``rows``) or key columns of ``t`` [b, h, s(, d)], contiguous."""
    s = slice(piece.q0, piece.q1) if rows else slice(piece.k0, piece.k1)
    return t[piece.row:piece.row + 1, :, s].contiguous()


def pieces_fwd(kernel: BlockKernel, q, k, v, scale: float, pieces: tuple[Piece, ...]):
    """One block of packed documents: out [b, h, sq, d] (q's dtype), lse [b, h, sq] fp32 (-inf: no key)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for p in pieces:
        run = piece_kernel(kernel, p, (q.shape[2], k.shape[2]))
        o, m = run.fwd(_cut(q, p, True), _cut(k, p, False), _cut(v, p, False), p.causal, scale)
        out[p.row:p.row + 1, :, p.q0:p.q1] = o
        lse[p.row:p.row + 1, :, p.q0:p.q1] = m
    return out, lse


def pieces_bwd(kernel: BlockKernel, dout, q, k, v, out, lse, scale: float, pieces: tuple[Piece, ...]):
    """Gradients of one block of packed documents given the rows' *final* ``out`` and ``lse``:
    dq [b, h, sq, d], dk, dv [b, hk, sk, d] (zero where no piece)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for p in pieces:
        run = piece_kernel(kernel, p, (q.shape[2], k.shape[2]))
        g = run.bwd(_cut(dout, p, True), _cut(q, p, True), _cut(k, p, False), _cut(v, p, False), _cut(out, p, True),
                    _cut(lse, p, True), p.causal, scale)
        dq[p.row:p.row + 1, :, p.q0:p.q1] = g[0]
        dk[p.row:p.row + 1, :, p.k0:p.k1] = g[1]
        dv[p.row:p.row + 1, :, p.k0:p.k1] = g[2]
    return dq, dk, dv
