"""ConStory's metrics over check reports: CED (errors per 10,000 words) and GRR (per-prompt ranks of
Q = words / (1 + errors)); every error counts; unjudged stories are left out, never counted as consistent."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from longsft.eval.constory import TASK_TYPES, TAXONOMY, judged
from longsft.train.common.io import atomic_write_json, atomic_write_text


def metrics(reports: list[dict]) -> dict:
    """CED and GRR per model, errors per category / subtype / task type, error positions.

    ``reports``: dicts with ``id`` (prompt id), ``model_name``, ``task_type``, ``words``, ``n_errors``,
    ``errors`` and ``characters``. Unjudged stories (:func:`judged`) are counted in ``unjudged`` only."""
    unjudged = Counter(r["model_name"] for r in reports if not judged(r))
    reports = [r for r in reports if judged(r)]
    by_model: dict[str, list[dict]] = defaultdict(list)
    for r in reports:
        by_model[r["model_name"]].append(r)
    ced = {m: sum(r["n_errors"] / (r["words"] / 10_000) for r in rs if r["words"]) / len(rs)
           for m, rs in by_model.items()}
    ranks: dict[str, list[float]] = defaultdict(list)
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in reports:
        by_prompt[r["id"]].append(r)
    for rs in by_prompt.values():
        q = {r["model_name"]: r["words"] / (1 + r["n_errors"]) for r in rs}
        for m, rank in fractional_ranks(q).items():
            ranks[m].append(rank)
    grr = {m: sum(v) / len(v) for m, v in ranks.items()}
    cats = {m: dict(Counter(e["category"] for r in rs for e in r["errors"])) for m, rs in by_model.items()}
    subs = {m: dict(Counter(e["subtype"] for r in rs for e in r["errors"])) for m, rs in by_model.items()}
    task = {m: {t: sum(r["n_errors"] for r in rs if r.get("task_type") == t) for t in TASK_TYPES}
            for m, rs in by_model.items()}
    positions = [e["quote"]["start"] / r["characters"] for r in reports for e in r["errors"] if r["characters"]]
    return {"ced": ced, "grr": grr, "errors": {m: sum(r["n_errors"] for r in rs) for m, rs in by_model.items()},
            "stories": {m: len(rs) for m, rs in by_model.items()}, "unjudged": dict(unjudged),
            "by_category": cats, "by_subtype": subs, "by_task_type": task, "positions": positions}


def fractional_ranks(q: dict[str, float]) -> dict[str, float]:
    """Rank 1 = highest Q; tied values share the mean of their ranks."""
    order = sorted(q, key=lambda m: -q[m])
    out, i = {}, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and q[order[j + 1]] == q[order[i]]:
            j += 1
        for m in order[i:j + 1]:
            out[m] = (i + j) / 2 + 1
        i = j + 1
    return out


def metrics_tables(m: dict, out: Path | None = None) -> str:
    unjudged = m.get("unjudged", {})
    models = sorted(set(m["ced"]) | set(unjudged))

    def num(d: dict, x: str) -> str:
        return f"{d[x]:.2f}" if x in d else "–"

    lines = ["| model | stories | errors | CED (errors / 10K words) | GRR (rank, 1 = best) | unjudged |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {x} | {m['stories'].get(x, 0)} | {m['errors'].get(x, 0)} | {num(m['ced'], x)} | {num(m['grr'], x)} "
              f"| {unjudged.get(x, 0)} |" for x in models]
    judged_models = sorted(m["ced"])
    lines += ["", "| model | " + " | ".join(TAXONOMY) + " |", "|---|" + "---:|" * len(TAXONOMY)]
    lines += [f"| {x} | " + " | ".join(str(m["by_category"][x].get(c, 0)) for c in TAXONOMY) + " |"
              for x in judged_models]
    lines += ["", "| model | " + " | ".join(TASK_TYPES) + " |", "|---|" + "---:|" * len(TASK_TYPES)]
    lines += [f"| {x} | " + " | ".join(str(m["by_task_type"][x][t]) for t in TASK_TYPES) + " |" for x in judged_models]
    text = "\n".join(lines)
    if out is not None:
        atomic_write_text(out / "constory_metrics.md", text + "\n")
        atomic_write_json(out / "constory_metrics.json", m)
        _position_plot(out / "error_positions.png", m["positions"])
    return text


def _position_plot(path: Path, positions: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(positions, bins=10, range=(0, 1), edgecolor="k")
    ax.set(xlabel="relative position in the story", ylabel="errors", title="Where consistency errors occur")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
