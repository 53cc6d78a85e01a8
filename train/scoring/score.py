"""``longsft score PRED.jsonl``: score raw predictions with the shared scorer.

Each line: ``id`` (unique), ``prediction`` (raw model text), ``gold_score`` (an integer 0-5);
optional ``bucket``, ``language``, ``types``. Prints a table and writes JSON next to the input (or
to ``--out``, a file in an existing folder). Bad input exits 2 naming the file and line; nothing is
written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.helpfmt import DefaultsHelp
from longsft.train.common.io import atomic_write_json, check_input_file, check_output_file, iter_jsonl
from longsft.train.scoring.judgement import normalize_types
from longsft.train.scoring.metrics import Item, score_items


def load_predictions(path: str | Path) -> list[Item]:
    """Validated predictions; ids are unique and gold scores integers 0..5, as training requires."""
    items, seen = [], {}
    for lineno, rec in iter_jsonl(path):
        missing = [k for k in ("id", "prediction", "gold_score") if k not in rec]
        if missing:
            raise DataError(f"{path}:{lineno}: missing field(s) {missing}")
        sid = str(rec["id"])
        if sid in seen:
            raise DataError(f"{path}:{lineno}: duplicate id {sid!r} (first at {path}:{seen[sid]}); "
                            "each item must be scored once")
        seen[sid] = lineno
        gold = rec["gold_score"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold <= 5:
            raise DataError(f"{path}:{lineno}: gold_score must be an integer 0..5, got {gold!r}")
        pred = rec["prediction"]
        items.append(Item(id=sid, prediction="" if pred is None else str(pred), gold_score=gold,
                          bucket=rec.get("bucket"), language=rec.get("language"),
                          gold_types=tuple(normalize_types(rec.get("types")))))
    if not items:
        raise DataError(f"{path}: no predictions")
    return items


def format_table(result: dict) -> str:
    """Markdown table: overall, then per bucket and language."""
    lines = ["| slice | n | BA | MCC | invalid | contradiction |", "|---|---:|---:|---:|---:|---:|"]

    def cell(m: dict, key: str) -> str:
        ci = m.get("ci", {}).get(key)
        return f"{m[key]:.3f}" + (f" [{ci['low']:.3f}, {ci['high']:.3f}]" if ci else "")

    def row(name: str, m: dict) -> None:
        lines.append(f"| {name} | {m['n']} | {cell(m, 'balanced_accuracy')} | {cell(m, 'mcc')} | "
                     f"{m['invalid_rate']:.1%} | {m['contradiction_rate']:.1%} |")

    row("all", result)
    for group in ("by_bucket", "by_language"):
        for name, m in result.get(group, {}).items():
            row(name, m)
    if result.get("by_type"):
        lines += ["", "| type | n | detection recall | type recall |", "|---|---:|---:|---:|"]
        for t, m in result["by_type"].items():
            lines.append(f"| {t} | {m['n']} | {m['detection_recall']:.3f} | {m['type_recall']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longsft score", description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelp)
    ap.add_argument("predictions", help="JSONL with id, prediction, gold_score")
    ap.add_argument("--out", help="JSON output (default: <predictions>.scores.json)")
    ap.add_argument("--invalid-policy", default="wrong", choices=["wrong", "hallucinated", "faithful"],
                    help="what an unparseable answer counts as")
    ap.add_argument("--bootstrap", type=int, default=2000, help="replicates for 95%% CIs (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = ap.parse_args(argv)
    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap {args.bootstrap}: replicates must be >= 0 (0: no intervals)")
    check_input_file(args.predictions)
    out = check_output_file(args.out or Path(args.predictions).with_suffix(".scores.json"))
    if out.exists() and out.resolve() == Path(args.predictions).resolve():
        raise DataError(f"--out {out}: is the predictions file itself; give another file name")
    result = score_items(load_predictions(args.predictions), args.invalid_policy, args.bootstrap, args.seed)
    atomic_write_json(out, result)
    print(format_table(result))
    print(f"\nwrote {out}")
    return 0
