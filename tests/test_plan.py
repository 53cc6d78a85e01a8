"""The memory planner: model sizes from shipped configs, its terms, advice that works, and its
prediction against a measured peak (bench/plan_validation.py does more lengths and a ~100M model)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from longsft.launch.cli import main as cli
from longsft.train.common.errors import ConfigError
from longsft.train.config.recipes import load_config
from longsft.train.plan import data_memory
from longsft.train.plan.choose import choose
from longsft.train.plan.cost import communicators, estimate
from longsft.train.plan.hardware import GIB, Hardware
from longsft.train.plan.report import table
from longsft.train.plan.shape import hf_config, model_config_source
from longsft.train.plan.trace import model_shape

# published parameter counts of the recipes' models
PUBLISHED = {"qwen3_8b": 8.19e9, "qwen3_14b": 14.8e9, "qwen3_32b": 32.8e9, "llama3_1_8b": 8.03e9,
             "glm4_9b": 9.40e9, "internlm2_5_20b": 19.86e9}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_shipped_recipes_plan_from_their_shipped_config(recipe):
    """No weights and no download: the recipe's model.path resolves to recipes/models/<name>.json."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(recipe)
    shape = model_shape(cfg)
    assert shape.params == pytest.approx(PUBLISHED[recipe], rel=0.005)
    with torch.device("meta"):  # the whole model, to check the one-and-two-layer extrapolation
        full = AutoModelForCausalLM.from_config(hf_config(cfg))
    assert shape.params == sum(p.numel() for p in full.parameters())
    rows = [estimate(cfg, s, shape, Hardware()) for s in cfg.stages]
    assert [e.stage for e in rows] == [s.name for s in cfg.stages]
    assert all(e.fits for e in rows)  # the paper's setting: 8 x 80 GB, sp=8, ZeRO-3 offload


def test_terms_follow_the_recipe_switches():
    cfg = load_config("qwen3_8b")
    shape, hw = model_shape(cfg), Hardware()
    stage = cfg.stages[-1]  # 100K tokens over 8 ranks
    base = estimate(cfg, stage, shape, hw)
    t = stage.seq_len // 8
    assert base.tokens_per_gpu == t
    # loss memory is one 1024-token chunk of bf16 logits, fp32 copy, log-softmax and gradient
    assert base.phases["loss"]["loss"] == 1024 * 151936 * (2 + 4 + 4 + 4)
    # offloaded optimizer and parameters: no partitions on the GPU, 20 bytes per parameter on the host,
    # beside the data a rank holds (its samples are not on this machine: the micro-batch only)
    assert base.resident["grads"] == base.resident["optimizer"] == 0
    assert base.samples is None and base.data_per_gpu == stage.seq_len * data_memory.HOST_BYTES_PER_BATCH_TOKEN
    assert base.host_per_node == pytest.approx(8 * shape.params / 8 * (2 + 6 + 4 + 8) + 8 * base.data_per_gpu)

    def with_(*overrides):
        c = load_config("qwen3_8b", list(overrides))
        return estimate(c, c.stages[-1], shape, hw)

    on_gpu = with_("deepspeed.offload_optimizer=false", "deepspeed.offload_param=false")
    assert on_gpu.resident["params"] >= 2 * shape.params / 8
    assert on_gpu.resident["optimizer"] == pytest.approx((4 + 8) * shape.params / 8)
    assert on_gpu.host_per_node == 8 * on_gpu.data_per_gpu
    # tiling the MLP shrinks the traced layer working set; offloading activations moves the
    # checkpointed layer inputs (layers x tokens x hidden x 2 bytes) to the host
    tiled = with_("model.mlp_tile_tokens=1024")
    # (the lean SwiGLU keeps two [tokens, intermediate] tensors and writes its gradients over them: tiling
    # saves more than one of them)
    assert tiled.phases["layers"]["activations"] < base.phases["layers"]["activations"] - t * 12288 * 2
    off = with_("model.offload_activations=true")
    moved = 36 * t * 4096 * 2
    assert base.phases["layers"]["activations"] - off.phases["layers"]["activations"] == pytest.approx(moved)
    assert off.host_per_node - base.host_per_node == pytest.approx(8 * moved)
    no_ckpt = with_("model.gradient_checkpointing=false")
    assert no_ckpt.phases["layers"]["activations"] > 5 * base.phases["layers"]["activations"]
    c = load_config("qwen3_8b")
    c.model.loss_kernel = "liger"  # (validate() would want the package; the planner needs none)
    # a dense [vocab, hidden] weight gradient and its fp32 accumulator over Liger's chunks
    assert estimate(c, c.stages[-1], shape, hw).phases["loss"]["loss"] > 151936 * 4096 * (2 + 4)
    sp4 = with_("parallel.sp_size=4")
    assert sp4.tokens_per_gpu == 2 * t and sp4.total > base.total


