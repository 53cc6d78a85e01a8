"""ZeRO-3 (+ CPU offload) on 2 ranks over gloo: a real trainer step equals plain PyTorch in this process;
the validation hook split over 2-3 ranks equals one process.

The global batch (2 ranks x grad_accum 2, answers of different lengths) is the same in both;
the loss is the token mean over the whole global batch, so any mistake in the scaling against
DeepSpeed's gradient averaging or accumulation shows up as a factor in loss or gradients.
"""

import json

import pytest
from conftest import ROOT, compare_steps, reference_step, torchrun

SCRIPT = str(ROOT / "tests" / "dist" / "step_grads.py")


@pytest.mark.slow
@pytest.mark.parametrize("ds_config, extra", [
    ("zero3_offload", []), ("zero2", []),
    # ranks with different numbers of answer tokens still make the same number of LM-head calls;
    # tiled MLPs gather their weights once per tile
    ("zero3", ["model.loss_chunk_tokens=4", "model.mlp_tile_tokens=7"]),
    # seed 2: in the second micro-step one rank has 38 answer tokens, more than hidden / 2 = 32 (the tied
    # head recomputes its logit gradients rather than keep them) and the other 18: the ranks must still
    # make one choice, which decides whether the backward gathers the weight
    ("zero3_offload", ["seed=2"]),
    # a reuse distance below the decoder's parameters: the tied weight is released after the head and
    # gathered again for the embedding's backward (the planner's choice at long sequences, too); and the
    # layers recompute their attention (model.keep_attention=false; auto keeps it in the other cases)
    ("zero3_offload_short_reuse", ["model.keep_attention=false"]),
    ("zero3_offload_short_reuse", ["seed=2"])])
def test_two_rank_step_equals_single_process(tmp_path, tiny_model_dir, sample_dir, ds_config, extra):
    tiny_model_dir = tiny_model_dir("qwen3")
    data = str(sample_dir / "512" / "train.jsonl")
    if ds_config.endswith("_short_reuse"):
        ds = json.loads((ROOT / "ds_configs" / "zero3_offload.json").read_text())
        ds["zero_optimization"]["stage3_max_reuse_distance"] = 1000
        ds_config = str(tmp_path / "short_reuse.json")
        (tmp_path / "short_reuse.json").write_text(json.dumps(ds))
    common = ["optim.grad_accum=2", f"deepspeed.config={ds_config}", "model.gradient_checkpointing=true",
              "parallel.sp_size=1"]  # 2 data-parallel ranks
    ds = tmp_path / "ds.pt"
    ref = reference_step(tiny_model_dir, data, 2, [*common, *extra])
    torchrun([SCRIPT, "ds", str(tiny_model_dir), data, str(ds), "2", *common, *extra], nproc=2)
    compare_steps(ref, ds)


@pytest.mark.slow
def test_validation_split_over_ranks_equals_one_process(tmp_path, tiny_model_dir, sample_dir):
    """The validation hook under ZeRO-3 splits its items over every rank, the ranks of an SP group
    included, and pads the short ranks: 5 items on 1 rank, on 2 SP ranks and on 3 data-parallel ranks
    give the same judgements, metrics and validation loss; so does generating on the partitioned
    model (validation.whole_model_gb=0: ZeRO-3 gathers per token, ranks in step) instead of on each
    rank's whole copy. The decision token's log-odds AUC (a forward per item, ranks padded) is the same."""
    import torch

    model = str(tiny_model_dir("qwen3", init=0.5))  # judgements that differ from prompt to prompt
    data = str(sample_dir / "512" / "train.jsonl")
    common = ["deepspeed.config=zero3", "stages.0.validate=true", "validation.max_samples=5",
              "validation.max_new_tokens=6"]
    env = {"LONGSFT_THREADS": "1"}  # the same kernels' thread count in every run: sums in the same order
    got = {}
    for nproc, sp, gb in ((1, 1, 4), (2, 2, 4), (3, 1, 4), (2, 2, 0)):
        out = tmp_path / f"val_{nproc}_{sp}_{gb}.pt"
        torchrun([SCRIPT, "val", model, data, str(out), str(nproc // sp), *common, f"parallel.sp_size={sp}",
                  f"validation.whole_model_gb={gb}"], nproc=nproc, env=env)
        got[nproc, sp, gb] = torch.load(out)
    one = got[1, 1, 4]
    assert one["metrics"]["n"] == len(one["rows"]) == 5
    assert len({r["id"] for r in one["rows"]}) == 5  # each item once, none a padding dummy
    assert len({r["prediction"] for r in one["rows"]}) == 5  # the judgements tell the items apart
    assert 0 <= one["metrics"]["decision_auc"] <= 1  # 3 hallucinated and 2 faithful items
    approx = ("val_loss", "decision_log_odds")  # forwards on other ranks: equal to kernel rounding
    for key in ((2, 2, 4), (3, 1, 4), (2, 2, 0)):
        other = got[key]
        assert other["rows"] == one["rows"], key
        for k in approx:
            assert other["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-6), (key, k)
        assert {k: v for k, v in other["metrics"].items() if k not in approx} == \
            {k: v for k, v in one["metrics"].items() if k not in approx}, key
