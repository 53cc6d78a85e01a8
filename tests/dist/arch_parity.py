"""Each architecture family: sp=2 forward + backward equals one process (both SP backends).

    torchrun --nproc_per_node=2 tests/dist/arch_parity.py OUT.json

Per family (tests/test_arch_parity.py lists them) the trainer's memory planner plans it on rank 0
(``choose``, as ``StageTrainer._memory_plan`` calls it: a model it cannot trace would stop
training there), a tiny model is built from its config by longsft's own ``build_model`` (seeded, so
every rank and the reference hold the same weights), passes the start-up checks, and runs one
sequence as training runs it: collated and sharded by
``shard_batch``, attention through longsft's registry entry inside its ``active()``. The summed
cross-entropy and every parameter gradient (all-reduced over the two ranks) are compared with the
same model in one process on the unsplit sequence (transformers' SDPA attention).
"""

import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def loss_and_grads(model, batch):
    """Summed next-token cross-entropy of ``batch`` and the parameter gradients."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits[0].float(), batch["shift_labels"][0], ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def plan_note(config: dict, world: int, tokens: int) -> str:
    """The planner's one-line choice for this family at ``tokens`` tokens, as the trainer asks for it."""
    from longsft.train.config.recipes import load_config
    from longsft.train.plan.choose import choose

    run = load_config("tiny", [f"model.config={json.dumps(config)}", "model.path=null", "model.dtype=fp32",
                               "model.gradient_checkpointing=false", f"parallel.sp_size={world}",
                               f"stages=[{{name: a, bucket: '512', seq_len: {tokens}, max_steps: 1}}]"])
    return choose(run, run.stages[0], world, world, tokens).note


def main(families_json: str, out_path: str) -> None:
    from longsft.train.config.schema import ModelConfig
    from longsft.train.model.build import build_hf_config, build_model, check_attention_quirks
    from longsft.train.parallel import distributed
    from longsft.train.parallel.attention import register
    from longsft.train.parallel.layout import shard_batch

    d = distributed.init(int(os.environ["WORLD_SIZE"]))
    families = json.loads(families_json)
    results = []
    n = 61  # not a multiple of 2 * sp: the padding at the end is exercised
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (1, n), generator=g)
    whole = {"input_ids": ids, "position_ids": torch.arange(n)[None],
             "shift_labels": torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1),
             "attention_mask": torch.ones(1, n, dtype=torch.long)}
    for name, config in families.items():
        note = plan_note(config, d.world_size, n) if d.rank == 0 else None
        cfg = ModelConfig(config=config, dtype="fp32", gradient_checkpointing=False)
        check_attention_quirks(build_hf_config(cfg), sp_size=2, packing=False)
        ref_loss, ref_grads = loss_and_grads(build_model(cfg, seed=1), whole)
        for backend in ("torch", "ulysses"):
            sp = dataclasses.replace(d.sp, backend=backend)
            entry = register(sp)  # the registered attention entry, bound to this backend's SP context
            model = build_model(cfg, seed=1, sp_size=2)
            part = shard_batch(dict(whole), sp, pad_id=0)
            with entry.active():
                loss, grads = loss_and_grads(model, part)
            torch.distributed.all_reduce(loss)
            for t in grads.values():
                torch.distributed.all_reduce(t)
            worst = max(rel(grads[k], ref_grads[k]) for k in ref_grads)
            results.append({"family": name, "backend": backend, "loss": rel(loss, ref_loss), "grad": worst,
                            "params": sorted(grads) == sorted(ref_grads), "plan": note})
    if d.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
