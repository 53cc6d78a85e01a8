"""Memory planner: each stage's predicted per-GPU peak, from the model's config.json alone.

    longsft plan recipe=qwen3_32b [key=value ...] [--gpus-per-node 8] [--nodes 1] [--gpu-gib 80]

The peak is the resident state plus the largest of three working sets (bytes per GPU):

- resident: ``params`` (ZeRO-3 weight partition, 0 with ``offload_param``, plus the small
  persistent parameters every rank keeps whole), ``grads`` (gradient partition and the fp32
  gradient, 0 with ``offload_optimizer``), ``optimizer`` (fp32 master and Adam's moments, ditto);
- the ``loss`` phase: the LM head gathered and its full gradient, the layers' kept activations,
  one loss chunk's logits, fp32 copy, log-softmax and gradient (Liger: its own chunk);
- the ``layers`` phase: the head kept gathered for a tied embedding (and its dense gradient, unless
  the torch loss defers it to the embedding's backward: then the rows it is made of), one layer's
  weights, the decoder stack's activation peak (with ``model.keep_attention``, each layer's kept
  attention output), ring attention's accumulators and K/V blocks (sp > 1);
- the ``embedding`` phase: the embedding gathered and its full gradient;
- the ``validation`` phase (stages that validate): ``generate`` on the whole, unsplit validation
  prompt on every rank: its KV cache and the prefill's traced working set, one layer gathered (the
  whole model, copied, when it fits in ``validation.whole_model_gb``);
- each with the reduce and prefetch buckets (``comm``), and (``stage3_max_reuse_distance``) the
  layers ZeRO-3 keeps gathered around the forward/backward turn (``reuse``).

On GPUs the attention terms add the flash backward's workspace (fp32 dq accumulator, GQA-expanded
dk/dv) and the ring's merge temporaries, and three margins that ``max_memory_allocated`` does not
see are added to the total: ``reserve`` (CUDA context and library workspaces, ``--reserve-gib``),
``nccl`` (the buffers of each NCCL communicator a rank holds: :func:`communicators`) and
``fragmentation`` (caching-allocator slack, a share of the working set). ``Estimate.allocated`` is
the total without them, what ``torch.cuda.max_memory_allocated`` measures.

Activation memory is not a formula: the planner runs the real transformers modelling code on the
meta device (no memory, no weights) with one and with two layers at the stage's exact token count,
checkpointing and MLP tiling as configured, and records the peak of live tensors (attention
through a stand-in that keeps what flash and ring kernels keep: q, k, v, out, log-sum-exp).
Parameter counts come from the same meta model; ZeRO-3's buffers follow DeepSpeed's stage3.py.
Host memory per node (offloaded optimizer, parameters and activations) is reported too.
``bench/plan_validation.py`` compares the prediction with measured peaks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from longsft.train.common.compat import storage_id, torch_dispatch_mode, tree_leaves, without_zero3_init
from longsft.train.common.errors import ConfigError
from longsft.train.common.io import read_json
from longsft.train.common.model_files import check_model_source, looks_local, model_not_found
from longsft.train.config import RECIPE_DIR, ModelConfig, RunConfig, StageConfig, keeps_attention
from longsft.train.data.token_cache import host_bytes
from longsft.train.model.build import build_hf_config
from longsft.train.model.loss import logit_softcap
from longsft.train.model.layers import lean_layers, tile_mlps
from longsft.train.model.tied_head import deferrable, keeps_dlogits
from longsft.train.training.engine import build_ds_config

GIB = 2**30
MODEL_DIR = RECIPE_DIR / "models"  # config.json of each shipped recipe's model, named after model.path


@dataclass
class Hardware:
    """Where the run goes. ``host_gib`` is per node (None: not checked)."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_gib: float = 79.0  # what PyTorch reports for an "80 GB" card (79.1-79.6 GiB), less nothing else
    host_gib: float | None = None
    reserve_gib: float = 1.0  # CUDA context, cuBLAS/cuDNN workspaces
    # NCCL's buffers per communicator. On NVSwitch nodes (HGX H100/H200) NCCL's NVLS buffers make each one
    # larger: run with NCCL_NVLS_ENABLE=0, or add the difference to reserve_gib (``--reserve-gib``)
    nccl_gib_per_communicator: float = 0.25
    fragmentation: float = 0.10  # caching-allocator slack, a share of the working set
    cuda: bool = True  # False: the CPU validation (no flash workspace, no margins)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def check(self) -> None:
        """Each value in range; the message names its command-line flag."""
        for flag, value, low in (("--gpus-per-node", self.gpus_per_node, 1), ("--nodes", self.nodes, 1)):
            if value < low:
                raise ConfigError(f"{flag} {value}: must be >= {low} (the planner sizes GPU memory)")
        for flag, value in (("--gpu-gib", self.gpu_gib), ("--host-gib", self.host_gib)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} {value}: must be a positive number of GiB")
        if not (math.isfinite(self.reserve_gib) and self.reserve_gib >= 0):
            raise ConfigError(f"--reserve-gib {self.reserve_gib}: must be >= 0")
        if not 0 <= self.fragmentation < 1:
            raise ConfigError(f"--fragmentation {self.fragmentation}: must be in [0, 1)")


