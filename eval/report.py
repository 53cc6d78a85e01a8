"""Tables from ``longsft eval`` runs: the paper's Table 4 layout, type recall, paired comparisons.

``longsft report DIR ...`` (eval runs, or folders of them) writes ``eval_report.md``, ``table4.csv``,
``types.csv`` and ``type_recall.png`` (the paper's heat map); ``--compare A B`` adds the paired
bootstrap of B - A on the items both runs share (overall and per bucket): the difference, its 95%
interval and a two-sided p-value, for BA and MCC.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from longsft.train.common.errors import ConfigError
from longsft.train.common.io import atomic_write_text
from longsft.train.scoring.bootstrap import paired_bootstrap
from longsft.train.scoring.judgement import TYPES
from longsft.train.scoring.metrics import bucket_order, labels
from longsft.train.scoring.score import load_predictions


def find_eval_runs(dirs: list[str | Path]) -> list[Path]:
    runs = []
    for d in map(Path, dirs):
        runs += [d] if (d / "eval.json").exists() else sorted(p.parent for p in d.glob("*/eval.json"))
    return runs


def _load(run: Path) -> dict:
    return json.loads((run / "eval.json").read_text())


def _cell(m: dict | None) -> str:
    if not m:
        return "–"
    ci = m.get("ci", {})
    parts = []
    for key, short in (("balanced_accuracy", "BA"), ("mcc", "MCC")):
        c = ci.get(key)
        parts.append(f"{short} {m[key]:.3f}" + (f" [{c['low']:.3f}, {c['high']:.3f}]" if c else ""))
    return " / ".join(parts)


def eval_tables(runs: list[Path], out: Path | None = None) -> str:
    """Markdown: Table 4 (rows = runs, columns = buckets + all), per language, type recall, rates."""
    evals = [(_load(r), r) for r in runs]
    buckets = sorted({b for e, _ in evals for b in e["scores"][0].get("by_bucket", {})}, key=bucket_order)
    langs = sorted({lang for e, _ in evals for lang in e["scores"][0].get("by_language", {})})
    md = ["## Table 4 layout: BA / MCC [95% bootstrap CI], first repeat", "",
          "| run | " + " | ".join(buckets + ["all"]) + " | mean BA over repeats |",
          "|---|" + "---|" * (len(buckets) + 2)]
    rows_csv = []
    for e, _ in evals:
        s = e["scores"][0]
        cells = [_cell(s["by_bucket"].get(b)) for b in buckets] + [_cell(s)]
        md.append(f"| {e['name']} | " + " | ".join(cells) + f" | {e['mean']['balanced_accuracy']:.3f} ({e['repeats']}) |")
        for b in buckets + ["all"]:
            m = s if b == "all" else s["by_bucket"].get(b)
            if m:
                rows_csv.append({"run": e["name"], "bucket": b, "n": m["n"], "ba": m["balanced_accuracy"],
                                 "ba_low": m.get("ci", {}).get("balanced_accuracy", {}).get("low"),
                                 "ba_high": m.get("ci", {}).get("balanced_accuracy", {}).get("high"),
                                 "mcc": m["mcc"], "mcc_low": m.get("ci", {}).get("mcc", {}).get("low"),
                                 "mcc_high": m.get("ci", {}).get("mcc", {}).get("high"),
                                 "invalid_rate": m["invalid_rate"], "contradiction_rate": m["contradiction_rate"]})
    md += ["", "## By language", "", "| run | " + " | ".join(langs) + " |", "|---|" + "---|" * len(langs)]
    md += [f"| {e['name']} | " + " | ".join(_cell(e["scores"][0]["by_language"].get(x)) for x in langs) + " |"
           for e, _ in evals]
    md += ["", "## Hallucination types: detection recall (type named)", "",
           "| run | " + " | ".join(TYPES) + " |", "|---|" + "---|" * len(TYPES)]
    for e, _ in evals:
        bt = e["scores"][0].get("by_type", {})
        md.append(f"| {e['name']} | " + " | ".join(
            f"{bt[t]['detection_recall']:.2f} ({bt[t]['type_recall']:.2f})" if t in bt else "–" for t in TYPES) + " |")
    md += ["", "## Output quality", "", "| run | n | invalid | contradiction (types listed with a score >= 3) | "
           "failed generations |", "|---|---:|---:|---:|---:|"]
    md += [f"| {e['name']} | {e['n']} | {e['mean']['invalid_rate']:.1%} | {e['mean']['contradiction_rate']:.1%} | "
           f"{e['generation']['failed']} |" for e, _ in evals]
    text = "\n".join(md)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _csv(out / "table4.csv", rows_csv)
        _csv(out / "types.csv", [{"run": e["name"], "type": t, **e["scores"][0]["by_type"][t]}
                                 for e, _ in evals for t in TYPES if t in e["scores"][0].get("by_type", {})])
        _heatmap(out / "type_recall.png", evals)
        atomic_write_text(out / "eval_report.md", "# longsft evaluation\n\n" + text + "\n")
    return text


def paired(a: Path, b: Path, n: int = 2000, seed: int = 0, policy: str | None = None) -> dict[str, dict]:
    """Paired bootstrap B - A on the items of A's first repeat that B shares, overall (``all``) and per
    bucket: ``{slice: {"n", "balanced_accuracy": {diff, low, high, p_value}, "mcc": {...}}}``. Invalid
    answers count by ``policy`` in both runs (default: A's invalid policy)."""
    pa = {it.id: it for it in load_predictions(a / "predictions_r0.jsonl")}
    pb = {it.id: it for it in load_predictions(b / "predictions_r0.jsonl")}
    ids = sorted(set(pa) & set(pb))
    if not ids:
        raise ConfigError(f"--compare: {a} and {b} share no item ids")
    policy = policy or _load(a).get("invalid_policy", "wrong")
    groups = {"all": ids}
    for i in ids:
        if pa[i].bucket is not None:
            groups.setdefault(pa[i].bucket, []).append(i)
    out = {}
    for name in sorted(groups, key=lambda g: (g == "all", bucket_order(g))):
        sel = groups[name]
        gold, pred_a = labels([pa[i] for i in sel], policy)
        _, pred_b = labels([pb[i] for i in sel], policy)
        out[name] = {"n": len(sel), **paired_bootstrap(gold, pred_a, pred_b, n=n, seed=seed)}
    return out


def compare(a: Path, b: Path, n: int = 2000, seed: int = 0) -> str:
    """Markdown of :func:`paired`: B - A on the shared items of the first repeat, overall and per bucket."""
    ea, eb = _load(a), _load(b)
    result = paired(a, b, n, seed)
    lines = [f"## Paired bootstrap: {eb['name']} − {ea['name']} ({result['all']['n']} shared items, {n} replicates)",
             "", "| slice | n | ΔBA [95% CI] | p | ΔMCC [95% CI] | p |", "|---|---:|---|---:|---|---:|"]
    for name, r in result.items():
        ba, mcc = r["balanced_accuracy"], r["mcc"]
        lines.append(f"| {name} | {r['n']} | {ba['diff']:+.3f} [{ba['low']:+.3f}, {ba['high']:+.3f}] | "
                     f"{ba['p_value']:.3f} | {mcc['diff']:+.3f} [{mcc['low']:+.3f}, {mcc['high']:+.3f}] | "
                     f"{mcc['p_value']:.3f} |")
    return "\n".join(lines)


def _csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _heatmap(path: Path, evals: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.array([[e["scores"][0].get("by_type", {}).get(t, {}).get("detection_recall", np.nan) for t in TYPES]
                     for e, _ in evals], dtype=float)
    fig, ax = plt.subplots(figsize=(1.1 * len(TYPES) + 2, 0.5 * len(evals) + 1.5))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(TYPES)), TYPES, rotation=30, ha="right")
    ax.set_yticks(range(len(evals)), [e["name"] for e, _ in evals])
    for (i, j), v in np.ndenumerate(grid):
        if v == v:
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
    fig.colorbar(im, ax=ax, label="detection recall")
    ax.set_title("Hallucination detection recall by type")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
