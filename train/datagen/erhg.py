"""``longsft data erhg``: entity-referenced hallucination generation.

From a faithful sample (article + human summary) make a hallucinated one: entities are extracted
from the article and summary, then one (gold score 2) or three (gold score 1) edits, each of a
different hallucination type, each confined to one summary sentence (or one inserted sentence),
the rest of the summary unchanged. Types are balanced over the output (least-used applicable type
first). Every output carries ``edits`` (type, sentence index, before, after) and ``parent``.

Two engines make the edits:

- ``rules`` (offline, no model): entity swap with another entity of the same kind from the
  article, number change, relation-word swap, negation flip, event-verb swap, timeline-marker
  swap, a fabricated cause, a fabricated sentence (from elsewhere in the book when given);
- ``llm``: any OpenAI-compatible endpoint, one prompt per type (ours), JSON reply validated
  (the sentence must exist, the edit must change it and stay one sentence) and retried; an
  endpoint that does not answer stops the run at the first request (answers so far are cached).

The input is checked whole before any edit: every record needs ``id, language, article,
summary``; unknown fields are refused as in the training data (``meta`` is free-form).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from longsft.train.common.errors import DataError
from longsft.train.common.io import atomic_write_text, check_input_file, check_output_file
from longsft.train.common.llm import LLMError, ask_json
from longsft.train.data.schema import read_records
from longsft.train.scoring.judgement import TYPES

SENT = {"en": re.compile(r"(?<=[.!?])\s+"), "zh": re.compile(r"(?<=[。！？])")}
JOIN = {"en": " ", "zh": ""}
SURNAMES = set("赵钱孙李周吴郑王冯陈褚卫蒋沈韩杨朱秦尤许何吕施张孔曹严华金魏陶姜戚谢邹喻柏水窦章云苏潘葛奚范彭郎鲁韦昌马"
               "苗凤花方俞任袁柳鲍史唐费薛雷贺倪汤殷罗毕郝安常乐于傅齐康伍余顾孟黄穆萧尹姚邵汪祁毛狄米贝明臧计伏成戴宋"
               "庞熊纪舒屈项祝董梁杜阮蓝闵季贾路江童颜郭梅盛林钟徐邱骆高夏蔡田樊胡凌霍虞万柯卢莫房解应丁邓洪包左石崔吉龚"
               "程邢裴陆荣翁荀甄曲封储靳段焦巴牧车侯宓全班仰秋仲伊宫宁仇栾暴甘厉戎祖武符刘景詹龙叶幸司黎薄印宿白怀蒲从"
               "鄂索咸赖卓蔺屠蒙池乔阴胥能苍双闻党翟谭贡劳姬申冉雍桑桂濮牛寿通边燕冀尚农温庄晏柴瞿阎慕连茹习宦艾鱼容向古"
               "易慎戈廖庾终居衡步都耿满弘匡国文寇广东欧沃利蔚越夔隆师巩聂晁勾敖融冷辛阚那简饶空曾沙养鞠须丰巢关相查后荆红"
               "游竺权盖益桓公賈甄薛劉陳張楊趙吳鄭馮蔣韓許呂孫錢衛孔嚴華魏陶謝鄒蘇潘葛範彭魯韋馬鳳俞袁鮑費雷賀湯羅畢郝樂傅"
               "齊康伍顧孟黃穆蕭尹姚邵汪毛臧戴宋龐熊紀舒屈項祝董樑杜阮藍閔季路江童顏郭梅盛鍾徐邱駱夏蔡田樊胡淩霍盧莫房應丁"
               "鄧洪龔程邢裴陸榮翁荀焦侯寧仇欒暴甘厲戎祖武符劉詹龍葉黎薄白懷蒲鄂咸賴卓藺屠蒙喬陰胥蒼雙聞黨翟譚貢勞姬申冉雍"
               "桑桂濮牛壽邊燕冀尚農溫莊晏柴瞿閻慕連茹習艾魚容向古易慎戈廖庾終居衡步耿滿弘匡國文寇廣歐利蔚越隆師鞏聶晁勾敖")
# surnames that are also everyday words at the start of a phrase (那些, 于是, 方才, 水结冰...)
AMBIGUOUS = set("那于应應连連水关關庄莊都空石金方文国國广廣东東向古易成明花云雲常乐樂通边邊尚居步满滿相查后红紅游公能从從"
                "时時和平安全高上下白黄黃封聞闻何许許宦宁寧祖")
NOT_IN_NAME = set("的了是在也不有就都而及与與把被着著过過说說道和又却卻这這那个個们們")
PLACE_LEAD = set("的了是在也不与與往到从從至回入出进進来來去和及把被")
PLACE_END = "城州府庄莊村镇鎮寺庙廟山河县縣国國关關渡江湖宫宮园園楼樓堂"
MEASURES = "名个個人位万萬千百年月日天两兩次匹里斤只隻座间間条條件本封口回"
ZH_DIGITS = "一二三四五六七八九"
EN_STOP = {"The", "A", "An", "He", "She", "It", "They", "We", "I", "But", "And", "When", "Then", "After", "Before",
           "In", "On", "At", "His", "Her", "Their", "This", "That", "There", "As", "Because", "While", "Later", "So",
           "Nobody", "Letters", "Rain", "One", "Two", "Mr", "Mrs", "Miss", "Sir", "Lady", "Lord"}
EN_WORDS = {"two": "three", "three": "five", "four": "seven", "five": "two", "six": "nine", "seven": "four",
            "eight": "eleven", "nine": "six", "ten": "twenty", "hundred": "thousand", "thousand": "hundred"}
SWAPS = {  # (type, language): word pairs; either direction
    ("relation", "en"): [("brother", "cousin"), ("sister", "aunt"), ("father", "uncle"), ("mother", "aunt"),
                         ("son", "nephew"), ("daughter", "niece"), ("husband", "brother"), ("wife", "sister"),
                         ("friend", "enemy"), ("master", "servant")],
    ("relation", "zh"): [("哥哥", "表兄"), ("姐姐", "妹妹"), ("父亲", "叔叔"), ("母亲", "姑姑"), ("儿子", "侄子"),
                         ("女儿", "侄女"), ("丈夫", "哥哥"), ("妻子", "妹妹"), ("朋友", "仇人"), ("主人", "仆人"),
                         ("岳丈", "叔父"), ("女婿", "外甥"), ("表兄", "亲兄")],
    ("inversion", "en"): [("agreed", "refused"), ("accepted", "rejected"), ("loved", "hated"), ("succeeded", "failed"),
                          ("won", "lost"), ("trusted", "distrusted"), ("helped", "hindered"), ("allowed", "forbade")],
    ("inversion", "zh"): [("答应", "拒绝"), ("同意", "反对"), ("喜欢", "厌恶"), ("成功", "失败"), ("接受", "拒绝"),
                          ("相信", "怀疑"), ("帮助", "阻挠"), ("允许", "禁止"), ("赞", "贬")],
    ("event", "en"): [("left", "arrived at"), ("burned", "rebuilt"), ("killed", "saved"), ("married", "divorced"),
                      ("bought", "sold"), ("found", "lost"), ("opened", "closed"), ("met", "avoided"),
                      ("led", "abandoned"), ("visited", "ignored"), ("wrote", "burned")],
    ("event", "zh"): [("离开", "到达"), ("烧毁", "修建"), ("杀死", "救下"), ("娶", "休"), ("买", "卖"), ("找到", "丢失"),
                      ("打开", "关闭"), ("遇见", "避开"), ("率领", "抛下"), ("拜访", "冷落"), ("进", "出")],
    ("temporal", "en"): [("before", "after"), ("first", "finally"), ("earlier", "later"), ("then", "before that")],
    ("temporal", "zh"): [("之前", "之后"), ("先", "后"), ("起初", "最后"), ("随后", "此前"), ("然后", "在此之前")],
}
CAUSE = {"en": "Because {e} demanded it, {s}", "zh": "因为{e}的要求，{s}"}
LOWER_FIRST = {"The", "A", "An", "He", "She", "It", "They", "His", "Her", "Their", "There", "This", "That", "We"}
TIME_PREFIX = {"en": "Before any of this, {s}", "zh": "在此之前，{s}"}
FABRICATED = {"en": "{e} secretly sold the family estate to a stranger.", "zh": "{e}暗中把家族的庄园卖给了一个陌生人。"}


def _lead(s: str, lang: str) -> str:
    """``s`` continuing a sentence: "The man..." -> "the man...", names stay capitalised."""
    first = s.split(" ", 1)[0]
    return s[0].lower() + s[1:] if lang == "en" and first in LOWER_FIRST else s


def sentences(text: str, lang: str) -> list[str]:
    return [s for s in (p.strip() for p in SENT[lang].split(text)) if s]


@dataclass
class Entities:
    """Entities of one sample by kind (``person``, ``place``), most frequent first."""

    by_kind: dict[str, list[str]] = field(default_factory=dict)

    def all(self) -> list[str]:
        return [e for es in self.by_kind.values() for e in es]

    def kind(self, e: str) -> str | None:
        return next((k for k, es in self.by_kind.items() if e in es), None)


def extract_entities(article: str, summary: str, lang: str, min_count: int = 2) -> Entities:
    """Offline heuristics: capitalised names (en); surname-led names and place suffixes (zh)."""
    text = article + "\n" + summary
    if lang == "en":
        counts = Counter(m for m in re.findall(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*", text) if m not in EN_STOP)
        places = {m for m in counts if re.search(rf"\b(?:at|in|to|from|near) (?:the )?{re.escape(m)}\b", text)}
        keep = [m for m, c in counts.most_common() if c >= min_count]
        return Entities({"person": [m for m in keep if m not in places], "place": [m for m in keep if m in places]})
    han = r"[\u4e00-\u9fff]"
    names = Counter()
    for m in re.finditer(rf"(?={han}{{3}})", text):
        i = m.start()
        if text[i] in SURNAMES and text[i] not in AMBIGUOUS and text[i + 1] not in NOT_IN_NAME:
            names[text[i:i + 2]] += 1
            names[text[i:i + 3]] += 1
    persons = []
    for n2, c2 in names.most_common():
        if len(n2) != 2 or c2 < min_count:
            continue
        best3 = max((n for n in names if len(n) == 3 and n.startswith(n2)), key=names.get, default=None)
        if best3 and best3[2] in NOT_IN_NAME:
            best3 = None
        pick = best3 if best3 and names[best3] >= 0.6 * c2 else n2
        if pick not in persons and not any(pick in p or p in pick for p in persons):
            persons.append(pick)
    places = Counter(m for m in re.findall(rf"{han}{{1,2}}[{PLACE_END}]", text) if m[0] not in PLACE_LEAD)
    keep = []
    for p, c in places.most_common():  # "往青州" is "青州" with a verb in front: keep the shorter form
        if c >= min_count and not any(p in n for n in persons) and not any(
                p.endswith(q) and places[q] >= c for q in places if len(q) < len(p)):
            keep.append(p)
    return Entities({"person": persons[:20], "place": keep[:10]})


@dataclass
class Edit:
    type: str
    index: int  # sentence index in the *output* summary
    before: str | None  # None: an inserted sentence
    after: str


class RuleEngine:
    """Offline edits; each method returns the edited sentence or None when the type does not apply."""

    name = "rules"

    def __init__(self, rng: random.Random, fabrication_pool: dict[str, list[str]] | None = None):
        self.rng, self.pool = rng, fabrication_pool or {}

    def edit(self, kind: str, sent: str, lang: str, ents: Entities, book: str | None = None,
             index: int = 0) -> str | None:
        """``sent`` (the ``index``-th summary sentence; "" for an insertion) edited as ``kind``."""
        self._index = index
        return getattr(self, f"_{kind}")(sent, lang, ents, book)

    def _entity(self, s, lang, ents, book):
        for e in self._shuffled([e for e in ents.all() if e in s]):
            others = [o for o in ents.by_kind.get(ents.kind(e), []) if o != e and o not in s and e not in o]
            if others:
                return s.replace(e, self.rng.choice(others), 1)
        return None

    def _numerical(self, s, lang, ents, book):
        if lang == "en":
            m = re.search(r"\b\d[\d,]*\b", s)
            if m:
                n = int(m.group().replace(",", ""))
                return s[:m.start()] + str(n * 2 + self.rng.randint(1, 9)) + s[m.end():]
            m = re.search(r"\b(" + "|".join(EN_WORDS) + r")\b", s)
            return s[:m.start()] + EN_WORDS[m.group()] + s[m.end():] if m else None
        m = re.search(r"\d+", s)
        if m:
            return s[:m.start()] + str(int(m.group()) * 2 + self.rng.randint(1, 9)) + s[m.end():]
        m = re.search(rf"[{ZH_DIGITS}十百千万萬两兩]*[{ZH_DIGITS}](?=[十百千万萬]?[{MEASURES}])", s)
        if m:
            d = m.group()[-1]
            new = self.rng.choice([x for x in ZH_DIGITS if x != d])
            return s[:m.end() - 1] + new + s[m.end():]
        return None

    def _swap(self, kind, s, lang):
        pairs = [(a, b) for a, b in SWAPS[(kind, lang)]] + [(b, a) for a, b in SWAPS[(kind, lang)]]
        for a, b in self._shuffled(pairs):
            hit = re.search(rf"\b{re.escape(a)}\b", s) if lang == "en" else (re.search(re.escape(a), s))
            if hit:
                return s[:hit.start()] + b + s[hit.end():]
        return None

    def _relation(self, s, lang, ents, book):
        out = self._swap("relation", s, lang)
        if out is None:  # swap two people of the sentence (who did what to whom)
            people = [e for e in ents.by_kind.get("person", []) if e in s]
            if len(people) >= 2 and people[0] not in people[1] and people[1] not in people[0]:
                a, b = people[:2]
                out = s.replace(a, "\0").replace(b, a).replace("\0", b)
        return out

    def _inversion(self, s, lang, ents, book):
        out = self._swap("inversion", s, lang)
        if out is not None:
            return out
        if lang == "en":
            m = re.search(r"\b(was|were|is|are|had|could|would|did|will)\b(?! not)", s)
            return s[:m.end()] + " not" + s[m.end():] if m else None
        people = [e for e in ents.by_kind.get("person", []) if e in s]
        if people:  # "X did Y" -> "X did not do Y"
            i = s.index(people[0]) + len(people[0])
            return s[:i] + "并未" + s[i:] if i < len(s) else None
        return None

    def _event(self, s, lang, ents, book):
        return self._swap("event", s, lang)

    def _temporal(self, s, lang, ents, book):
        out = self._swap("temporal", s, lang)
        if out is None and self._index > 0:  # a later event told as an earlier one
            out = TIME_PREFIX[lang].format(s=_lead(s, lang))
        return out

    def _causal(self, s, lang, ents, book):
        people = [e for e in ents.by_kind.get("person", []) if e not in s and s not in e]
        if not people:
            return None
        return CAUSE[lang].format(e=self.rng.choice(people), s=_lead(s, lang))

    def _fabrication(self, s, lang, ents, book):
        pool = [x for x in self.pool.get(book or "", []) if x not in s]
        if pool:
            return self.rng.choice(pool)
        people = ents.by_kind.get("person", [])
        return FABRICATED[lang].format(e=self.rng.choice(people)) if people else None

    def _shuffled(self, xs: list) -> list:
        xs = list(xs)
        self.rng.shuffle(xs)
        return xs


PROMPT = """You edit one sentence of a novel summary to plant exactly one hallucination of type "{kind}": {what}
Change only this sentence; keep its language ({lang}), style and length; the result must be one sentence.
Entities of the novel excerpt you may use: {entities}.
Sentence: <<<{sentence}>>>
Reply with JSON only: {{"perturbed": "<the edited sentence>"}}"""
WHAT = {
    "entity": "replace one character, place or object with another one from the same story",
    "numerical": "change one number, quantity, date or age",
    "relation": "change the relationship between two characters (kinship, rank, who did what to whom)",
    "inversion": "state the opposite of what the sentence says (negate it or use the antonym)",
    "event": "replace the event or action with a different one",
    "temporal": "disrupt the timeline (move the event earlier or later, reverse an order)",
    "causal": "add or change a cause so that a false causal link appears",
    "fabrication": "write a NEW sentence about an event that never happens in the story (ignore the sentence given)",
}


class LLMEngine:
    """Edits by an OpenAI-compatible model; a reply that is not one changed sentence is retried."""

    name = "llm"

    def __init__(self, endpoint, cache=None, retries: int = 3):
        self.ep, self.cache, self.retries, self.errors = endpoint, cache, retries, []

    def edit(self, kind: str, sent: str, lang: str, ents: Entities, book: str | None = None,
             index: int = 0) -> str | None:
        def check(obj: dict) -> str | None:
            new = obj.get("perturbed")
            if not isinstance(new, str) or not new.strip():
                return 'missing "perturbed" string'
            if new.strip() == sent.strip():
                return "the sentence is unchanged"
            if len(sentences(new, lang)) != 1:
                return "the edit must be exactly one sentence"
            return None

        prompt = PROMPT.format(kind=kind, what=WHAT[kind], lang=lang, entities=", ".join(ents.all()[:20]) or "none",
                               sentence=sent)
        try:
            return ask_json(self.ep, prompt, check, self.retries, cache=self.cache)["perturbed"].strip()
        except LLMError as e:
            self.errors.append(str(e))
            return None


def perturb(sample: dict, types: list[str], engine, rng: random.Random) -> tuple[str, list[Edit]] | str:
    """Apply one edit per type, each to a different sentence; returns (summary, edits) or a reason."""
    lang = sample["language"]
    sents = sentences(sample["summary"], lang)
    if not sents:
        return "empty summary"
    ents = extract_entities(sample["article"], sample["summary"], lang)
    used: set[int] = set()
    edits: list[Edit] = []
    for kind in sorted(types, key=lambda t: t == "fabrication"):  # insertions last: indices stay valid
        if kind == "fabrication":  # given the whole summary: what to avoid repeating
            new = engine.edit(kind, JOIN[lang].join(sents), lang, ents, sample.get("book"))
            if new is None:
                return "fabrication: nothing to insert"
            at = rng.randrange(len(sents) + 1)
            sents.insert(at, new)
            for e in edits:
                e.index += e.index >= at
            edits.append(Edit(kind, at, None, new))
            continue
        order = [i for i in range(len(sents)) if i not in used]
        rng.shuffle(order)
        for i in order:
            new = engine.edit(kind, sents[i], lang, ents, sample.get("book"), i)
            if new is not None and new != sents[i] and len(sentences(new, lang)) == 1:
                edits.append(Edit(kind, i, sents[i], new))
                sents[i] = new
                used.add(i)
                break
        else:
            return f"{kind}: no sentence it applies to"
    return JOIN[lang].join(sents), edits


def generate(samples: list[dict], engine, n_types: list[int], seed: int = 42) -> tuple[list[dict], list[dict]]:
    """One hallucinated sample per input; ``n_types[k]`` edits for input ``k`` (1 or 3).

    Types are balanced: each sample gets the least-used types that apply to it."""
    rng = random.Random(seed)
    used = Counter({t: 0 for t in TYPES})
    out, problems = [], []
    for sample, n in zip(samples, n_types):
        order = sorted(TYPES, key=lambda t: (used[t], rng.random()))
        result, chosen = None, []
        for start in range(len(order)):  # fall back to the next types when one does not apply
            chosen = [order[(start + k) % len(order)] for k in range(n)]
            result = perturb(sample, chosen, engine, random.Random(rng.random()))
            if not isinstance(result, str):
                break
        if isinstance(result, str):
            errors = getattr(engine, "errors", [])
            problems.append({"id": sample["id"], "problem": f"no {n}-type edit applies ({result})"
                             + (f"; last model error: {errors[-1]}" if errors else "")})
            continue
        summary, edits = result
        used.update(chosen)
        out.append({**{k: v for k, v in sample.items()
                       if k not in ("summary", "types", "gold_score", "output", "reason")},
                    "id": f"{sample['id']}-erhg", "summary": summary, "gold_score": 2 if n == 1 else 1,
                    "types": sorted({e.type for e in edits}), "source": "erhg", "parent": sample["id"],
                    "edits": [e.__dict__ for e in edits]})
    return out, problems


def book_pool(samples: list[dict]) -> dict[str, list[str]]:
    """Summary sentences per book: a fabricated sentence can come from elsewhere in the same book."""
    pool: dict[str, list[str]] = {}
    for s in samples:
        if s.get("book"):
            pool.setdefault(s["book"], []).extend(sentences(s["summary"], s["language"]))
    return pool


def check_paths(inputs: str, out: str) -> None:
    """Before anything is asked or written: the input is readable, ``out`` is a writable file name
    and not the input itself."""
    check_input_file(inputs)
    check_output_file(out)
    if Path(out).exists() and Path(out).resolve() == Path(inputs).resolve():
        raise DataError(f"--out {out}: is the input file; give another name")


def run(inputs: str, out: str, engine, multi: float = 0.3, seed: int = 42) -> dict:
    """ERHG over a samples file (id, language, article, summary; checked before any edit)."""
    check_paths(inputs, out)
    samples = read_records(inputs)
    if isinstance(engine, RuleEngine) and not engine.pool:
        engine.pool = book_pool(samples)
    rng = random.Random(seed)
    n_types = [3 if rng.random() < multi else 1 for _ in samples]
    outs, problems = generate(samples, engine, n_types, seed)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in outs))
    atomic_write_text(str(out) + ".problems.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in problems))
    counts = Counter(t for r in outs for t in r["types"])
    return {"inputs": len(samples), "outputs": len(outs), "problems": len(problems), "types": dict(counts)}