@dataclass
class Shape:
    """What the planner needs from a model: sizes in elements (activations are traced per stage)."""

    name: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    params: int  # all parameters
    layer_params: int  # one decoder layer
    largest_module: int  # largest single weight (embedding or LM head, usually)
    persistent: int  # parameters below ZeRO-3's persistence threshold (kept whole on every rank)
    tied: bool = False  # the LM head shares the input embedding's weight
    deferrable: bool = False  # and its gradient can wait for the embedding's backward (model/tied_head.py)
    hf: object = field(default=None, repr=False)  # the HF config (traced for activations)
    traces: dict = field(default_factory=dict, repr=False)  # (tokens, settings) -> traced bytes


@dataclass
class Estimate:
    """One stage's prediction (bytes per GPU): resident terms plus the largest of the working sets.

    The working set is taken at the three points of a step where memory peaks: the loss (LM head
    and cross-entropy), the backward through the decoder layers, and the embedding's backward.
    """

    stage: str
    seq_len: int
    tokens_per_gpu: int
    resident: dict[str, float] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    margins: dict[str, float] = field(default_factory=dict)  # not seen by max_memory_allocated
    host_per_node: float = 0.0
    data_per_gpu: float = 0.0  # host memory of the samples a rank holds (in host_per_node)
    samples: int | None = None  # in the stage's sources (None: not there yet, not counted)
    gpu_bytes: float = 0.0
    # what the run does at this stage (``choose``): the layers' attention kept for their recompute
    # (``model.keep_attention``, ``auto`` resolved) and the tied head's weight held whole through the
    # decoder layers' backward (no second gather for the embedding's backward)
    keep_attention: bool = False
    hold_tied_weight: bool = False
    host_share: float = 0.0  # on CPU: the host memory a rank's offloaded state takes beside its peak

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def terms(self) -> dict[str, float]:
        """Resident terms, the peak working set's terms and the margins: one flat breakdown of ``total``."""
        return {**self.resident, **self.phases[self.peak_phase], **self.margins}

    @property
    def allocated(self) -> float:
        """What ``torch.cuda.max_memory_allocated`` should show: the total without the margins."""
        return self.total - sum(self.margins.values())

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total + self.host_share <= self.gpu_bytes


# --------------------------------------------------------------------------- model shape


def model_config_source(cfg: RunConfig) -> str:
    """Where the model's config comes from: inline ``model.config``, a local checkpoint, or a shipped file.
    A local path that is not there, or a cut-off GGUF file, is refused as ``longsft train`` refuses it."""
    if cfg.model.config is not None:
        return "recipe"
    if cfg.model.gguf_file or cfg.model.path.endswith(".gguf"):
        check_model_source(cfg.model.path, cfg.model.gguf_file, what="config")  # missing or cut off: named
        return "recipe"  # (a GGUF file: its header, read without the weights)
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return str(path / "config.json")
    if looks_local(cfg.model.path) and not path.exists():
        raise model_not_found("model.path", cfg.model.path)
    shipped = MODEL_DIR / f"{path.name}.json"
    if shipped.is_file():
        return str(shipped)
    raise ConfigError(f"model.path={cfg.model.path!r}: no config.json there and none shipped as {shipped}; "
                      "point model.path at a local checkpoint folder (only its config.json is read)")


