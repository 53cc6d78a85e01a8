"""CUDA-only code paths, checked without a GPU.

The ring's CUDA kernel calls run on meta tensors under :class:`CudaAttentionContract` (the CUDA
kernels' own argument rules, tests/cuda_contract.py), for every block shape the zigzag ring makes
on 1, 2 and 4 ranks, in bf16, fp16 and fp32; the contract itself is shown to reject the calls that
crashed before (an empty ``cum_seq`` tensor, fp32 into flash, an unpadded efficient-kernel lse).
The same ring runs on CPU on one rank without a process group (as ``bench/gpu_attention.py`` calls it)
against PyTorch's SDPA. Packed documents, which the CUDA kernels take as one dense piece per document
of a block (``train/parallel/doc_blocks.py``), get the same three checks: every block's pieces on meta
tensors under the contract, and the piece path on CPU against masked SDPA.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from cuda_contract import ContractViolation, CudaAttentionContract

from longsft.train.parallel.attention import SPAttention
from longsft.train.parallel.doc_blocks import Piece, block_pieces, piece_kernel, pieces_bwd, pieces_fwd
from longsft.train.parallel.kernels import (
    CPU_KERNEL,
    CUDNN_KERNEL,
    EFFICIENT_KERNEL,
    FLASH_KERNEL,
    LSE_ALIGN,
    CudaFacts,
    _cudnn_bwd,
    _cudnn_fwd,
    _efficient_fwd,
    _flash_fwd,
    block_kernel,
    choose,
    merge_,
)
from longsft.train.parallel.ring import block_plan, block_slices, zigzag_ring_attention

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


H200 = CudaFacts((9, 0), 91900)  # torch 2.11+cu130's cuDNN on Hopper
A100 = CudaFacts((8, 0), 91900)


def test_kernel_choice():
    """auto: cuDNN where torch's SDPA puts it first (sm9x/sm10x, cuDNN > 9.15) and the block fits it,
    flash for other fp16/bf16, memory-efficient for fp32; a forced kernel that cannot run is an error."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert choose(bf16, 128, H200) is CUDNN_KERNEL and choose(fp16, 64, H200) is CUDNN_KERNEL
    assert choose(bf16, 256, H200) is CUDNN_KERNEL  # sm90 with cuDNN >= 9.10 takes head dim 256
    assert choose(bf16, 256, CudaFacts((10, 0), 91900)) is FLASH_KERNEL  # elsewhere <= 128
    # not a multiple of 8: neither cuDNN nor PyTorch's private flash op (mha_fwd: "head_size must be a multiple
    # of 8, this is ensured by padding!", which public SDPA does and the ring would not)
    assert choose(bf16, 100, H200) is EFFICIENT_KERNEL and choose(bf16, 100, A100) is EFFICIENT_KERNEL
    assert choose(bf16, 128, CudaFacts((9, 0), 91400)) is FLASH_KERNEL  # an older cuDNN: SDPA prefers flash too
    assert choose(bf16, 128, A100) is FLASH_KERNEL  # Ampere: flash first, as SDPA
    assert choose(fp32, 128, H200) is EFFICIENT_KERNEL  # neither cuDNN nor flash takes fp32
    assert choose(bf16, 512, A100) is EFFICIENT_KERNEL
    assert choose(bf16, 128, A100, "cudnn") is CUDNN_KERNEL  # sm80 can run it when asked
    assert choose(bf16, 128, H200, "flash") is FLASH_KERNEL and choose(bf16, 128, H200, "efficient") is EFFICIENT_KERNEL
    for want, facts, dtype, why in (("cudnn", H200, fp32, "fp16/bf16"), ("cudnn", CudaFacts((7, 5), 91900), bf16,
                                    "sm80-sm121"), ("flash", H200, fp32, "fp16/bf16"), ("fast", H200, bf16, "one of")):
        with pytest.raises(ValueError, match=f"attention_kernel={want}.*{why}|{why}"):
            choose(dtype, 128, facts, want)
    with pytest.raises(ValueError, match="attention_kernel=flash: .*multiples of 8"):
        choose(bf16, 100, A100, "flash")
    assert block_kernel("cpu", torch.float32) is CPU_KERNEL
    with pytest.raises(ValueError, match="CUDA GPUs"):
        block_kernel("cpu", torch.float32, "cudnn")
    with pytest.raises(ValueError, match="no kernel for meta"):
        block_kernel("meta", torch.float32)


