"""Liger's fused linear cross-entropy on CPU, for tests only (not installed, not shipped).

liger-kernel's Triton kernels need a GPU, so ``model.loss_kernel=liger`` could never run here. This
package gives longsft the one entry point it calls, ``LigerFusedLinearCrossEntropyLoss``, with the
behaviour of liger-kernel 0.8.x that matters around it (``ops/fused_linear_cross_entropy.py``):

- the chunking arithmetic, Triton's ``cdiv`` / ``next_power_of_2`` included: zero rows divide by
  zero, as the real kernel's host code does;
- both gradients computed chunk by chunk inside the *forward*, the weight's accumulated in
  ``accum_dtype`` (default: the weight's dtype), and handed out (times the incoming gradient) by
  the backward: under ZeRO-3 that backward runs after the forward's weight gather has ended.

Put ``tests/liger_cpu`` on ``PYTHONPATH`` to use it.
"""

__version__ = "0.8.5+cpu-stand-in"
