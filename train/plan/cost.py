"""Memory planner: each stage's predicted per-GPU peak, from the model's config.json alone.

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
``bench/plan_validation.py`` compares the prediction with measured peaks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from longsft.train.common.errors import ConfigError
from longsft.train.config.deepspeed import build_ds_config
from longsft.train.config.loader import with_changes
from longsft.train.config.schema import RunConfig, StageConfig
from longsft.train.model.build import keeps_attention
from longsft.train.model.tied_head import keeps_dlogits
from longsft.train.plan.data_memory import host_bytes
from longsft.train.plan.hardware import GIB, Hardware
from longsft.train.plan.shape import Shape
from longsft.train.plan.trace import prefill_peak, stack_activations


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
        return estimate_stage(cfg, stage, shape, hw, targets)
    kept = estimate_stage(with_keep_attention(cfg, True), stage, shape, hw, targets)
    return kept if kept.fits else estimate_stage(with_keep_attention(cfg, False), stage, shape, hw, targets)


def with_keep_attention(cfg: RunConfig, keep: bool) -> RunConfig:
    return with_changes(cfg, {"model.keep_attention": keep})


def estimate_stage(cfg: RunConfig, stage: StageConfig, shape: Shape, hw: Hardware, targets: int | None) -> Estimate:
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
