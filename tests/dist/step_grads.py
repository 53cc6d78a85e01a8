"""One optimizer step's loss and full parameter gradients, for reference comparisons.

    python  tests/dist/step_grads.py ref MODEL DATA OUT DP [key=value ...]   # one process, plain torch
    torchrun --nproc_per_node=N tests/dist/step_grads.py ds MODEL DATA OUT DP [key=value ...]

DP is the data-parallel degree whose global batch both modes use; ``parallel.sp_size=2`` in the
overrides splits each sequence over 2 ranks (so N = DP * sp); ``data.packing=true`` packs samples
into rows in ``ds`` mode, while ``ref`` always runs each sample on its own.

``ds`` runs the trainer's own pieces (DeepSpeed config, engine, StepSampler, loss scaling);
``ref`` computes the global token-mean loss of the same global batch in one process.
"""

import sys

import torch


def main(mode: str, model_dir: str, data: str, out: str, dp: int, overrides: list[str]) -> None:
    from longsft.train.parallel import comm
    from longsft.train.parallel import distributed

    from longsft.train.config import load_config

    from longsft.train.parallel.attention import active
    from longsft.train.data.batching import StepSampler, collate, pack
    from longsft.train.data.encoding import encode_all
    from longsft.train.data.schema import load_samples
    from longsft.train.model.loss import backward_scale, token_loss_sum
    from longsft.train.model.build import build_model, build_tokenizer

    cfg = load_config("tiny", [f"model.path={model_dir}", "model.config=null", *overrides])
    d = distributed.init(cfg.parallel.sp_size, sp_backend=cfg.parallel.sp_backend) if mode == "ds" else None
    stage = cfg.stages[0]
    tok = build_tokenizer(cfg.model)
    items, _ = encode_all(load_samples(data), tok, stage.seq_len, "end", "truncate")
    o = cfg.optim
    rows = pack(items, stage.seq_len, cfg.data.packing)
    sampler = StepSampler(len(rows), dp, d.dp_rank if d else 0, o.micro_batch_size, o.grad_accum, cfg.seed)
    global_idx = sampler.global_indices(0)
    n_global = sum(sum(1 for x in e.labels[1:] if x != -100) for i in global_idx for e in rows[i])

    if mode == "ref":
        model = build_model(cfg.model)
        total = torch.zeros(())
        for i in global_idx:
            for e in rows[i]:  # the reference never packs: one sample per forward
                loss, _ = token_loss_sum(model, collate([e], tok.pad_token_id))
                total = total + loss
        (total / n_global).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.save({"loss": (total / n_global).item(), "grads": grads}, out)
        return

    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    from longsft.train.training.engine import build_ds_config, build_engine
    from longsft.train.training.trainer import make_batch

    ds_config = build_ds_config(cfg, stage, d.world_size, 64)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841
    model = build_model(cfg.model, sp_size=cfg.parallel.sp_size, packing=cfg.data.packing)
    engine = build_engine(cfg, model, ds_config, total_steps=10)
    scale = backward_scale(n_global, engine.dp_world_size, o.grad_accum)
    local = torch.zeros((), dtype=torch.float64)
    micro = sampler.step(0)
    grads, targets = {}, []
    for k, idx in enumerate(micro):
        batch, _ = make_batch([rows[i] for i in idx], tok.pad_token_id, d, cfg.data.packing)
        with active(doc_ids=batch.pop("doc_ids", None)):
            loss, n = token_loss_sum(engine, batch, cfg.model.loss_chunk_tokens, cfg.model.offload_activations,
                                     cfg.model.loss_kernel)
            targets.append(n)
            engine.backward(loss * scale)
        local += loss.detach().double()
        if k == len(micro) - 1:  # gradients of the whole step are reduced: read before the update
            grads = {n: deepspeed.utils.safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
        engine.step()
    total = comm.all_reduce([float(local)])[0]
    per_rank = comm.all_gather_objects(targets)  # target tokens of each micro-step, per rank
    if d.is_main:
        torch.save({"loss": total / n_global, "grads": grads, "targets_per_rank": per_rank}, out)
    distributed.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2], args[3], int(args[4]), args[5:])
