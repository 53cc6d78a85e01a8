"""`longsft data extend` throughput: Qwen3 tokens counted per second over ~10M characters.

    python bench/data_extend.py [--chars 10000000]

Input: offline zh and en books (half the characters each, 3-6K-character units, like the paper's
2K-6K-token textual units at a smaller scale), built into the four default buckets. Writes
bench/results/data_extend.json. Goal (issue 6): >= 1M tokens/s with the fast tokenizer on 2 cores.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from machine import describe, write_result

    from longsft.train.datagen.extend import build, format_stats, parse_buckets
    from longsft.train.datagen.sample_data import synthetic_book
    from longsft.train.model.build import qwen_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=10_000_000)
    args = ap.parse_args()
    rng = random.Random(0)
    tok = qwen_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        units_file, chars, b = Path(tmp) / "units.jsonl", 0, 0
        with open(units_file, "w") as f:
            while chars < args.chars:
                lang = "zh" if b % 2 == 0 else "en"
                scale = 1 if lang == "zh" else 3  # ~1 token per zh character, ~4 per en word-ish
                for u in synthetic_book(rng, f"book{b}", lang, 60, (3000 * scale, 6000 * scale)):
                    f.write(json.dumps(u, ensure_ascii=False) + "\n")
                    chars += len(u["text"])
                b += 1
        t0 = time.perf_counter()
        stats = build(units_file, Path(tmp) / "out", parse_buckets("16k,32k,64k,100k"), tok)
        dt = time.perf_counter() - t0
        unit_tokens = sum(len(x) for x in tok([json.loads(l)["text"] for l in open(units_file)],
                                              add_special_tokens=False)["input_ids"])
    print(format_stats(stats))
    result = {"machine": describe(), "chars": chars, "books": stats["books"], "unit_tokens": unit_tokens,
              "seconds": dt, "tokens_per_s": unit_tokens / dt, "goal_tokens_per_s": 1_000_000,
              "buckets": {k: v["samples"] for k, v in stats["buckets"].items()}}
    print(f"\n{chars:,} characters, {unit_tokens:,} tokens of text in {dt:.1f} s: "
          f"{unit_tokens / dt / 1e6:.2f}M tokens/s (goal >= 1M)")
    write_result("data_extend", result)


if __name__ == "__main__":
    main()