def _kernels(dtype):
    return [CUDNN_KERNEL, FLASH_KERNEL] if dtype in (torch.bfloat16, torch.float16) else [EFFICIENT_KERNEL]


KERNEL_CASES = [(dtype, kernel) for dtype in (torch.bfloat16, torch.float16, torch.float32) for kernel in _kernels(dtype)]
KERNEL_IDS = [f"{str(d).split('.')[1]}-{k.name}" for d, k in KERNEL_CASES]


def _meta(shape, dtype, grad=False):
    return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("dtype,kernel", KERNEL_CASES, ids=KERNEL_IDS)
def test_ring_on_one_rank_makes_valid_cuda_calls(dtype, kernel):
    """The whole ring (forward and backward, one rank, no process group) with each CUDA kernel on meta
    tensors: one kernel call each way."""
    q, k, v = _meta((1, 8, 74, 64), dtype, True), _meta((1, 2, 74, 64), dtype, True), _meta((1, 2, 74, 64), dtype, True)
    with CudaAttentionContract() as contract:
        out = zigzag_ring_attention(q, k, v, kernel=kernel)
        out.backward(torch.empty_like(out))
    assert out.shape == q.shape and out.dtype == dtype
    assert k.grad.shape == k.shape and q.grad.shape == q.shape
    assert len(contract.calls) == 2 and all(n == 1 for n in contract.calls.values()), contract.calls


@pytest.mark.parametrize("dtype,kernel", KERNEL_CASES, ids=KERNEL_IDS)
@pytest.mark.parametrize("size", [2, 4])
def test_every_ring_block_makes_valid_cuda_calls(dtype, kernel, size):
    """Each rank's block at each ring step (the shapes ``block_plan`` cuts), forward and backward."""
    c, h, hk, d = 37, 8, 2, 128  # odd chunk length: the efficient kernel's lse padding matters
    groups = 1 if kernel.gqa else h // hk
    calls = 0
    for rank in range(size):
        for step in range(size):
            kc, vc = _meta((1, hk, 2 * c, d), dtype), _meta((1, hk, 2 * c, d), dtype)
            qs, ks, causal, kk, vv, _ = block_plan(rank, size, step, c, groups, kc, vc, None, None)
            q = _meta((1, h, 2 * c, d), dtype)[:, :, qs].contiguous()
            with CudaAttentionContract() as contract:
                out, lse = kernel.fwd(q, kk, vv, causal, d ** -0.5)
                assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3])
                dq, dk, dv = kernel.bwd(torch.empty_like(out), q, kk, vv, out, lse.contiguous(), causal,
                                        d ** -0.5)
            assert dq.shape == q.shape and dk.shape == kk.shape and dv.shape == vv.shape
            calls += sum(contract.calls.values())
    assert calls == 2 * size * size


