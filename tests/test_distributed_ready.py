"""Ready for multi-GPU nodes, checked on CPU: every group's timeout, one resume choice, every rank's
error said, DeepSpeed keys longsft owns, one decision per micro-step (issue 35)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli, torchrun

from longsft.train.common.errors import ConfigError


def test_every_group_waits_as_long_as_the_job():
    """The default group, the SP and DP groups and DeepSpeed's world clone all get the job's timeout
    (torch gives a new group NCCL's 10 minutes, or gloo's 30, not the default group's)."""
    script = (
        "import os, sys; sys.path.insert(0, 'bench'); import onestep\n"
        "os.environ.update(onestep.rendezvous_env(DS_ACCELERATOR='cpu'))\n"
        "import torch, torch.distributed as dist\n"
        "from longsft.train.parallel import distributed\n"
        "d = distributed.init(1, timeout_s=123)\n"
        "from deepspeed.utils import groups\n"
        "assert groups._clone_world_group() is groups._WORLD_GROUP\n"
        "for g in (dist.group.WORLD, d.sp_group, d.dp_group, groups._WORLD_GROUP):\n"
        "    print(g._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
        "distributed.shutdown()\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["123.0"] * 4, r.stdout


@pytest.mark.slow
def test_rank_zero_decides_for_every_rank(tmp_path):
    """One answer on every rank where each rank's own view differs (the resume checkpoint, the run's
    state); rank 0's error reaches every rank, marked as rank 0's (said once)."""
    torchrun([str(ROOT / "tests" / "dist" / "rank_zero.py"), str(tmp_path)], nproc=2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["value"] for g in got] == ["global_step10", "global_step10"]
    assert got[0]["error"] == ["rank 0 cannot read config.yaml", False]
    assert got[1]["error"] == ["rank 0 cannot read config.yaml", True]


def test_another_rank_says_its_own_error(capsys, monkeypatch, tmp_path):
    """Under torchrun a node's first rank names itself with an error of its own (here a model folder its
    node lacks), the node's other ranks do not repeat it; an error of the command line, the same on every
    rank, only rank 0 says."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    bad_model = ["train", "recipe=tiny", "model.path=/nope/model", "model.config=null", f"run_dir={tmp_path / 'run'}"]
    code, _, err = run_cli(capsys, *bad_model)
    assert code == 2 and err.startswith("longsft: rank 3 (") and "model.path=/nope/model: not found" in err
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_cli(capsys, *bad_model)[::2] == (2, "")
    code, _, err = run_cli(capsys, "train", "recipe=tiny", "optim.lrr=1")
    assert code == 2 and err == ""
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_cli(capsys, "train", "recipe=tiny", "optim.lrr=1")
    assert code == 2 and "optim.lrr" in err


def test_rank_zero_says_an_error_it_reaches_last():
    """torchrun ends the other ranks when one exits: a rank that fails first waits for rank 0 to say the
    error they share (CI once lost it: rank 0, a moment behind, was ended before it spoke)."""
    r = torchrun([str(ROOT / "tests" / "dist" / "late_rank_zero.py")], nproc=2, check=False, timeout=120)
    assert r.returncode != 0 and r.stderr.count("longsft: late rank 0 says this") == 1, r.stderr[-2000:]


@pytest.mark.parametrize("key", ["sequence_parallel_size", "data_parallel_size"])
def test_deepspeed_json_may_not_set_parallel_sizes(tmp_path, key):
    from longsft.train.config.deepspeed import build_ds_config
    from longsft.train.config.recipes import load_config

    ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    ds[key] = 2
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(ds))
    cfg = load_config("tiny", [f"deepspeed.config={path}"])
    with pytest.raises(ConfigError, match=rf"{path}: '{key}' is longsft's to set"):
        build_ds_config(cfg, cfg.stages[0], 2, 128)


def test_one_collective_per_micro_step_decides_tiles_and_chunks(monkeypatch):
    """token_loss_sum asks the ranks once for the most tokens and targets; the tiled MLPs (forward and the
    checkpoints' recompute) and the loss chunks read that, and the step equals the untiled one."""
    from longsft.train.config.recipes import load_config
    from longsft.train.model.build import build_model
    from longsft.train.model.layers import EXTENT
    from longsft.train.model.loss import token_loss_sum
    from longsft.train.parallel import comm

    keys = ["model.config.num_hidden_layers=2", "model.loss_chunk_tokens=8"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (1, 96), generator=g)
    labels = torch.full_like(ids, -100)
    labels[0, -20:] = ids[0, -20:]
    batch = {"input_ids": ids, "position_ids": torch.arange(96)[None], "shift_labels": labels}

    def grads(tile: int) -> tuple[float, list[torch.Tensor]]:
        model = build_model(load_config("tiny", [*keys, f"model.mlp_tile_tokens={tile}"]).model, seed=1)
        loss, n = token_loss_sum(model, batch, 8)
        loss.backward()
        assert n == 20 and getattr(model, EXTENT).tokens == 96 and getattr(model, EXTENT).targets == 20
        return loss.item(), [p.grad for p in model.parameters()]

    calls = []
    real = comm.all_reduce
    monkeypatch.setattr(comm, "all_reduce", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(comm, "max_over_ranks", lambda *a, **k: pytest.fail("asked the ranks again"))
    loss, want = grads(0)
    tiled_loss, got = grads(32)  # 3 tiles per MLP
    assert len(calls) == 2  # one per token_loss_sum, none per MLP call or loss chunk
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