def hf_config(cfg: RunConfig):
    """The HF config the run would train (rope scaling applied), without any weights."""
    source = model_config_source(cfg)
    if source == "recipe":
        try:
            return build_hf_config(cfg.model)
        except ConfigError:  # a broken file, named (build_hf_config reads through model_files.reading_model)
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.config / model.path={cfg.model.path}: cannot build the model's config ({e})") \
                from None
    raw = read_json(source, "model config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object (an HF config.json)")
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"{source}: no model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        raw.pop(key, None)
    check_model_sizes(raw, str(model_type), source)
    inline = dataclasses.replace(cfg.model, path=None, config={"model_type": model_type, **raw})
    return build_hf_config(inline)


SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_model_sizes(raw: dict, model_type: str, source: str) -> None:
    """A config to plan must name its model type and sizes: transformers' defaults are some other model."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=1)
        raise ConfigError(f"{source}: model_type {model_type!r} is not one this transformers knows"
                          + (f" (did you mean {close[0]!r}?)" if close else ""))
    aliases = {v: k for k, v in CONFIG_MAPPING[model_type].attribute_map.items()}
    missing = [k for k in SIZE_KEYS if k not in raw and aliases.get(k) not in raw]
    if missing:
        raise ConfigError(f"{source}: no {', '.join(missing)}: the planner will not guess a model's size "
                          "(transformers' defaults describe another model)")
    for key in SIZE_KEYS + ("intermediate_size", "num_key_value_heads", "head_dim"):
        value = raw.get(key, raw.get(aliases.get(key, ""), 1))
        if value is None and key in ("num_key_value_heads", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: {key}={value!r} must be a positive integer")


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


def _activation_peak(hf, layers: int, m: ModelConfig, tokens: int) -> int:
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
            one, two = (_activation_peak(shape.hf, n, m, tokens) for n in (1, 2))
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


# --------------------------------------------------------------------------- the estimate


def zero_settings(cfg: RunConfig, stage: StageConfig, world: int, hidden: int) -> dict:
    """The DeepSpeed settings the run would use (``auto`` filled exactly as the trainer fills it)."""
    ds = build_ds_config(cfg, stage, world, hidden)
    zero = ds.get("zero_optimization", {})
    return {"stage": zero.get("stage", 0),
            "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") == "cpu",
            "offload_param": zero.get("offload_param", {}).get("device", "none") == "cpu",
            "reduce_bucket": int(zero.get("reduce_bucket_size", 5e8)),
            "prefetch_bucket": int(zero.get("stage3_prefetch_bucket_size", 5e7)),
            "max_live": int(zero.get("stage3_max_live_parameters", 1e9)),
            "reuse_distance": int(zero.get("stage3_max_reuse_distance", 1e9))}


def estimate(cfg: RunConfig, stage: StageConfig, shape: Shape, hw: Hardware, targets: int | None = None) -> Estimate:
    """Predicted per-GPU peak of one stage (bytes by term) and host memory per node.

    ``targets``: loss rows per GPU; None takes the worst case (every local token is a target).
    ``model.keep_attention=auto`` keeps the attention where the stage fits with it (``hw``), else not;
    the estimate says which (``Estimate.keep_attention``).
    """
    if cfg.model.keep_attention != "auto":
        return _estimate(cfg, stage, shape, hw, targets)
    kept = _estimate(_keep(cfg, True), stage, shape, hw, targets)
    return kept if kept.fits else _estimate(_keep(cfg, False), stage, shape, hw, targets)


def _keep(cfg: RunConfig, keep: bool) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, keep_attention=keep))


def _estimate(cfg: RunConfig, stage: StageConfig, shape: Shape, hw: Hardware, targets: int | None) -> Estimate:
    world, sp = hw.world, cfg.parallel.sp_size
    if world % sp:
        raise ConfigError(f"parallel.sp_size={sp} does not divide the world size {world}")
    z = zero_settings(cfg, stage, world, shape.hidden)
    if z["stage"] != 3:
        raise ConfigError(f"deepspeed.config={cfg.deepspeed.config!r}: the planner models ZeRO stage 3 "
                          f"(this config is stage {z['stage']})")
    b = 2 if cfg.model.dtype == "bf16" else 4  # weights, activations and gradients
    t = -(-cfg.optim.micro_batch_size * stage.seq_len // sp)  # tokens per GPU
    h, kv, d, H, L, V = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.layers, shape.vocab
    part = shape.params / world
    e = Estimate(stage.name, stage.seq_len, t, gpu_bytes=hw.gpu_gib * GIB)
    host = 0.0

    # DeepSpeed ZeRO-3 buffers (stage3.py): bf16/fp32 weight partition, fp32 master copy (the weight
    # partition itself for fp32 weights kept on the same device), the gradient partition it
    # accumulates into (weight dtype), an fp32 gradient for the optimizer, Adam's two fp32 moments.
    master = 4 * part if (b < 4 or z["offload_optimizer"]) else 0
    weights = b * part
    partitions = (b + 4) * part + master + 8 * part
    host += (weights if z["offload_param"] else 0) + (partitions if z["offload_optimizer"] else 0)
    e.resident = {"params": b * shape.persistent + (0 if z["offload_param"] else weights),
                  "grads": 0 if z["offload_optimizer"] else (b + 4) * part,
                  "optimizer": 0 if z["offload_optimizer"] else master + 8 * part}

    # activations: traced peak over the decoder stack (one layer, plus each further layer's share)
    stack, kept = stack_activations(shape, cfg.model, t)  # kept: alive from the forward's end on
    keep = keeps_attention(cfg.model, sp, cfg.data.packing)
    if keep:
        # each layer's attention output and fp32 log-sum-exp, kept from its forward to its recompute
        stack, kept = stack + L * t * (h * d * b + 4 * h), kept + L * t * (h * d * b + 4 * h)
    if cfg.model.offload_activations and cfg.model.gradient_checkpointing:
        off = L * t * H * b  # checkpointed layer inputs wait in host memory
        stack, kept, host = stack - off, kept - off, host + off
    # ring attention: fp32 out/lse and dq/dk/dv accumulators (dk, dv double-buffered while they
    # travel), the K/V blocks in flight, and the fp32 block output and products of each merge
    ring = 0 if sp == 1 else t * (4 * h * d + 4 * h + 4 * kv * d * (1 + 4) + 4 * kv * d * b + 8 * h * d)
    if hw.cuda and b < 4:
        # flash backward (flash_api.cpp mha_bwd): fp32 dq accumulator and softmax sums, and dk/dv
        # expanded to every query head for GQA before they are summed per K/V head
        ring += t * (4 * h * d + 4 * h) + (t * 2 * h * d * b if kv < h else 0)
    elif hw.cuda and kv < h and sp > 1:  # fp32: the memory-efficient kernel takes K/V repeated per query head
        ring += t * 2 * h * d * b
    rows = t if targets is None else min(t, targets)
    if cfg.model.loss_kernel == "liger":  # its own chunks of ~rows / (V / H) rows; a dense weight gradient
        chunk = 1 << max(0, math.ceil(math.log2(max(1, -(-rows // -(-V // H))))))
        loss = chunk * V * b + V * H * b + rows * H * b
    else:  # logits, their fp32 copy, log-softmax and gradient of one chunk
        loss = min(rows, cfg.model.loss_chunk_tokens or rows) * V * (b + (4 if b < 4 else 0) + 4 + 4)
    big = b * shape.largest_module  # embedding or LM head: gathered whole, and its whole gradient
    comm = b * (z["reduce_bucket"] + z["prefetch_bucket"])
    # ZeRO-3 does not release a parameter used again within stage3_max_reuse_distance elements: at the
    # forward/backward turn the last layers (recomputed first) stay gathered, up to that many elements
    reuse = b * min(z["reuse_distance"], z["max_live"], (L - 1) * shape.layer_params) if L > 1 else 0
    # measured (bench/plan_validation.py): with the optimizer offloaded, the largest module's
    # gradient is held twice while it is reduced and copied out
    big_grad = big * (2 if z["offload_optimizer"] else 1)
    if cfg.model.loss_kernel == "liger":  # its weight gradient accumulates in fp32, then is cast
        loss += V * H * 4
    # a tied head's dense gradient waits in autograd for the embedding's through the whole backward,
    # unless it is deferred (torch loss): then what makes it waits, the target rows' hidden states
    # and logit gradients (or, past H rows, what recomputes them)
    deferred = shape.deferrable and cfg.model.loss_kernel == "torch"
    head_grad = 0 if deferred else big_grad
    held = (rows * H * b + (rows * V * b if keeps_dlogits(rows, H) else rows * 8)) if deferred else \
        (big_grad if shape.tied else 0)
    layers = {"gathered": big + b * shape.layer_params, "weight_grad": held, "activations": stack,
              "attention": ring, "comm": comm, "reuse": reuse}
    embedding = {"gathered": big, "weight_grad": big_grad, "activations": t * H * b, "comm": comm}
    # A tied head's weight stays gathered for its reuse by the embedding (stage3_max_reuse_distance). A
    # deferred head (model/tied_head.py) holds it only where that costs no peak memory: ZeRO-3 would keep
    # it (the decoder's parameters within the reuse distance) and the layers' backward with it stays under
    # the embedding's backward, which gathers it anyway. Otherwise it is partitioned after the head and
    # gathered again for the embedding: one [V, H] all-gather more, the weight's memory free meanwhile.
    hold = not deferred or (shape.params - shape.largest_module <= z["reuse_distance"]
                            and sum(layers.values()) <= sum(embedding.values()))
    if not hold:
        layers["gathered"] -= big
    e.keep_attention, e.hold_tied_weight = keep, hold and shape.tied
    e.phases = {
        "loss": {"gathered": big, "weight_grad": head_grad, "activations": kept, "loss": loss, "comm": comm,
                 "reuse": reuse},
        "layers": layers,
        "embedding": embedding,
    }
    if stage.validate:  # generate() prefills the whole prompt (no SP split) with a KV cache on every rank
        s_val = stage.seq_len
        # on a whole copy of the model when it fits in validation.whole_model_gb (training/validation.py)
        whole = z["stage"] == 3 and b * shape.params <= cfg.validation.whole_model_gb * 1e9
        e.phases["validation"] = {"gathered": b * shape.params if whole else big + b * shape.layer_params,
                                  "kv_cache": 2 * L * s_val * kv * d * b,
                                  "activations": prefill_peak(shape, cfg.model, s_val), "comm": comm}
    if hw.cuda:
        work = max(sum(p.values()) for p in e.phases.values())
        e.margins = {"reserve": hw.reserve_gib * GIB,
                     "nccl": hw.nccl_gib_per_communicator * GIB * len(communicators(world, sp)),
                     "fragmentation": hw.fragmentation * work}
    e.data_per_gpu, e.samples = host_bytes(cfg, stage)
    e.host_per_node = (host + e.data_per_gpu) * hw.gpus_per_node
    if not hw.cuda:  # on CPU the "device" is the host: what a rank offloads takes the same memory
        e.host_share = host + e.data_per_gpu
    return e


def communicators(world: int, sp: int) -> list[str]:
    """The NCCL communicators one rank holds, each with its own buffers (``Hardware.nccl_gib_per_communicator``).

    - ``world``: the default group;
    - ``deepspeed-world``: DeepSpeed's clone of it, the group ZeRO-3 reduces gradients over
      (``deepspeed.utils.groups._clone_world_group``; longsft makes it, ``compat.set_deepspeed_world_group``);
    - ``sp``: the rank's sequence-parallel group (sp > 1), and ``dp``: its data-parallel group
      (world / sp > 1); ``parallel/distributed.py`` makes both. The default group is bound to the
      rank's GPU, so each group connects when made (``new_group`` inherits the device), used or not;
      a group of one rank has no peers to buffer for.

    The ring's transfers add none: they are batched (``batch_isend_irecv``: longsft's ring and
    ring-flash-attn's), and ProcessGroupNCCL runs a batched point-to-point op on the group's own
    communicator, as a collective; only a lone ``isend``/``irecv`` would make a two-rank
    communicator per peer pair, and longsft sends none. Ulysses' all-to-all runs on the SP group.
    """
    if world <= 1:
        return []
    held = ["world", "deepspeed-world"]
    if sp > 1:
        held.append("sp")
    if world // sp > 1:
        held.append("dp")
    return held


def this_job(world: int, local_world: int) -> Hardware:
    """The hardware this process runs on: its GPU as PyTorch reports it, or on CPU each local rank's
    share of the host memory available now."""
    nodes = max(1, world // max(1, local_world))
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return Hardware(gpus_per_node=world // nodes, nodes=nodes, gpu_gib=total / GIB)
    return Hardware(gpus_per_node=world // nodes, nodes=nodes, gpu_gib=available_host_bytes() / local_world / GIB,
                    cuda=False)


def available_host_bytes() -> float:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class Choices:
    """What a run does at one stage, as the planner decides it on the job's hardware (:func:`choose`)."""

    keep_attention: bool  # the layers' recompute reuses their attention (``model.keep_attention``)
    hold_tied_weight: bool  # a tied head's weight stays whole through the decoder layers' backward
    note: str  # one line for the log


