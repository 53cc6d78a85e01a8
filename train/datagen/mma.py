"""``longsft data mma``: multi-model arbitration.

Each article is summarised by every generator model (asked for JSON; a reply in prose is taken as the
summary itself, as small models give it); two judge models score each summary 0-5
with a reason (the LongNovel judgement format, the same prompt the trained model sees); when the
judges disagree an arbiter model, shown both judgements, decides. Endpoints are OpenAI-compatible.

Aggregation (our reading of the paper's arbitration):

- the judges *agree* when they give the same label (hallucinated = score <= 2) and differ by at
  most ``max_gap`` points: the gold score is their mean, rounded towards their shared label
  (2.5 -> 2 when both say hallucinated is impossible; 3.5 -> 3, 4.5 -> 4), types = union;
- otherwise the arbiter's score and types are the gold; an arbiter reply that never validates
  drops the summary (reported with its id).

Disagreement statistics: label agreement rate, mean absolute score gap, the judges' 2x2 label
table, how many summaries each judge left unjudged (both are always asked), and how often the
arbiter sided with each judge. Answers are cached (``<out>.cache.jsonl``)
so an interrupted build resumes without asking again.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from longsft.train.common.cache import AppendCache
from longsft.train.common.io import atomic_write_json, atomic_write_text
from longsft.train.common.jsontext import extract_json_object
from longsft.train.common.llm import Endpoint, LLMError, reask
from longsft.train.data.prompts import render_prompt
from longsft.train.data.schema import Sample, read_records
from longsft.train.datagen.erhg import check_paths
from longsft.train.scoring.judgement import normalize_types, parse_judgement

SUMMARIZE = {"en": "Summarise the following novel excerpt in English, in one paragraph, keeping the main events "
                   "in order. Reply with JSON only: {\"summary\": \"...\"}\n\n",
             "zh": "请用中文把下面的小说片段概括成一段摘要，按顺序保留主要情节。只输出JSON：{\"summary\": \"...\"}\n\n"}
ARBITRATE = ("\n\nTwo reviewers disagreed.\nReviewer A: {a}\nReviewer B: {b}\nCheck the summary against the text "
             "yourself and give the final judgement in the same JSON format.")


def judge_prompt(lang: str, article: str, summary: str) -> str:
    """The LongNovel detection prompt (summary at the end), as the trained models see it."""
    return render_prompt(Sample(id="", language=lang, article=article, summary=summary, gold_score=0, target=""))


def ask_summary(gen: Endpoint, prompt: str, retries: int, cache: AppendCache) -> str:
    """The generator's summary of ``prompt``'s article: the ``summary`` of a JSON reply, or else the reply's
    text itself (small models answer in prose; it is still the model's summary). Cached as :func:`ask_json`
    caches; :class:`LLMError` after ``retries`` + 1 empty replies."""
    key = gen.cache_key(prompt)
    hit = cache.get(key)
    if hit is not None:
        return hit["answer"]["summary"]
    for _ in range(retries + 1):
        text = gen.chat([{"role": "user", "content": prompt}]).text
        obj = extract_json_object(text)
        summary = obj.get("summary") if isinstance(obj, dict) and isinstance(obj.get("summary"), str) else text
        if summary.strip():
            cache.put({"key": key, "answer": {"summary": summary}})
            return summary
    raise LLMError(f"{gen.model}: an empty summary after {retries + 1} tries")


def ask_judgement(judge: Endpoint, prompt: str, retries: int, cache: AppendCache) -> dict:
    """A judge's (or the arbiter's) judgement of the summary in ``prompt``: its reply read by the shared
    scorer's parser, the one evaluation reads the trained models' judgements with (JSON in the LongNovel
    format, or a score stated in the text, as small models reply). A reply without an integer score is
    answered with the complaint and the format (a greedy judge re-asked the same prompt would repeat
    itself). ``{score (int 0..5), reason, hallucination_types}``; cached as :func:`ask_summary` caches;
    :class:`LLMError` after ``retries`` re-asks."""
    key = judge.cache_key(prompt)
    hit = cache.get(key)
    if hit is not None:
        return hit["answer"]
    answer, complaints = reask(lambda messages: judge.chat(messages).text, prompt, read_judgement, retries,
                               JUDGEMENT_FORMAT)
    if answer is None:
        raise LLMError(f"{judge}: no judgement (an integer score 0..5) in {retries + 1} replies: "
                       f"{'; '.join(complaints)}")
    cache.put({"key": key, "answer": answer})
    return answer


JUDGEMENT_FORMAT = ('Reply with the judgement only, as JSON: {"score": <an integer 0-5>, "reason": "<one sentence>", '
                    '"hallucination_types": [<types, if any>]}.')


def read_judgement(text: str) -> tuple[dict | None, str | None]:
    """(judgement, None) for a reply with an integer score 0..5, else (None, the complaint)."""
    j = parse_judgement(text)
    if j.score is None:
        return None, "no score in the reply"
    if j.score != int(j.score):
        return None, f"the score {j.score:g} is not an integer"
    return {"score": int(j.score), "reason": j.reason if j.reason is not None else text.strip(),
            "hallucination_types": j.types}, None


def aggregate(a: dict, b: dict, max_gap: int = 1) -> tuple[int, list[str]] | None:
    """(score, types) when the judges agree, else None (the arbiter decides)."""
    sa, sb = int(a["score"]), int(b["score"])
    if (sa <= 2) != (sb <= 2) or abs(sa - sb) > max_gap:
        return None
    score = math.floor((sa + sb) / 2)  # same label on both sides, so the floor keeps it
    types = sorted(set(normalize_types(a.get("hallucination_types"))) | set(normalize_types(b.get("hallucination_types"))))
    return score, types if score <= 2 else []


def judged(rec: dict, gen: Endpoint, judges: list[Endpoint], arbiter: Endpoint, max_gap: int, retries: int,
           cache: AppendCache) -> dict:
    """One article summarised by ``gen`` and judged: ``{"sample"}`` (the MMA sample, its judgements and
    whom the arbiter sided with) or ``{"problem"}``, with ``unjudged`` (the judges that gave no score)."""
    lang, article = rec["language"], rec["article"]
    sid = f"{rec['id']}-mma-{gen.model}"
    try:
        summary = ask_summary(gen, SUMMARIZE[lang] + article, retries, cache)
    except LLMError as e:
        return {"problem": {"id": sid, "problem": str(e)}, "unjudged": []}
    prompt = judge_prompt(lang, article, summary)
    answers, failed, unjudged = [], [], []
    for side, judge in zip("ab", judges):  # both asked, so that each judge's failures are counted
        try:
            answers.append(ask_judgement(judge, prompt, retries, cache))
        except LLMError as e:
            failed.append(str(e))
            unjudged.append(side)
    if failed:
        return {"problem": {"id": sid, "problem": "; ".join(failed)}, "unjudged": unjudged}
    ja, jb = answers
    agreed, sided = aggregate(ja, jb, max_gap), None
    if agreed is None:
        try:
            arb = ask_judgement(arbiter, prompt + ARBITRATE.format(a=json.dumps(ja, ensure_ascii=False),
                                                                  b=json.dumps(jb, ensure_ascii=False)),
                                retries, cache)
        except LLMError as e:
            return {"problem": {"id": sid, "problem": f"arbiter: {e}"}, "unjudged": [], "judges": (ja, jb),
                    "arbitrated": True}
        score = int(arb["score"])
        types = normalize_types(arb.get("hallucination_types")) if score <= 2 else []
        sided = "+".join(x for x, j in (("a", ja), ("b", jb)) if (int(j["score"]) <= 2) == (score <= 2)) or "neither"
    else:
        score, types = agreed
    sample = {**{k: v for k, v in rec.items() if k not in ("summary", "types", "gold_score", "output", "reason")},
              "id": sid, "summary": summary.strip(), "gold_score": score, "types": types, "source": "mma",
              "generator": gen.model, "parent": rec["id"], "judges": [ja, jb], "arbitrated": agreed is None}
    return {"sample": sample, "unjudged": [], "judges": (ja, jb), "arbitrated": agreed is None, "sided": sided}


def run(inputs: str, out: str, generators: list[Endpoint], judges: list[Endpoint], arbiter: Endpoint,
        max_gap: int = 1, retries: int = 3, concurrency: int = 1) -> dict:
    """MMA over a samples file (id, language, article; checked before any request).

    ``concurrency`` articles are worked on at once (each its summary, judges and arbiter in turn), so a
    server that batches, or serves requests side by side, is kept busy; the output is in input order
    whatever it is. A reply that never validates drops that summary (``problems``); an endpoint that does
    not answer stops the run (:class:`~longsft.train.common.llm.EndpointError`), the answers so far cached."""
    if len(judges) != 2:
        raise ValueError("MMA needs exactly two judges (--judge twice)")
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    check_paths(inputs, out)
    recs = read_records(inputs, ("id", "language", "article"))
    cache = AppendCache(str(out) + ".cache.jsonl")
    work = [(rec, gen) for rec in recs for gen in generators]
    one = lambda item: judged(*item, judges, arbiter, max_gap, retries, cache)  # noqa: E731
    if concurrency == 1:
        results = [one(item) for item in work]
    else:  # an endpoint that stops answering stops the run: the articles not started are not asked
        with ThreadPoolExecutor(concurrency, thread_name_prefix="mma") as pool:
            futures = [pool.submit(one, item) for item in work]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                pool.shutdown(cancel_futures=True)
                raise failed.exception()
            results = [f.result() for f in futures]
    samples = [r["sample"] for r in results if "sample" in r]
    problems = [r["problem"] for r in results if "problem" in r]
    stats, pair_labels = Counter(), Counter()
    for r in results:
        for side in r["unjudged"]:
            stats[f"unjudged_{side}"] += 1
        if "judges" not in r:
            continue
        ja, jb = r["judges"]
        stats["pairs"] += 1
        stats["gap_sum"] += abs(int(ja["score"]) - int(jb["score"]))
        pair_labels[f"{'H' if ja['score'] <= 2 else 'F'}{'H' if jb['score'] <= 2 else 'F'}"] += 1
        stats["arbitrated"] += r["arbitrated"]
        if r.get("sided"):
            stats[f"arbiter_sided_{r['sided']}"] += 1
    atomic_write_text(str(out) + ".problems.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in problems))
    pairs = stats["pairs"]
    summary = {"summaries": len(samples), "problems": len(problems), "judged": pairs,
               "label_agreement": (pair_labels["HH"] + pair_labels["FF"]) / pairs if pairs else None,
               "mean_score_gap": stats["gap_sum"] / pairs if pairs else None,
               "judge_labels": dict(pair_labels), "unjudged": {"a": stats["unjudged_a"], "b": stats["unjudged_b"]},
               "arbitrated": stats["arbitrated"],
               "arbiter_sided": {k.removeprefix("arbiter_sided_"): v for k, v in stats.items()
                                 if k.startswith("arbiter_sided_")},
               "hallucinated": sum(s["gold_score"] <= 2 for s in samples)}
    atomic_write_json(str(out) + ".stats.json", summary)
    # the samples last: their file says the phase is done (bench/table5_mini.py resumes by it)
    atomic_write_text(out, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    return summary