def test_the_contract_rejects_the_calls_that_crashed():
    q = _meta((1, 4, 64, 64), torch.bfloat16)
    out, lse = _meta((1, 4, 64, 64), torch.bfloat16), _meta((1, 4, 64), torch.float32)
    seed, offset = _meta((2,), torch.uint64), _meta((), torch.uint64)
    empty = torch.empty(0, device="meta", dtype=torch.int32)
    with CudaAttentionContract(), pytest.raises(ContractViolation, match="must be undefined"):
        torch.ops.aten._scaled_dot_product_flash_attention_backward(out, q, q, q, out, lse, empty, empty, 64, 64, 0.0,
                                                                    True, seed, offset, scale=0.125)
    with CudaAttentionContract(), pytest.raises(ContractViolation, match="not in"):
        _flash_fwd(q.float(), q.float(), q.float(), True, 0.125)
    q32 = _meta((1, 4, 37, 64), torch.float32)
    o32, lse32, s, off = torch.ops.aten._scaled_dot_product_efficient_attention(q32, q32, q32, None, True, 0.0, True)
    assert lse32.shape[-1] == LSE_ALIGN * 2  # padded by the kernel
    with CudaAttentionContract(), pytest.raises(ContractViolation, match="head stride multiple of 8"):
        torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            o32, q32, q32, q32, None, o32, lse32[..., :37].contiguous(), s, off, 0.0, [True, True, True, False], True)
    with CudaAttentionContract(), pytest.raises(ContractViolation, match="head counts must be equal"):
        _efficient_fwd(q32, q32[:, :2], q32[:, :2], True, 0.125)
    # cuDNN: fp32 is refused (its graph would read it as half); the backward wants the forward's [b, h, s, 1]
    # log-sum-exp, contiguous out/grad_out, and undefined cum_seq tensors
    with CudaAttentionContract(), pytest.raises(ContractViolation, match="not in"):
        _cudnn_fwd(q.float(), q.float(), q.float(), True, 0.125)
    aten = torch.ops.aten
    seed = _meta((), torch.int64)
    for bad_out, bad_lse, cum, why in ((out.transpose(2, 3).contiguous().transpose(2, 3), lse[..., None], None,
                                        "contiguous"), (out, lse, None, "as the forward returns it"),
                                       (out, lse[..., None], empty, "undefined")):
        with CudaAttentionContract(), pytest.raises(ContractViolation, match=why):
            aten._scaled_dot_product_cudnn_attention_backward(out, q, q, q, bad_out, bad_lse, seed, seed, None, cum,
                                                              cum, 64, 64, 0.0, True, scale=0.125)
    with CudaAttentionContract():  # what the kernel wrapper passes: accepted, whatever the caller's layout
        _cudnn_bwd(out.transpose(1, 2).contiguous().transpose(1, 2), q, q, q, out, lse, True, 0.125)


def test_merge_equals_logaddexp_reference():
    """merge_'s in-place sigmoid form equals the log-sum-exp combination, also for block rows that see no
    key (lse -inf: the row is left as it was), on views of the accumulators as the ring passes them."""
    g = torch.Generator().manual_seed(0)
    out, blk = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 3, 6, 8, generator=g)
    lse, blk_lse = torch.randn(2, 3, 10, generator=g) * 3, torch.randn(2, 3, 6, generator=g) * 3
    blk_lse[0, 1, 2] = float("-inf")
    new_lse = torch.logaddexp(lse[..., 4:], blk_lse)
    want = out[..., 4:, :] * (lse[..., 4:] - new_lse).exp()[..., None] + blk * (blk_lse - new_lse).exp()[..., None]
    got_out, got_lse = out.clone(), lse.clone()
    merge_(got_out[:, :, 4:], got_lse[:, :, 4:], blk.bfloat16(), blk_lse)
    torch.testing.assert_close(got_lse[..., 4:], new_lse)
    torch.testing.assert_close(got_out[..., 4:, :], want, atol=1e-2, rtol=1e-2)  # the block in bf16, as kernels give it
    torch.testing.assert_close(got_out[..., :4, :], out[..., :4, :])  # rows outside the view untouched
    assert torch.equal(got_out[0, 1, 6], out[0, 1, 6]) and got_lse[0, 1, 6] == lse[0, 1, 6]


