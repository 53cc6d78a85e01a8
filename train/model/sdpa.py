"""Which of PyTorch's SDPA kernels the model's own attention may run (transformers' ``sdpa``).

On Hopper and Blackwell with cuDNN > 9.15, PyTorch's SDPA tries cuDNN's attention first
(``sdp_utils.cpp`` ``check_prefer_cudnn_attention``). cuDNN builds an execution graph for every new
shape (batch, heads, query and key lengths, strides: ``MHA.cpp``'s cache key), forward and backward
apart (others report hundreds of milliseconds each; bench/gpu_sdpa_shapes.py measures it), kept for
the process. Unpacked batches are padded to their longest sample, so a run of varied lengths meets a
new shape at almost every micro-step, and each generation batch's prefill is one more.
``model.sdpa_cudnn: false`` (the default) keeps cuDNN out of that dispatch: flash attention serves
calls without a mask, the memory-efficient kernel calls with one; neither builds per shape. It also
keeps training clear of a cuDNN backward that returns NaN in dQ when a mask is passed and the length
is 64 past a multiple of 128 (PyTorch 2.11 on H100/H200, pytorch issue 196678; a padded micro-batch of
several samples passes a mask). The same dispatch serves the per-document attention of packed rows.
The ring's and Ulysses's blocks are not dispatched by SDPA (they call their kernel's op directly,
:mod:`longsft.train.parallel.kernels`) and keep ``parallel.attention_kernel``.

PyTorch holds this setting per process (``torch.backends.cuda.enable_cudnn_sdp``: a flag of its global
context, read at every dispatch), so it is set where a process builds its model: training
(:func:`longsft.train.model.build.build_model`) and the HF generation backend.
"""

from __future__ import annotations

import torch


def use_sdpa_cudnn(enabled: bool) -> bool:
    """Let PyTorch's SDPA dispatch choose cuDNN's attention (``enabled``) or keep it out, for this
    process; returns the previous setting. The flag exists on CPU builds too, where it changes nothing."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    return before


def describe(enabled: bool) -> str:
    """The model's own attention kernels in words, for the run's log."""
    if enabled:
        return "PyTorch's choice (cuDNN first on Hopper/Blackwell; model.sdpa_cudnn=true)"
    return "PyTorch's SDPA without cuDNN (flash, memory-efficient with a mask; model.sdpa_cudnn=false)"
