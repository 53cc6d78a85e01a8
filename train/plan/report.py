"""The plan as a table (``longsft plan``) and as JSON (``--json``)."""

from __future__ import annotations

import dataclasses

from longsft.train.config.schema import RunConfig
from longsft.train.plan.cost import Estimate, communicators, zero_settings
from longsft.train.plan.hardware import GIB, Hardware
from longsft.train.plan.shape import Shape

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
