"""ZeRO-3 (+ CPU offload) on 2 ranks over gloo: a real trainer step equals plain PyTorch in this process.

The global batch (2 ranks x grad_accum 2, answers of different lengths) is the same in both;
the loss is the token mean over the whole global batch, so any mistake in the scaling against
DeepSpeed's gradient averaging or accumulation shows up as a factor in loss or gradients.
"""

import pytest
from conftest import ROOT, compare_steps, reference_step, torchrun

SCRIPT = str(ROOT / "tests" / "dist" / "step_grads.py")


@pytest.mark.slow
@pytest.mark.parametrize("ds_config, extra", [
    ("zero3_offload", []), ("zero2", []),
    # ranks with different numbers of answer tokens still make the same number of LM-head calls;
    # tiled MLPs gather their weights once per tile
    ("zero3", ["model.loss_chunk_tokens=4", "model.mlp_tile_tokens=7"])])
def test_two_rank_step_equals_single_process(tmp_path, tiny_model_dir, sample_dir, ds_config, extra):
    tiny_model_dir = tiny_model_dir("qwen3")
    data = str(sample_dir / "512" / "train.jsonl")
    common = ["optim.grad_accum=2", f"deepspeed.config={ds_config}", "model.gradient_checkpointing=true",
              "parallel.sp_size=1"]  # 2 data-parallel ranks
    ds = tmp_path / "ds.pt"
    ref = reference_step(tiny_model_dir, data, 2, common)
    torchrun([SCRIPT, "ds", str(tiny_model_dir), data, str(ds), "2", *common, *extra], nproc=2)
    compare_steps(ref, ds)
