"""One optimizer step's loss and full parameter gradients: the real trainer against plain PyTorch.

    python  tests/dist/step_grads.py ref MODEL DATA OUT DP [key=value ...]   # one process, plain torch
                                                                            # (tests: reference_step())
    torchrun --nproc_per_node=N tests/dist/step_grads.py ds MODEL DATA OUT DP [key=value ...]
    torchrun --nproc_per_node=N tests/dist/step_grads.py val MODEL DATA OUT DP [key=value ...]  # validation

DP is the data-parallel degree whose global batch both modes use; ``parallel.sp_size=2`` in the
overrides splits each sequence over 2 ranks (so N = DP * sp); ``data.packing=true`` packs samples
into rows in ``ds`` mode, while ``ref`` always runs each sample on its own.

``ds`` is the trainer itself: a :class:`StageTrainer` built as the curriculum builds it (data,
DeepSpeed engine) runs its own ``train_step(0)``; the gradients are read before the update.
``val`` runs the same trainer's validation hook instead (judgements, shared scorer, validation loss, decision log-odds)
on DATA's first ``validation.max_samples`` samples and saves its metrics and rows: however the
ranks split the items, the result must be the one-process result.
``ref`` shares only the encoded samples and the choice of the step's samples with it: a plain
``AutoModelForCausalLM`` (its decoder, then its LM head on the answer positions: bf16 matmuls over a
152K vocabulary are slow on CPUs without bf16 units), ``F.cross_entropy`` per sample over its answer
tokens, summed and divided by the answer tokens it counts itself. No DeepSpeed, no longsft loss or batching code.
"""

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F


def reference(cfg, model_dir: str, rows, global_idx) -> dict:
    """The global token-mean loss of the step's samples and its gradients, in one plain process."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    assert getattr(model.config, "final_logit_softcapping", None) is None  # the head below is a plain matmul
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    total, count = torch.zeros(()), 0
    for i in global_idx:
        for e in rows[i]:  # one sample per forward: nothing packed, nothing padded
            hidden = decoder(input_ids=torch.tensor([e.input_ids]), use_cache=False).last_hidden_state[0]  # [s, H]
            target = torch.tensor(e.labels[1:])  # token t+1's label is position t's target
            keep = target != -100
            logits = head(hidden[:-1][keep]).float()  # [answer tokens, vocab]: the rows the loss reads
            total = total + F.cross_entropy(logits, target[keep], reduction="sum")
            count += int(keep.sum())
    loss = total / count
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            "targets": count}


def _config(model_dir: str, data: str, overrides: list[str], run_dir: str):
    from longsft.train.config.recipes import load_config

    return load_config("tiny", [f"model.path={model_dir}", "model.config=null", "data.source=files",
                                f"data.train_file={data}", f"data.validation_file={data}", f"run_dir={run_dir}",
                                "stages.0.validate=false", *overrides])


def reference_step(model_dir: str, data: str, dp: int, overrides: list[str]) -> dict:
    """``ref`` mode in this process (the tests call it directly): the step's samples as the trainer picks
    them for ``dp`` data-parallel ranks, through :func:`reference`."""
    from longsft.train.data.batching import StepSampler, pack
    from longsft.train.data.encoding import encode_all
    from longsft.train.data.schema import load_samples
    from longsft.train.model.build import build_tokenizer

    cfg = _config(model_dir, data, overrides, "unused")
    stage, o = cfg.stages[0], cfg.optim
    tok = build_tokenizer(cfg.model)
    items, _ = encode_all(load_samples(data), tok, stage.seq_len, cfg.data.prompt, stage.overflow)
    rows = pack(items, stage.seq_len, cfg.data.packing)  # the ds run's rows, each sample run on its own
    sampler = StepSampler(len(rows), dp, 0, o.micro_batch_size, o.grad_accum, cfg.seed)
    return reference(cfg, model_dir, rows, sampler.global_indices(0))


def main(mode: str, model_dir: str, data: str, out: str, dp: int, overrides: list[str]) -> None:
    if mode == "ref":
        torch.save(reference_step(model_dir, data, dp, overrides), out)
        return

    import deepspeed

    from longsft.train.model.build import build_tokenizer
    from longsft.train.parallel import comm, distributed
    from longsft.train.training.tracker import Tracker
    from longsft.train.training.trainer import StageTrainer
    from longsft.train.training.validation import run_validation

    run_dir = tempfile.mkdtemp(prefix="step_grads_")
    cfg = _config(model_dir, data, overrides, run_dir)
    tok = build_tokenizer(cfg.model)
    d = distributed.init(cfg.parallel.sp_size, sp_backend=cfg.parallel.sp_backend)
    assert d.dims.dp_size == dp, f"{d.world_size} ranks at sp={cfg.parallel.sp_size} are not dp={dp}"
    trainer = StageTrainer(cfg, 0, d, tok, Tracker(Path(run_dir), cfg.logging, enabled=False), {}, lambda: None,
                           None)
    trainer.setup()
    if mode == "val":
        v = cfg.validation
        metrics, rows = run_validation(trainer.engine, tok, trainer.val, d, v.max_new_tokens, v.invalid_policy,
                                       True, trainer.pad_id, cfg.model.loss_chunk_tokens, cfg.model.attn_implementation,
                                       v.whole_model_gb, decision=v.decision)
        if d.is_main:
            torch.save({"metrics": metrics, "rows": rows}, out)
        distributed.shutdown()
        return
    seen = {}

    def grab(engine, targets):  # the step's reduced gradients, before DeepSpeed's update consumes them
        seen["grads"] = {n: deepspeed.utils.safe_get_full_grad(p).detach().clone()
                         for n, p in engine.module.named_parameters()}
        seen["targets"] = list(targets)

    rec = trainer.train_step(0, before_update=grab)
    per_rank = comm.all_gather_objects(seen["targets"])  # target tokens of each micro-step, per rank
    if d.is_main:
        torch.save({"loss": rec["loss"], "grads": seen["grads"], "targets_per_rank": per_rank}, out)
    distributed.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2], args[3], int(args[4]), args[5:])