def choose(cfg: RunConfig, stage: StageConfig, world: int, local_world: int, targets: int) -> Choices:
    """``stage``'s choices on this job's hardware (:func:`this_job`), ``targets`` loss rows per rank and
    micro-step: ``model.keep_attention=auto`` keeps where the stage fits with it, a deferred tied head's
    weight is held where that costs no peak memory. Without a plan (not ZeRO-3, say), ``auto`` keeps
    nothing and the weight is released. Call it on one rank and hand the result to the others."""
    auto = " (auto)" if cfg.model.keep_attention == "auto" else ""
    hw = this_job(world, local_world)
    try:
        shape = model_shape(cfg)
        est = estimate(cfg, stage, shape, hw, targets)
    except Exception as e:  # (ConfigError: a model it cannot trace, say) never a crash on rank 0 alone
        why = str(e) if isinstance(e, ConfigError) else f"the planner failed: {type(e).__name__}: {e}"
        keep = keeps_attention(cfg.model, cfg.parallel.sp_size, cfg.data.packing)  # (auto: False)
        return Choices(keep, False, f"no memory plan ({(why.splitlines() or [''])[0]}); keep_attention "
                                    f"{'on' if keep else 'off'}{auto}")
    where = f"{hw.gpu_gib:.1f} GiB per {'GPU' if hw.cuda else 'rank (host memory available)'}"
    held = f", tied head weight {'held' if est.hold_tied_weight else 'released'} in the backward" if shape.tied else ""
    return Choices(est.keep_attention, est.hold_tied_weight,
                   f"planned peak {est.total / GIB:.2f} GiB of {where}; keep_attention "
                   f"{'on' if est.keep_attention else 'off'}{auto}{held}")