def test_gpu_terms_margins_and_validation_phase():
    """What only a GPU has (flash backward workspace, margins outside max_memory_allocated) and the
    validation phase: generate() on the whole prompt with a KV cache on every rank."""
    cfg = load_config("qwen3_8b")
    shape = model_shape(cfg)
    stage = cfg.stages[-1]  # validates: seq_len 100K+
    gpu = estimate(cfg, stage, shape, Hardware())
    cpu = estimate(cfg, stage, shape, Hardware(cuda=False))
    t, h, d = gpu.tokens_per_gpu, 32, 128
    flash = t * (4 * h * d + 4 * h) + t * 2 * h * d * 2  # fp32 dq accumulator + GQA-expanded dk/dv (bf16)
    assert gpu.phases["layers"]["attention"] - cpu.phases["layers"]["attention"] == flash
    assert not cpu.margins and set(gpu.margins) == {"reserve", "nccl", "fragmentation"}
    assert gpu.margins["nccl"] == 3 * 0.25 * GIB  # world, DeepSpeed's clone of it, SP group (dp = 1)
    assert gpu.allocated == pytest.approx(gpu.total - sum(gpu.margins.values()))
    val = gpu.phases["validation"]
    assert val["kv_cache"] == 2 * 36 * stage.seq_len * 8 * 128 * 2  # K and V of every layer, whole prompt
    assert val["activations"] > stage.seq_len * 12288 * 2  # the prefill's MLP intermediate, unsplit
    assert "validation" not in estimate(cfg, cfg.stages[0], shape, Hardware()).phases  # warmup: none
    assert gpu.phases["layers"]["reuse"] == 2 * 1_000_000_000  # stage3_max_reuse_distance elements, bf16
    assert Hardware().gpu_gib < 80  # an "80 GB" card as PyTorch reports it


def test_advice_fits_when_applied(capsys):
    """A stage that does not fit gets changes; rerunning the plan with one of them fits."""
    args = ["recipe=qwen3_8b", "parallel.sp_size=1", "deepspeed.config=zero3", "--gpus-per-node", "1",
            "--gpu-gib", "141"]
    assert cli(["plan", *args]) == 1
    out = capsys.readouterr().out
    assert "stage s100k does not fit" in out
    fix = out.split("stage s100k does not fit")[1].split("\n")[1].split(" (->")[0].split()
    assert fix and all("=" in f for f in fix)
    assert cli(["plan", *args, *fix]) == 0


