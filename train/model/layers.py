"""Decoder-layer pieces that keep less for the backward: SwiGLU, RMSNorm; MLP tiling over the sequence.

Under gradient checkpointing what a layer's recompute keeps for its backward is the step's peak;
transformers' SwiGLU and RMSNorm keep a tensor more than their gradients need. :func:`lean_layers`
swaps in autograd functions that keep only what they need, for the modules whose class's forward is
exactly transformers' (compared by source; anything else is left alone), with the same outputs and
gradients. Everything here replaces an instance's forward only (no wrapper module), so parameter
names, hence checkpoints, stay as they are.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longsft.train.parallel import comm

# transformers' gated MLP forward (Llama, Qwen2/3, Mistral and their kin), without whitespace
_SWIGLU_BODIES = ("down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj",
                  "returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))")


ROWS = 2048  # tokens per piece of SiluMul's backward


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for the backward (silu recomputed there). [..., I]

    Autograd would keep three [tokens, intermediate] tensors (gate, silu(gate), up), and its backward
    makes three more; under checkpointing they are what a layer's recompute holds through the layer's
    backward. Here two are kept, and the backward writes the two gradients over them, a piece at a
    time (as Liger's SwiGLU kernel does on GPUs): gate and up must be fresh tensors nothing else keeps
    (the MLP's projection outputs).
    """

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        # The gradients overwrite gate and up (kept for this backward alone), ROWS tokens at a time:
        # no new [tokens, intermediate] tensor, only a few [ROWS, intermediate] temporaries.
        flat_gate, flat_up, flat_g = (t.reshape(-1, t.shape[-1]) for t in (gate, up, g))
        for i in range(0, flat_gate.shape[0], ROWS):
            a, b, dc = flat_gate[i:i + ROWS], flat_up[i:i + ROWS], flat_g[i:i + ROWS]
            sig = torch.sigmoid(a)
            d_a = (1 - sig).mul_(a).add_(1).mul_(sig).mul_(b).mul_(dc)  # silu'(gate) * up * g
            b.copy_(sig.mul_(a).mul_(dc))  # silu(gate) * g
            a.copy_(d_a)
        return gate, up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), in fp32 and cast back, as transformers' RMSNorm. [..., d]"""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(torch.autograd.Function):
    """weight * (x / rms(x)), computed in fp32 and cast back as transformers' RMSNorm does, keeping
    x (which its caller keeps anyway) and the fp32 1/rms [..., 1]; the normalised x is recomputed in
    the backward instead of kept (transformers keeps it for the weight's gradient). x [..., d]."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        d_weight = (g * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gw = (g * weight).float()  # d(loss)/d(xhat)
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), d_weight, None


def _body(cls: type) -> str | None:
    """The source of ``cls.forward`` after its def line, without whitespace (None: not readable)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    return "".join("".join(source.split("\n", 1)[1:]).split())


# transformers' RMSNorm (Llama, Qwen2/3, Mistral, GLM-4, ...; not Gemma's 1 + weight)
_RMSNORM_BODY = ("input_dtype=hidden_states.dtypehidden_states=hidden_states.to(torch.float32)variance="
                 "hidden_states.pow(2).mean(-1,keepdim=True)hidden_states=hidden_states*torch.rsqrt(variance+"
                 "self.variance_epsilon)returnself.weight*hidden_states.to(input_dtype)")


@functools.cache
def _is_swiglu_class(cls: type) -> bool:
    return _body(cls) in _SWIGLU_BODIES


@functools.cache
def _is_rmsnorm_class(cls: type) -> bool:
    return _body(cls) == _RMSNORM_BODY


def is_swiglu(mlp: torch.nn.Module) -> bool:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: its class's forward is exactly that, and act_fn is SiLU."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and _is_swiglu_class(type(mlp))


def lean_layers(model) -> dict[str, int]:
    """SwiGLU MLPs run :class:`SiluMul`, RMSNorms :class:`RMSNorm`; returns how many of each."""
    n = {"swiglu": 0, "rmsnorm": 0}
    for layer in model.get_decoder().layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and is_swiglu(mlp):

            def forward(x: torch.Tensor, mlp=mlp) -> torch.Tensor:  # [batch, seq, hidden]
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
                # no graph (generation, validation): the plain ops, without an autograd function's overhead
                act = SiluMul.apply(gate, up) if torch.is_grad_enabled() else F.silu(gate).mul_(up)
                return mlp.down_proj(act)

            mlp.forward = forward
            n["swiglu"] += 1
    for module in model.modules():
        if _is_rmsnorm_class(type(module)) and isinstance(getattr(module, "weight", None), torch.Tensor):

            def norm(x: torch.Tensor, module=module) -> torch.Tensor:  # [..., d]
                if not torch.is_grad_enabled():  # no graph: the same maths without the autograd function
                    return rms_norm(x, module.weight, module.variance_epsilon)
                return RMSNorm.apply(x, module.weight, module.variance_epsilon)

            module.forward = norm
            n["rmsnorm"] += 1
    return n


EXTENT = "longsft_extent"  # the model attribute holding its Extent (build_model sets it)


@dataclass
class Extent:
    """The most tokens (per row, this micro-step's local sequence) and loss targets of any rank: how often
    each rank's forward calls ZeRO-3's gathers (MLP tiles, loss chunks), decided with one all-reduce per
    micro-step by ``token_loss_sum`` and read by the forward and by the checkpoints' recompute in the
    backward. None: not decided (a forward outside ``token_loss_sum``): each call asks the ranks itself."""

    tokens: int | None = None
    targets: int | None = None


def tile_mlps(model, tile: int, synced: bool = True, extent: Extent | None = None) -> None:
    """Run every decoder layer's MLP ``tile`` tokens at a time, each tile checkpointed.

    The MLP is position-wise, so tiles give the same result; in the backward only one tile's
    gate/up/activation tensors ([tile, intermediate]) exist at a time. Under ZeRO-3 each call
    gathers the MLP's weights, a collective: every rank makes the same number of calls (the most
    tiles any rank needs; empty tiles where it has fewer), from ``extent.tokens`` when the micro-step
    decided it, else asked of the ranks on each call. ``synced=False``: this rank's own count (a
    model only this rank runs: the planner's meta-device trace).
    """
    from torch.utils.checkpoint import checkpoint

    for layer in model.get_decoder().layers:
        mlp = layer.mlp
        whole = mlp.forward

        def forward(x: torch.Tensor, whole=whole) -> torch.Tensor:  # x [batch, seq, hidden]
            if not torch.is_grad_enabled():
                return whole(x)
            n = -(-x.shape[1] // tile)
            if synced:
                n = -(-extent.tokens // tile) if extent is not None and extent.tokens is not None \
                    else comm.max_over_ranks(n)
            return torch.cat([checkpoint(whole, x[:, i * tile:(i + 1) * tile], use_reentrant=False)
                              for i in range(max(1, n))], dim=1)

        mlp.forward = forward