def plan(cfg: RunConfig, hw: Hardware, targets: int | None = None) -> tuple[Shape, list[Estimate]]:
    shape = model_shape(cfg)
    return shape, [estimate(cfg, s, shape, hw, targets) for s in cfg.stages]


def advice(cfg: RunConfig, stage: StageConfig, shape: Shape, hw: Hardware, targets: int | None = None) -> list[str]:
    """Changes (``key=value``) that make a stage fit that does not; each one checked by re-estimating."""
    tries: list[dict] = []
    for sp in (2, 4, 8, 16, 32, 64):
        if sp > cfg.parallel.sp_size and hw.world % sp == 0 and \
                (cfg.parallel.sp_backend != "ulysses" or shape.heads % sp == 0):
            tries.append({"parallel.sp_size": sp})
    if not cfg.model.gradient_checkpointing:
        tries.append({"model.gradient_checkpointing": True})
    if cfg.model.keep_attention is True:
        tries.append({"model.keep_attention": False})
    tries += [{"deepspeed.offload_optimizer": True}, {"deepspeed.offload_param": True},
              {"model.offload_activations": True}]
    if not cfg.model.loss_chunk_tokens or cfg.model.loss_chunk_tokens > 1024:
        tries.append({"model.loss_chunk_tokens": 1024})
    if not cfg.model.mlp_tile_tokens:
        tries.append({"model.mlp_tile_tokens": 4096})
    tries.append({"deepspeed.offload_optimizer": True, "deepspeed.offload_param": True,
                  "model.offload_activations": True})
    now = estimate(cfg, stage, shape, hw, targets).total
    out = []
    for change in tries:
        trial = copy.deepcopy(cfg)
        for key, value in change.items():
            section, name = key.split(".")
            setattr(getattr(trial, section), name, value)
        est = estimate(trial, stage, shape, hw, targets)
        if est.fits and est.total < now:
            words = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())
            out.append(f"{words} (-> {est.total / GIB:.1f} GiB)")
    return out


