"""Activation memory, measured: transformers' own modelling code run on the meta device at the stage's
token count, the peak of live tensors recorded (attention through a stand-in that keeps what the flash
and ring kernels keep)."""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch

from longsft.train.common.compat import storage_id, torch_dispatch_mode, tree_leaves, without_zero3_init
from longsft.train.common.errors import ConfigError
from longsft.train.config.schema import ModelConfig, RunConfig
from longsft.train.model.layers import lean_layers, tile_mlps
from longsft.train.model.loss import logit_softcap
from longsft.train.model.tied_head import deferrable
from longsft.train.plan.shape import Shape, hf_config


class _SavedLikeFlash(torch.autograd.Function):
    """Attention stand-in for tracing: saves q, k, v, out and fp32 log-sum-exp, as flash/ring kernels do."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _trace_attention(module, query, key, value, attention_mask, **kwargs):
    return _SavedLikeFlash.apply(query, key, value).transpose(1, 2), None


def _meta_model(hf, layers: int, dtype: torch.dtype):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("longsft_plan_trace", _trace_attention)
    hf = copy.deepcopy(hf)
    hf.num_hidden_layers = layers
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists follow the layer count
        if isinstance(getattr(hf, key, None), list):
            setattr(hf, key, getattr(hf, key)[:layers])
    with torch.device("meta"), without_zero3_init():  # built on this rank alone, even beside a ZeRO-3 run
        return AutoModelForCausalLM.from_config(hf, dtype=dtype, attn_implementation="longsft_plan_trace")


class _LiveBytes(torch_dispatch_mode()):
    """Bytes of live tensor storages created under this mode (current and peak); parameters excluded."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore, self.live, self.now, self.peak = ignore, {}, 0, 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage_id(storage)
        if key in self.ignore or key in self.live:
            return
        n = storage.nbytes()

        def freed(_ref, key=key, n=n):
            self.live.pop(key, None)
            self.now -= n

        self.live[key] = weakref.ref(storage, freed)
        self.now += n
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            out = _grouped_mm_any_dtype(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _grouped_mm_any_dtype(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """``torch._grouped_mm`` (mixture-of-experts layers: transformers' grouped_mm experts) on meta tensors
    of any dtype: its meta kernel takes bf16 only (the CUDA kernel's rule) where an fp32 model runs it
    (on the CPU) in fp32. The result: the shape of the bf16 call, in the inputs' dtype (or ``out_dtype``)."""
    a, b, *rest = args
    out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **{**kwargs, "out_dtype": None})
    return out.to(kwargs.get("out_dtype") or a.dtype)


@contextlib.contextmanager
def _tracing(hf):
    """Where the planner runs transformers' modelling code on the meta device: what it raises (an op without
    a meta kernel, a dtype a kernel refuses) becomes one ConfigError, so that :func:`choose` trains without a
    plan and says why in its note, and ``longsft plan`` prints one line: never a crash on rank 0 alone."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        line = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"the planner cannot trace model type {hf.model_type} on the meta device "
                          f"({type(e).__name__}: {line})") from None


def activation_peak(hf, layers: int, m: ModelConfig, tokens: int) -> int:
    """Peak bytes of activations, their gradients and one module's weight gradient at a time (DeepSpeed
    moves each weight gradient into its reduce bucket as soon as it is ready) over the decoder stack's
    forward and backward at ``tokens`` tokens; the embedding and LM head are accounted for apart."""
    dtype = torch.bfloat16 if m.dtype == "bf16" else torch.float32
    model = _meta_model(hf, layers, dtype)
    model.train()
    if m.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lean_layers(model)  # as build_model does
    if m.mlp_tile_tokens:
        tile_mlps(model, m.mlp_tile_tokens, synced=False)  # traced on this rank alone
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    x = torch.zeros(1, tokens, hf.hidden_size, device="meta", dtype=dtype, requires_grad=True)
    pos = torch.arange(tokens, device="meta")[None]
    live = _LiveBytes({storage_id(p.untyped_storage()) for p in model.parameters()})
    with live:
        h = model.model(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state
        h.backward(torch.ones_like(h))
    return live.peak


def prefill_peak(shape: Shape, m: ModelConfig, tokens: int) -> int:
    """Peak bytes of one decoder layer's no-grad forward over ``tokens`` tokens (generate's prefill;
    the KV cache is counted apart). Traced on the meta device like the training stack."""
    key = ("prefill", tokens, m.dtype)
    if key not in shape.traces:
        dtype = torch.bfloat16 if m.dtype == "bf16" else torch.float32
        with _tracing(shape.hf):
            model = _meta_model(shape.hf, 1, dtype).eval()
            x = torch.zeros(1, tokens, shape.hidden, device="meta", dtype=dtype)
            live = _LiveBytes({storage_id(p.untyped_storage()) for p in model.parameters()})
            with live, torch.no_grad():
                model.model(inputs_embeds=x, position_ids=torch.arange(tokens, device="meta")[None], use_cache=False)
        shape.traces[key] = live.peak
    return shape.traces[key]


def stack_activations(shape: Shape, m: ModelConfig, tokens: int) -> tuple[float, float]:
    """(peak over the decoder stack's forward+backward, bytes kept from the forward's end) at ``tokens``.

    Traced with one and with two layers at exactly ``tokens`` tokens (meta tensors cost nothing), so
    tiling and chunking show as they are; each further layer adds what the second one added.
    """
    key = (tokens, m.dtype, m.gradient_checkpointing, m.mlp_tile_tokens)
    if key not in shape.traces:
        with _tracing(shape.hf):
            one, two = (activation_peak(shape.hf, n, m, tokens) for n in (1, 2))
        per_layer = two - one
        shape.traces[key] = (one + (shape.layers - 1) * per_layer, shape.layers * per_layer)
    return shape.traces[key]


def model_shape(cfg: RunConfig) -> Shape:
    """Sizes of the model ``cfg`` trains, from its config alone (meta device: no memory)."""
    hf = hf_config(cfg)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    with _tracing(hf):
        one, two = _meta_model(hf, 1, dtype), _meta_model(hf, 2, dtype)
    n1 = sum(p.numel() for p in one.parameters())
    n2 = sum(p.numel() for p in two.parameters())
    per_layer = n2 - n1
    threshold = 10 * hf.hidden_size  # DeepSpeed's stage3_param_persistence_threshold as engine.py fills it
    layer_small = sum(p.numel() for p in two.model.layers[1].parameters() if p.numel() < threshold)
    outer_small = sum(p.numel() for n, p in one.named_parameters() if ".layers." not in n and p.numel() < threshold)
    largest = max(m.weight.numel() for m in one.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    heads = hf.num_attention_heads
    return Shape(
        name=getattr(hf, "name_or_path", "") or hf.model_type, hidden=hf.hidden_size, layers=hf.num_hidden_layers,
        vocab=hf.vocab_size, heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, intermediate=hf.intermediate_size,
        params=n1 + (hf.num_hidden_layers - 1) * per_layer, layer_params=per_layer, largest_module=largest,
        persistent=outer_small + hf.num_hidden_layers * layer_small,
        tied=one.get_output_embeddings().weight is one.get_input_embeddings().weight,
        deferrable=deferrable(one) and logit_softcap(one) is None, hf=hf)
