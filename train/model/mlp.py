"""The decoder MLPs: SwiGLU that keeps two tensors instead of three, and tiling over the sequence.

Both replace an MLP instance's forward only (no wrapper module), so parameter names, hence
checkpoints, stay as they are.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from longsft.train.parallel import comm

# The gated MLP of Llama, Qwen2/3, Mistral and their kin, as transformers writes its forward.
_SWIGLU_BODIES = ("down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj",
                  "returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))")


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for the backward (silu recomputed there).

    Autograd would keep three [tokens, intermediate] tensors (gate, silu(gate), up), and its backward
    makes three more; under checkpointing they are what a layer's recompute holds through the layer's
    backward. Here two are kept and the backward makes only the two gradients.
    """

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        # in place, so that the two gradients are the only new [tokens, intermediate] tensors
        sig = torch.sigmoid(gate)
        d_gate = (1 - sig).mul_(gate).add_(1).mul_(sig).mul_(up).mul_(g)  # silu'(gate) * up * g
        d_up = sig.mul_(gate).mul_(g)  # silu(gate) * g
        return d_gate, d_up


@functools.cache
def _is_swiglu_class(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    body = "".join("".join(source.split("\n", 1)[1:]).split())  # after the def line, no whitespace
    return body in _SWIGLU_BODIES


def is_swiglu(mlp: torch.nn.Module) -> bool:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: its class's forward is exactly that, and act_fn is SiLU."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and _is_swiglu_class(type(mlp))


def fuse_swiglu(model) -> int:
    """Make every decoder layer's SwiGLU MLP (:func:`is_swiglu`) use :class:`SiluMul`; returns how many."""
    n = 0
    for layer in model.get_decoder().layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not is_swiglu(mlp):
            continue

        def forward(x: torch.Tensor, mlp=mlp) -> torch.Tensor:  # [batch, seq, hidden]
            return mlp.down_proj(SiluMul.apply(mlp.gate_proj(x), mlp.up_proj(x)))

        mlp.forward = forward
        n += 1
    return n


def tile_mlps(model, tile: int) -> None:
    """Run every decoder layer's MLP ``tile`` tokens at a time, each tile checkpointed.

    The MLP is position-wise, so tiles give the same result; in the backward only one tile's
    gate/up/activation tensors ([tile, intermediate]) exist at a time. Under ZeRO-3 each call
    gathers the MLP's weights, a collective: every rank makes the same number of calls (the most
    tiles any rank needs; empty tiles where it has fewer).
    """
    from torch.utils.checkpoint import checkpoint

    for layer in model.get_decoder().layers:
        mlp = layer.mlp
        whole = mlp.forward

        def forward(x: torch.Tensor, whole=whole) -> torch.Tensor:  # x [batch, seq, hidden]
            if not torch.is_grad_enabled():
                return whole(x)
            n = comm.max_over_ranks(-(-x.shape[1] // tile))
            return torch.cat([checkpoint(whole, x[:, i * tile:(i + 1) * tile], use_reentrant=False)
                              for i in range(max(1, n))], dim=1)

        mlp.forward = forward