# --------------------------------------------------------------------------- report

TERMS = ("params", "grads", "optimizer", "gathered", "weight_grad", "activations", "attention", "loss", "kv_cache",
         "comm", "reuse", "reserve", "nccl", "fragmentation")


def table(cfg: RunConfig, hw: Hardware, shape: Shape, rows: list[Estimate]) -> str:
    z = zero_settings(cfg, cfg.stages[0], hw.world, shape.hidden)
    head = (f"{cfg.recipe}: {shape.params / 1e9:.2f}B parameters ({shape.layers} layers, hidden {shape.hidden}, "
            f"vocab {shape.vocab}), {cfg.model.dtype}, {hw.nodes} node(s) x {hw.gpus_per_node} GPUs of "
            f"{hw.gpu_gib:g} GiB, sp={cfg.parallel.sp_size}, ZeRO-3 offload optimizer={z['offload_optimizer']} "
            f"param={z['offload_param']}, checkpointing={cfg.model.gradient_checkpointing}, "
            f"loss chunk={cfg.model.loss_chunk_tokens or 'off'}")
    lines = [head, "", "| stage | seq_len | tokens/GPU | " + " | ".join(TERMS) + " | total GiB | peak at | fits |",
             "|---|---:|---:|" + "---:|" * len(TERMS) + "---:|---|"]
    for e in rows:
        cells = " | ".join(f"{e.terms.get(k, 0) / GIB:.2f}" for k in TERMS)
        lines.append(f"| {e.stage} | {e.seq_len} | {e.tokens_per_gpu} | {cells} | {e.total / GIB:.1f} | "
                     f"{e.peak_phase} | {'yes' if e.fits else 'NO'} |")
    host = max(e.host_per_node for e in rows) / GIB
    data = max(rows, key=lambda e: e.data_per_gpu)
    counted = (f"{data.samples} samples in stage {data.stage}" if all(e.samples is not None for e in rows) else
               "samples of stages whose data is not there yet not counted")
    need = (f"host memory per node: {host:.1f} GiB (offloaded optimizer, parameters, activations; token-cached "
            f"data {data.data_per_gpu / 2**20:.1f} MiB per rank, {counted})")
    if hw.host_gib is not None:
        need += f" of {hw.host_gib:g} GiB: {'fits' if host <= hw.host_gib else 'DOES NOT FIT'}"
    lines += ["", need]
    if rows[0].margins:
        m = rows[0].margins
        held = communicators(hw.world, cfg.parallel.sp_size)
        lines.append(f"margins in the total (not in torch.cuda.max_memory_allocated): reserve {m['reserve'] / GIB:.1f} "
                     f"GiB (CUDA context; --reserve-gib), nccl {m['nccl'] / GIB:.2f} GiB ({len(held)} NCCL "
                     f"communicators per rank: {', '.join(held) or 'none'}; {hw.nccl_gib_per_communicator:g} GiB each, "
                     "more with NVLS on NVSwitch nodes: set NCCL_NVLS_ENABLE=0 there, or add the difference to "
                     f"--reserve-gib), fragmentation {hw.fragmentation:.0%} of the working set (set "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to keep it small)")
    return "\n".join(lines)


def to_json(cfg: RunConfig, hw: Hardware, shape: Shape, rows: list[Estimate]) -> dict:
    sizes = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape) if f.repr}
    return {"recipe": cfg.recipe, "hardware": dataclasses.asdict(hw), "shape": sizes,
            "stages": [{"stage": e.stage, "seq_len": e.seq_len, "tokens_per_gpu": e.tokens_per_gpu,
                        "terms_bytes": e.terms, "peak_at": e.peak_phase, "phases_bytes": e.phases,
                        "margins_bytes": e.margins, "allocated_bytes": e.allocated, "total_bytes": e.total,
                        "fits": e.fits, "host_bytes_per_node": e.host_per_node,
                        "data_bytes_per_gpu": e.data_per_gpu, "samples": e.samples} for e in rows]}