@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_on_one_rank_equals_sdpa_on_cpu(dtype, gqa):
    """No process group, one rank (bench/gpu_attention.py's call): forward and backward equal SDPA.
    ``gqa=False`` runs the repeat-and-fold path the CUDA efficient (fp32) kernel takes."""
    kernel = dataclasses.replace(CPU_KERNEL, gqa=gqa)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 96, 32, generator=g) for n in (8, 2, 2))
    dout = torch.randn(1, 8, 96, 32, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True).backward(dout)
    got = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = zigzag_ring_attention(*got, kernel=kernel)
    out.backward(dout.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert ((out.float() - want).norm() / want.norm()).item() < tol
    for a, b in zip(got, ref):
        assert ((a.grad.float() - b.grad).norm() / b.grad.norm()).item() < tol


def test_no_attention_mask_is_built_while_sequence_parallel():
    """At sp>1 the zigzag positions jump, transformers takes the rows for packed sequences and would build a
    [b, 1, s_local, s_local] mask the ring never reads (191 MB at 13.8K tokens per GPU); unsplit, it is SDPA's."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kw = dict(batch_size=1, q_length=8, kv_length=8, mask_function=causal_mask_function, allow_is_causal_skip=False)
    entry = SPAttention()
    assert torch.equal(entry.mask(**kw), sdpa_mask(**kw))
    with entry.active(doc_ids=torch.zeros(1, 8, dtype=torch.long)):
        assert entry.mask(**kw) is None


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


@pytest.mark.parametrize("dtype,kernel", KERNEL_CASES, ids=KERNEL_IDS)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_packed_ring_block_makes_valid_cuda_calls(dtype, kernel, size):
    """Packed documents (one-token ones, several per chunk, one across chunks): each rank's block at each
    ring step as its dense pieces, forward and backward, on meta tensors under the CUDA kernels' rules;
    cuDNN gets only pieces as large as their block (few shapes: few cuDNN graphs), flash the rest."""
    from longsft.train.parallel.layout import zigzag_index

    c, h, hk, d = 12, 8, 2, 64
    S = 2 * size * c
    whole = torch.stack([_doc_ids([1, 2, 1, 9, S - 13]), _doc_ids([S - 1, 1])])  # [2, S]
    groups = 1 if kernel.gqa else h // hk
    calls, pieces_seen, single, whole_blocks = 0, 0, 0, 0
    for rank in range(size):
        ids = [whole[:, zigzag_index(S, size, r)].tolist() for r in range(size)]
        for step in range(size):
            qs, ks, causal = block_slices(rank, size, step, c)
            pieces = block_pieces([row[qs] for row in ids[rank]], [row[ks] for row in ids[(rank - step) % size]],
                                  causal)
            q = _meta((2, h, len(ids[rank][0][qs]), d), dtype)
            keys = len(ids[0][0][ks])
            kk, vv = _meta((2, hk * groups, keys, d), dtype), _meta((2, hk * groups, keys, d), dtype)
            with CudaAttentionContract() as contract:
                out, lse = pieces_fwd(kernel, q, kk, vv, d ** -0.5, pieces)
                dq, dk, dv = pieces_bwd(kernel, torch.empty_like(out), q, kk, vv, out, lse, d ** -0.5, pieces)
            assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
            assert dq.shape == q.shape and dk.shape == kk.shape and dv.shape == vv.shape
            calls += sum(contract.calls.values())
            pieces_seen += len(pieces)
            single += sum(min(p.q1 - p.q0, p.k1 - p.k0) == 1 for p in pieces)
            as_large = sum((p.q1 - p.q0, p.k1 - p.k0) == (q.shape[2], keys) for p in pieces)
            whole_blocks += as_large
            if kernel is CUDNN_KERNEL:
                cudnn = sum(n for op, n in contract.calls.items() if "cudnn" in op)
                assert cudnn == 2 * as_large, contract.calls
    assert calls == 2 * pieces_seen and single > 0 and (whole_blocks > 0 or size == 1)


def test_cudnn_gets_only_whole_block_pieces():
    whole, part, one = Piece(0, 0, 8, 0, 16, False), Piece(0, 0, 8, 3, 16, False), Piece(0, 0, 1, 0, 1, True)
    assert piece_kernel(CUDNN_KERNEL, whole, (8, 16)) is CUDNN_KERNEL
    assert piece_kernel(CUDNN_KERNEL, part, (8, 16)) is FLASH_KERNEL
    assert piece_kernel(CUDNN_KERNEL, one, (1, 1)) is FLASH_KERNEL  # SDPA never sends cuDNN sequence length 1
    assert piece_kernel(FLASH_KERNEL, part, (8, 16)) is FLASH_KERNEL
    assert piece_kernel(EFFICIENT_KERNEL, part, (8, 16)) is EFFICIENT_KERNEL


def test_block_pieces_cut_documents():
    """A document is one run of rows and one of columns: a causal square on the diagonal, a whole
    rectangle elsewhere, nothing for documents on one side only; a document in two runs is an error."""
    assert block_pieces([[0, 0, 1, 1, 1]], [[0, 0, 1, 1, 1]], True) == (Piece(0, 0, 2, 0, 2, True),
                                                                       Piece(0, 2, 5, 2, 5, True))
    assert block_pieces([[3, 3, 4], [7, 7, 7]], [[2, 3, 3, 3], [6, 6, 6, 6]], False) == (Piece(0, 0, 2, 1, 4, False),)
    with pytest.raises(ValueError, match="must be contiguous"):
        block_pieces([[0, 1, 0]], [[0, 1, 0]], True)


def test_doc_plan_refuses_a_document_in_two_places():
    """Checked on the whole rows every rank gathers (so every rank refuses alike, before any ring pass):
    here an id that recurs only in position order, each shard's own runs being unique."""
    from longsft.train.parallel.context import Documents, SequenceParallel
    from longsft.train.parallel.ring import _check_contiguous, doc_plan

    ok = _doc_ids([3, 5])[None]
    assert len(doc_plan(Documents(ok), SequenceParallel())) == 1
    from longsft.train.parallel.layout import zigzag_index

    _check_contiguous(torch.stack([ok[:, zigzag_index(8, 2, r)] for r in range(2)]))  # [0 0 0 1], [0 0 1 1]
    # positions [0 0 1 1 0 0 2 2] on 2 ranks: rank 0 holds positions 0,1 and 6,7 -> [0 0 2 2]; rank 1 [1 1 0 0]
    with pytest.raises(ValueError, match="contiguous in position order"):
        _check_contiguous(torch.tensor([[[0, 0, 2, 2]], [[1, 1, 0, 0]]]))


@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_ring_without_masks_equals_masked_sdpa_on_cpu(dtype, gqa):
    """The piece path (the CPU kernel told it takes no mask, as the CUDA kernels) on one rank, two rows of
    different documents: forward and backward equal SDPA with the documents' mask; the masked path too."""
    g = torch.Generator().manual_seed(1)
    s = 40
    docs = torch.stack([_doc_ids([1, 7, 1, 20, 11]), _doc_ids([s])])
    q, k, v = (torch.randn(2, n, s, 16, generator=g) for n in (4, 2, 2))
    dout = torch.randn(2, 4, s, 16, generator=g)
    allowed = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=allowed, enable_gqa=True).backward(dout)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for kernel in (dataclasses.replace(CPU_KERNEL, gqa=gqa, masks=False), CPU_KERNEL):
        got = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = zigzag_ring_attention(*got, docs=docs, kernel=kernel)
        out.backward(dout.to(dtype))
        assert ((out.float() - want).norm() / want.norm()).item() < tol, kernel
        for a, b in zip(got, ref):
            assert ((a.grad.float() - b.grad).norm() / b.grad.norm()).item() < tol, kernel


def test_packed_ring_recompute_with_kept_attention_runs_no_kernel():
    """A checkpoint's recompute given the forward's kept out/lse (``model.keep_attention``): no forward
    kernel runs, the pieces come from the batch's ``Documents``, and the gradients equal masked SDPA's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longsft.train.parallel.context import Documents
    from longsft.train.parallel.ring import zigzag_ring

    class Forwards(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Forwards.n += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(2)
    s, kernel = 24, dataclasses.replace(CPU_KERNEL, masks=False)
    ids = _doc_ids([5, 1, 18])[None]
    q, k, v = (torch.randn(1, n, s, 16, generator=g) for n in (4, 2, 2))
    dout = torch.randn(1, 4, s, 16, generator=g)
    allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=allowed, enable_gqa=True).backward(dout)
    docs = Documents(ids)
    with torch.no_grad():
        _, kept = zigzag_ring(q, k, v, None, docs, kernel)
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    with Forwards():
        out, _ = zigzag_ring(*got, None, docs, kernel, kept=kept)
    assert Forwards.n == 0 and docs.ring_pieces is not None
    out.backward(dout)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