def test_plan_cli_json_and_bad_input(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli(["plan", "recipe=tiny", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [s["stage"] for s in saved["stages"]] == ["warmup_512", "s1k", "s2k", "s4k"]
    assert saved["shape"]["params"] == model_shape(load_config("tiny")).params
    capsys.readouterr()
    assert cli(["plan", "recipe=qwen3_8b", "model.path=/nowhere/My-Model"]) == 2
    assert "model.path=/nowhere/My-Model: not found" in capsys.readouterr().err  # as train, eval and serve say
    assert cli(["plan", "recipe=qwen3_8b", "model.path=Someone/My-Model"]) == 2  # a hub id: its config is not shipped
    assert "model.path='Someone/My-Model': no config.json there" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="parallel.sp_size=8 does not divide the world size 12"):
        cfg = load_config("qwen3_8b")
        estimate(cfg, cfg.stages[0], model_shape(cfg), Hardware(gpus_per_node=12))


def test_local_checkpoint_config_is_read(tiny_model_dir):
    cfg = load_config("tiny", [f"model.path={tiny_model_dir()}", "model.config=null"])
    assert model_config_source(cfg).endswith("config.json")
    assert model_shape(cfg).hidden == 64


@pytest.mark.slow
def test_prediction_matches_a_measured_peak(tmp_path):
    """One real ZeRO-3 (offload) training process on CPU: predicted vs peak RSS within 15%."""
    out = tmp_path / "v.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "plan_validation.py"), "--models", "tiny", "--settings",
                    "zero3_offload", "--lengths", "8192", "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    row = json.loads(out.read_text())["rows"][0]
    assert abs(row["error"]) < 0.15, row


def test_keep_attention_auto_keeps_where_the_stage_fits_with_it():
    """``model.keep_attention=auto`` (the default) is ``true`` wherever the stage fits with it, else ``false``;
    on one rank it counts too (the ring's single block keeps it), except for packed documents."""
    cfg = load_config("qwen3_32b")
    shape, stage = model_shape(cfg), cfg.stages[0]
    on, off = (estimate(load_config("qwen3_32b", [f"model.keep_attention={v}"]), stage, shape, Hardware())
               for v in ("true", "false"))
    assert on.keep_attention and not off.keep_attention and on.total > off.total
    for gib, keeps in ((on.total / GIB + 0.01, True), ((on.total + off.total) / 2 / GIB, False)):
        auto = estimate(cfg, stage, shape, Hardware(gpu_gib=gib))
        assert auto.keep_attention == keeps and auto.fits and auto.total == (on if keeps else off).total
    one = [estimate(load_config("tiny", ["parallel.sp_size=1", f"model.keep_attention={v}", *extra]),
                         load_config("tiny").stages[-1], model_shape(load_config("tiny")), Hardware(1))
           for v, extra in (("true", []), ("false", []), ("true", ["data.packing=true"]))]
    assert one[0].keep_attention and one[0].phases["layers"]["activations"] > one[1].phases["layers"]["activations"]
    assert not one[2].keep_attention and one[2].phases["layers"]["activations"] == one[1].phases["layers"]["activations"]


def test_on_cpu_the_offloaded_state_shares_the_ranks_memory():
    """On CPU the "device" is the host: a stage fits only if its peak plus what the rank offloads there
    (optimizer state, data) does, so ``auto`` drops the kept attention where only the peak would fit."""
    base = ["parallel.sp_size=2", "stages.0.seq_len=16384", "model.dtype=fp32"]
    cfg = load_config("tiny", base)
    shape, stage = model_shape(cfg), cfg.stages[0]
    on, off = (estimate(load_config("tiny", [*base, f"model.keep_attention={v}"]), stage, shape,
                             Hardware(2, cuda=False)) for v in ("true", "false"))
    assert on.host_share > 0 and estimate(cfg, stage, shape, Hardware(2)).host_share == 0
    gib = ((on.total + off.total) / 2 + on.host_share) / GIB
    assert on.total < gib * GIB  # the kept peak alone would fit; with the offloaded state it does not
    auto = estimate(cfg, stage, shape, Hardware(2, gpu_gib=gib, cuda=False))
    assert not auto.keep_attention and auto.fits


WIDE = [f"model.config.{kv}" for kv in ("hidden_size=512", "intermediate_size=1536", "num_hidden_layers=4",
                                        "num_attention_heads=8", "num_key_value_heads=2", "head_dim=64",
                                        "max_position_embeddings=131072")]


@pytest.mark.parametrize("overrides, seq, held", [
    ([], 512, True),  # the demo's warmup: the decoder's backward is far below the embedding's
    (WIDE, 16384, True),  # bench/vs_alst.py's model: the embedding's backward is still the step's peak
    (WIDE, 32768, False),  # the layers' backward is: holding [V, H] there would raise the peak
    (["model.config.tie_word_embeddings=false"], 512, False)])  # untied: nothing to hold
def test_tied_weight_is_held_only_where_it_costs_no_peak(overrides, seq, held):
    cfg = load_config("tiny", [*overrides, "parallel.sp_size=2", f"stages.0.seq_len={seq}", "model.dtype=fp32",
                               "model.keep_attention=false"])
    shape = model_shape(cfg)
    e = estimate(cfg, cfg.stages[0], shape, Hardware(2, cuda=False), targets=64)
    assert e.hold_tied_weight == held
    weight = 4 * shape.largest_module
    layers, embedding = (sum(e.phases[k].values()) for k in ("layers", "embedding"))
    if held:  # counted in the layers' backward, which stays under the embedding's
        assert e.phases["layers"]["gathered"] >= weight and layers <= embedding
    elif shape.tied:  # released after the head: the layers' backward does not count it, and with it would peak
        assert e.phases["layers"]["gathered"] < weight and layers + weight > embedding


def test_tied_weight_released_beyond_the_reuse_distance(tmp_path):
    """ZeRO-3 would not keep a parameter reused beyond ``stage3_max_reuse_distance``: neither does longsft."""
    ds = json.loads((ROOT / "ds_configs" / "zero3_offload.json").read_text())
    ds["zero_optimization"]["stage3_max_reuse_distance"] = 1000
    (tmp_path / "short.json").write_text(json.dumps(ds))
    for config, held in (("zero3_offload", True), (str(tmp_path / "short.json"), False)):
        cfg = load_config("tiny", [f"deepspeed.config={config}"])
        e = estimate(cfg, cfg.stages[0], model_shape(cfg), Hardware(2, cuda=False), targets=64)
        assert e.hold_tied_weight == held


def test_planner_builds_its_model_alone_beside_a_zero3_run():
    """The trainer plans each stage on rank 0 while a ZeRO-3 ``HfDeepSpeedConfig`` may be alive (the bench
    keeps several engines): the meta-device model must not be built inside ``deepspeed.zero.Init``, a
    collective only one rank would enter (it hung the other ranks). Here no process group exists at all."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    cfg = load_config("tiny")
    live = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert is_deepspeed_zero3_enabled()
    e = estimate(cfg, cfg.stages[0], model_shape(cfg), Hardware(2, cuda=False), targets=64)
    assert e.keep_attention and e.hold_tied_weight
    assert is_deepspeed_zero3_enabled()  # set back
    del live


def test_each_rank_counts_the_communicators_it_holds():
    """World, DeepSpeed's clone of it (ZeRO-3's reductions), the SP group when sp > 1 and the DP group when
    dp > 1: each connects when made. The ring's batched P2P rides the SP group's communicator (no pair ones)."""
    assert communicators(1, 1) == []
    assert communicators(8, 1) == ["world", "deepspeed-world", "dp"]  # dp = 8
    assert communicators(8, 8) == ["world", "deepspeed-world", "sp"]  # dp = 1
    assert communicators(16, 4) == ["world", "deepspeed-world", "sp", "dp"]
    cfg = load_config("qwen3_8b", ["parallel.sp_size=4"])
    shape, hw = model_shape(cfg), Hardware(gpus_per_node=8, nodes=2)
    rows = [estimate(cfg, cfg.stages[0], shape, hw)]
    assert rows[0].margins["nccl"] == 4 * hw.nccl_gib_per_communicator * GIB
    text = table(cfg, hw, shape, rows)
    assert "4 NCCL communicators per rank: world, deepspeed-world, sp, dp" in text and "NCCL_NVLS_ENABLE=0" in text


MOE = ('model.config={"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, '
       '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, '
       '"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}')


def test_a_mixture_of_experts_model_in_fp32_plans():
    """transformers' grouped_mm experts: the meta kernel of torch._grouped_mm takes bf16 only, and the trace
    of an fp32 model died there (on rank 0 alone, in training). Traced in fp32 sizes: twice the bf16 bytes."""
    traced = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config("tiny", [MOE, f"model.dtype={dtype}", "parallel.sp_size=1", "model.keep_attention=false",
                                   "stages.0.seq_len=256"])
        shape = model_shape(cfg)
        est = estimate(cfg, cfg.stages[0], shape, Hardware(2, cuda=False))
        traced[dtype] = est.phases["layers"]["activations"]
        note = choose(cfg, cfg.stages[0], 2, 2, 64).note
        assert note.startswith("planned peak"), note
    assert 1.6 < traced["fp32"] / traced["bf16"] <= 2


def test_a_model_the_planner_cannot_trace_gets_a_note_not_a_crash(monkeypatch, capsys):
    """Whatever the trace raises: the trainer goes on without a plan and says why (every rank waits on rank 0's
    choice); ``longsft plan`` prints one line."""
    def fails(*args, **kwargs):
        raise RuntimeError("aten::nonzero has no meta kernel\nmore lines")

    monkeypatch.setattr("longsft.train.plan.trace.activation_peak", fails)
    cfg = load_config("tiny", ["stages.0.seq_len=256"])
    note = choose(cfg, cfg.stages[0], 2, 2, 64).note
    assert note.startswith("no memory plan (the planner cannot trace model type qwen3 on the meta device "
                           "(RuntimeError: aten::nonzero has no meta kernel)); keep_attention off"), note
    monkeypatch.setattr("longsft.train.plan.choose.model_shape", lambda cfg: 1 / 0)  # any other failure of the planner: a note too
    assert choose(cfg, cfg.stages[0], 2, 2, 64).note.startswith("no memory plan (the planner failed: "
                                                                      "ZeroDivisionError")
    monkeypatch.undo()
    monkeypatch.setattr("longsft.train.plan.trace.activation_peak", fails)
    assert cli(["plan", "recipe=tiny"]) == 2
    err = capsys.readouterr().err
    assert "the planner cannot trace model type qwen3" in err and "Traceback" not in err
