"""Greedy generation in left-padded batches (train/model/generate.py) gives each prompt the answer it
gets alone, in fewer ``generate`` calls; the lean layers run no autograd function without a graph."""

import torch

from longsft.train.model.generate import batches, generate_many, left_padded, until_end


def test_batches_stay_within_the_budget_longest_first():
    lengths = [10, 50, 30, 30, 5]
    groups = batches(lengths, budget=100, new_tokens=10)
    assert groups == [[1], [2, 3], [0, 4]]  # 60 alone; 2 x 40; 2 x 20 (a third 20-row batch would be 60 <= 100)
    for g in groups:
        assert len(g) * (max(lengths[i] for i in g) + 10) <= 100
    assert batches(lengths, budget=0, new_tokens=10) == [[1], [2], [3], [0], [4]]  # 0: one at a time
    assert batches([500], budget=100, new_tokens=10) == [[0]]  # longer than the budget: alone


def test_left_padding_and_end_of_answer():
    ids, mask = left_padded([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert until_end([5, 6, 2, 0, 0], {2}) == [5, 6, 2] and until_end([5, 6], {2}) == [5, 6]


def _tiny_model():
    from longsft.train.config.recipes import load_config
    from longsft.train.model.build import build_model

    model = build_model(load_config("tiny", ["model.config.vocab_size=512", "model.config.num_hidden_layers=2"]).model,
                        seed=3).eval()
    model.config.use_cache = True
    return model


def test_batched_answers_equal_one_prompt_at_a_time(monkeypatch):
    model = _tiny_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (7, 23, 15, 23, 4)]
    calls = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw["input_ids"].shape) or real(**kw))
    alone = generate_many(model, prompts, 6, pad_id=0, eos_id=None, budget=0)
    together = generate_many(model, prompts, 6, pad_id=0, eos_id=None, budget=120)
    assert len(calls) == 5 + 2 and [tuple(s) for s in calls[5:]] == [(4, 23), (1, 4)]  # 4 x 29 <= 120
    assert together == alone and all(len(a) == 6 for a in alone)
    # synced ranks make as many calls as the rank with the most batches; the extra ones change nothing
    assert generate_many(model, prompts, 6, pad_id=0, eos_id=None, budget=120, calls=4) == alone and len(calls) == 11


def test_lean_layers_run_no_autograd_function_without_a_graph():
    """Generation (no graph) runs the same maths as plain ops: an autograd function per RMSNorm and MLP was
    a fixed cost on every new token."""
    model = _tiny_model()
    ids = torch.randint(1, 512, (1, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    seen = []
    import longsft.train.model.layers as layers

    for fn in (layers.RMSNorm, layers.SiluMul):
        real = fn.apply
        fn.apply = staticmethod(lambda *a, real=real, fn=fn: seen.append(fn.__name__) or real(*a))
    try:
        with torch.no_grad():
            got = model(input_ids=ids).logits
        assert seen == []
        model(input_ids=ids).logits.sum().backward()  # with a graph: the lean functions
        assert "RMSNorm" in seen and "SiluMul" in seen
    finally:
        for fn in (layers.RMSNorm, layers.SiluMul):
            del fn.apply
    torch.testing.assert_close(got, want)


def test_eval_batches_the_hf_backend_and_answers_as_one_at_a_time(tmp_path, capsys, tiny_model_dir, sample_dir):
    """``longsft eval batch_tokens=N`` generates the items together (one generate call per batch) and
    scores what one item at a time scores."""
    import json

    from conftest import run_cli

    common = [f"model={tiny_model_dir('qwen3')}", "tokenizer=qwen", f"data={sample_dir / '512' / 'validation.jsonl'}",
              "max_new_tokens=8", "bootstrap=0", "progress=false", "limit=5"]
    for name, tokens in (("alone", 0), ("together", 100000)):
        code, _, err = run_cli(capsys, "eval", *common, f"batch_tokens={tokens}", f"out={tmp_path / name}")
        assert code == 0, err
    rows = {n: [json.loads(x) for x in (tmp_path / n / "generations.jsonl").read_text().splitlines()]
            for n in ("alone", "together")}
    assert [r["prediction"] for r in rows["together"]] == [r["prediction"] for r in rows["alone"]]
    assert [r["gen_tokens"] for r in rows["together"]] == [r["gen_tokens"] for r in rows["alone"]]
    assert len({r["seconds"] for r in rows["together"]}) == 1  # one batch: each item its equal share of it
    code, _, err = run_cli(capsys, "eval", *common, "batch_tokens=-2", f"out={tmp_path / 'bad'}")
    assert code == 2 and "batch_tokens=-2 must be >= -1" in err


def test_validation_batches_its_items_and_judges_as_one_at_a_time():
    """The validation hook's ``batch_tokens``: this rank's items in batches, the same judgements."""
    from types import SimpleNamespace

    from longsft.train.data.encoding import Encoded, Meta
    from longsft.train.parallel.distributed import Dist, ParallelDims
    from longsft.train.training.validation import generate_judgements

    model = _tiny_model()
    engine = SimpleNamespace(module=model, zero_optimization_partition_weights=lambda: False)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=None, decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    g = torch.Generator().manual_seed(1)
    items = [Encoded(Meta(f"i{k}", "en", 3, bucket="512"), torch.randint(1, 512, (n + 2,), generator=g).tolist(), n)
             for k, n in enumerate((9, 30, 17, 30, 5))]
    d = Dist(rank=0, local_rank=0, dims=ParallelDims(1, 1), device=torch.device("cpu"))
    alone = generate_judgements(engine, tok, items, d, 5, batch_tokens=0)
    together = generate_judgements(engine, tok, items, d, 5, batch_tokens=80)
    assert [r["id"] for r in alone] == [f"i{k}" for k in range(5)]
    assert together == alone and all(len(r["prediction"].split()) == 5 for r in alone)
