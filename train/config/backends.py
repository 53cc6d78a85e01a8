"""Which sequence-parallel backend can run here, checked at start-up with the fix in the message.

Checked by ``train.config.validate`` before anything is built, so it imports no torch at module level."""

from __future__ import annotations

import importlib.util

from longsft.train.common.errors import ConfigError

BACKENDS = ("torch", "ring_flash_attn", "ulysses")


def check_heads(backend: str, sp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Ulysses splits attention heads over the SP group: they must divide evenly."""
    if backend == "ulysses" and sp_size > 1 and num_heads % sp_size:
        raise ConfigError(f"parallel.sp_backend=ulysses splits the model's {num_heads} attention heads over "
                          f"sp_size={sp_size} ranks, which does not divide them; use an sp_size that divides "
                          f"{num_heads}, or parallel.sp_backend=torch (the ring has no such limit)")


def check_backend(backend: str, sp_size: int) -> None:
    """Fail at start-up, with the fix, for a backend that cannot run here."""
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
