"""The decision token (train/training/decision.py): where the answers part, its log-odds, their AUC."""

from types import SimpleNamespace

import pytest
import torch

from longsft.train.data.encoding import Encoded, Meta, encode
from longsft.train.data.schema import load_samples
from longsft.train.parallel.distributed import Dist, ParallelDims
from longsft.train.training.decision import DecisionKey, decision_key, decision_metrics
from longsft.train.training.validation import decision_log_odds, is_better


@pytest.fixture(scope="module")
def encoded(sample_dir, tokenizer):
    """The sample set's 512-bucket items (12, both languages), encoded as training encodes them."""
    return [encode(s, tokenizer, 768) for s in load_samples(sample_dir / "512" / "train.jsonl")]


def test_key_is_the_answer_formats_score_against_reason(encoded, tokenizer):
    key = decision_key(encoded)
    assert {e.meta.language for e in encoded} == {"en", "zh"}
    assert tokenizer.decode([key.faithful]) == "score" and tokenizer.decode([key.hallucinated]) == "reason"
    for e in encoded:  # every item's answer (both languages) shares the prefix and takes its class's key
        assert tokenizer.decode(e.input_ids[e.prompt_len:e.prompt_len + key.offset]).endswith('{"')
        assert e.input_ids[e.prompt_len + key.offset] == (key.faithful if e.meta.gold_score >= 3 else key.hallucinated)


def test_no_key_without_one_decision_token():
    def item(score, answer, language="en"):
        return Encoded(Meta(f"i{len(answer)}{score}", language, score), [1, 2, *answer], 2)

    assert decision_key([item(5, [7, 8, 9]), item(1, [7, 4, 9]), item(2, [7, 4], "zh")]) == DecisionKey(1, 8, 4)
    assert decision_key([item(5, [7, 8]), item(4, [7, 8])]) is None  # one class only
    assert decision_key([item(5, [7, 8]), item(1, [7, 4]), item(4, [7, 5])]) is None  # faithful answers differ
    assert decision_key([item(5, [7, 8]), item(1, [7, 8, 3])]) is None  # one answer is a prefix of the other
    assert decision_key([item(5, [7, 8]), item(1, [7, 4]), item(1, [6, 4], "zh")]) is None  # zh's answers differ
    assert decision_metrics([item(5, [7])], None) == {"decision_auc": None, "decision_log_odds": None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_odds_equal_a_plain_forward_and_their_auc_sklearns(encoded, tiny_model_dir, dtype):
    """fp32: each item's log-odds are the plain model's logits of the two keys at the last shared answer
    position of its own whole sequence. bf16: the final hidden state there times the head's two rows in
    fp32, not the bf16 logits' difference (0.125 apart at magnitude 16). The AUC equals scikit-learn's."""
    from sklearn.metrics import roc_auc_score
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3", init=0.5), dtype=dtype)
    engine = SimpleNamespace(module=model)
    d = Dist(rank=0, local_rank=0, dims=ParallelDims(1, 1), device=torch.device("cpu"))
    key = decision_key(encoded)
    odds = decision_log_odds(engine, encoded, key, d, pad_id=0)
    assert model.training  # handed back in train mode
    model.eval()
    w = model.get_output_embeddings().weight.float()
    for e, got in zip(encoded, odds):
        n = e.prompt_len + key.offset
        with torch.no_grad():
            if dtype == torch.float32:
                logits = model(torch.tensor([list(e.input_ids)])).logits[0, n - 1]
                want = float(logits[key.hallucinated] - logits[key.faithful])
            else:  # the same prefix and inputs as the hook's forward: the same bf16 hidden state
                ids = torch.tensor([list(e.input_ids[:n])])
                h = model(ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(n)[None],
                          output_hidden_states=True).hidden_states[-1][0, -1].float()
                want = float((w[key.hallucinated] - w[key.faithful]) @ h)
        assert got == pytest.approx(want, abs=1e-4)
    gold = [int(e.meta.gold_score < 3) for e in encoded]
    m = decision_metrics(encoded, odds)
    assert len(set(odds)) == len(odds) and 0 < sum(gold) < len(gold)
    assert m["decision_auc"] == pytest.approx(roc_auc_score(gold, odds))
    assert m["decision_log_odds"] == pytest.approx(sum(odds) / len(odds))


def test_decision_auc_breaks_a_tie_of_constant_answers():
    const = {"balanced_accuracy": 0.5, "mcc": 0.0, "val_loss": 1.0, "decision_auc": 0.6}
    assert is_better(dict(const, decision_auc=0.7, val_loss=2.0), const)  # ranks better: kept over lower loss
    assert not is_better(dict(const, decision_auc=0.9, balanced_accuracy=0.49), const)  # BA first
    assert is_better(const, dict(const, decision_auc=None))  # none (free-form answers) ranks last
    assert is_better(dict(const, decision_auc=None, val_loss=0.9), dict(const, decision_auc=None))
    old_best = {k: v for k, v in const.items() if k != "decision_auc"}  # kept by a run before the metric
    assert not is_better(dict(const, decision_auc=0.9, val_loss=1.1), old_best)  # compared without it
    assert is_better(dict(const, decision_auc=0.1, val_loss=0.9), old_best)
