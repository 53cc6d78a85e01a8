"""CUDA-only code paths, checked without a GPU.

The ring's CUDA kernel calls run on meta tensors under :class:`CudaAttentionContract` (the CUDA
kernels' own argument rules, tests/cuda_contract.py), for every block shape the zigzag ring makes
on 1, 2 and 4 ranks, in bf16, fp16 and fp32; the contract itself is shown to reject the calls that
crashed before (an empty ``cum_seq`` tensor, fp32 into flash, an unpadded efficient-kernel lse).
The same ring runs on CPU on one rank without a process group (as ``bench/gpu_attention.py`` calls it)
against PyTorch's SDPA.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from cuda_contract import ContractViolation, CudaAttentionContract

from longsft.train.parallel.attention import active, sp_mask
from longsft.train.parallel.kernels import (
    CPU_KERNEL,
    EFFICIENT_KERNEL,
    FLASH_KERNEL,
    LSE_ALIGN,
    _efficient_fwd,
    _flash_fwd,
    block_kernel,
)
from longsft.train.parallel.layout import SP
from longsft.train.parallel.ring import _plan, zigzag_ring_attention

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_kernel_choice():
    assert block_kernel("cuda", torch.bfloat16) is FLASH_KERNEL
    assert block_kernel("cuda", torch.float16) is FLASH_KERNEL
    assert block_kernel("cuda", torch.float32) is EFFICIENT_KERNEL  # flash takes no fp32
    assert block_kernel("cpu", torch.float32) is CPU_KERNEL
    with pytest.raises(ValueError, match="no kernel for meta"):
        block_kernel("meta", torch.float32)


def _meta(shape, dtype, grad=False):
    return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_on_one_rank_makes_valid_cuda_calls(dtype):
    """The whole ring (forward and backward, one rank, no process group) with the CUDA kernel on meta tensors."""
    kernel = block_kernel("cuda", dtype)
    q, k, v = _meta((1, 8, 74, 64), dtype, True), _meta((1, 2, 74, 64), dtype, True), _meta((1, 2, 74, 64), dtype, True)
    with CudaAttentionContract() as contract:
        out = zigzag_ring_attention(q, k, v, kernel=kernel)
        out.backward(torch.empty_like(out))
    assert out.shape == q.shape and out.dtype == dtype
    assert k.grad.shape == k.shape and q.grad.shape == q.shape
    assert len(contract.calls) == 2 and all(n == 1 for n in contract.calls.values()), contract.calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [2, 4])
def test_every_ring_block_makes_valid_cuda_calls(dtype, size):
    """Each rank's block at each ring step (the shapes ``_plan`` cuts), forward and backward."""
    kernel = block_kernel("cuda", dtype)
    c, h, hk, d = 37, 8, 2, 128  # odd chunk length: the efficient kernel's lse padding matters
    groups = 1 if kernel.gqa else h // hk
    saved = dataclasses.replace(SP)
    calls = 0
    try:
        for rank in range(size):
            SP.size, SP.rank = size, rank
            for step in range(size):
                kc, vc = _meta((1, hk, 2 * c, d), dtype), _meta((1, hk, 2 * c, d), dtype)
                qs, ks, causal, kk, vv, _ = _plan(step, c, groups, kc, vc, None, None)
                q = _meta((1, h, 2 * c, d), dtype)[:, :, qs].contiguous()
                with CudaAttentionContract() as contract:
                    out, lse = kernel.fwd(q, kk, vv, causal, d ** -0.5)
                    assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:3])
                    dq, dk, dv = kernel.bwd(torch.empty_like(out), q, kk, vv, out, lse.contiguous(), causal,
                                            d ** -0.5)
                assert dq.shape == q.shape and dk.shape == kk.shape and dv.shape == vv.shape
                calls += sum(contract.calls.values())
    finally:
        SP.size, SP.rank = saved.size, saved.rank
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
    assert torch.equal(sp_mask(**kw), sdpa_mask(**kw))
    with active(doc_ids=torch.zeros(1, 8, dtype=torch.long)):
        assert sp_mask(**kw) is None
