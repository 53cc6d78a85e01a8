"""A minimal client for OpenAI-compatible chat endpoints (vLLM, SGLang, llama.cpp, hosted APIs).

Standard library only. :func:`ask_json` sends a prompt, parses a JSON object from the reply,
checks it with the caller's validator, and retries (with the complaint appended) when the reply
is malformed; a reply that never validates is :class:`LLMError` (the caller reports it and goes
on). An endpoint that does not answer at all (refused, timed out, HTTP error, not a chat
completion) is :class:`EndpointError` after two short, printed retries: the build stops at the
first request instead of grinding through every sample; answers so far stay cached.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from longsft.train.common.jsontext import extract_json_object
from longsft.train.common.io import read_log


@dataclass(frozen=True)
class Endpoint:
    """``model@base_url`` (key from ``api_key_env``)."""

    model: str
    base_url: str
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0
    timeout_s: float = 300.0

    @classmethod
    def parse(cls, spec: str) -> "Endpoint":
        model, at, url = spec.partition("@")
        if not at or not model or not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint {spec!r}: expected MODEL@http(s)://host:port/v1")
        return cls(model, url.rstrip("/"))


class LLMError(RuntimeError):
    """The endpoint answered, but no answer validated after the retries."""


class EndpointError(RuntimeError):
    """The endpoint gave no answer at all: down, wrong URL or model, refusing requests."""


RETRYABLE_HTTP = (408, 429, 500, 502, 503, 504)


def chat_full(ep: Endpoint, messages: list[dict], max_tokens: int = 1024) -> tuple[str, dict]:
    """(reply text, usage dict) of one chat completion."""
    body = json.dumps({"model": ep.model, "messages": messages, "temperature": ep.temperature,
                       "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{ep.base_url}/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ.get(ep.api_key_env, 'none')}"})
    with urllib.request.urlopen(req, timeout=ep.timeout_s) as r:
        reply = json.loads(r.read())
    return reply["choices"][0]["message"]["content"] or "", reply.get("usage") or {}


def chat(ep: Endpoint, messages: list[dict], max_tokens: int = 1024) -> str:
    return chat_full(ep, messages, max_tokens)[0]


class Cache:
    """Valid answers by (model, prompt), appended to a JSONL file: an interrupted build resumes
    without asking again (a half-written last line is ignored)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = path
        self.data = {rec["key"]: rec["answer"] for rec in read_log(path)
                     if isinstance(rec, dict) and "key" in rec} if path else {}
        self.f = None  # opened at the first answer: a run that gets none leaves no file

    @staticmethod
    def key(ep: Endpoint, prompt: str) -> str:
        return hashlib.sha256(f"{ep.model}\0{ep.base_url}\0{prompt}".encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, answer: dict) -> None:
        self.data[key] = answer
        if self.path and self.f is None:
            self.f = open(self.path, "a", encoding="utf-8")
        if self.f:
            self.f.write(json.dumps({"key": key, "answer": answer}, ensure_ascii=False) + "\n")
            self.f.flush()


def _request(ep: Endpoint, messages: list[dict], tries: int, backoff_s: float) -> str:
    """One reply text; connection errors, timeouts and HTTP 408/429/5xx are retried ``tries - 1``
    times (each retry printed), anything else fails at once: :class:`EndpointError` names the endpoint."""
    for attempt in range(tries):
        try:
            return chat(ep, messages)
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read(300).decode("utf-8", "replace").split())
            why = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
            if e.code not in RETRYABLE_HTTP:
                raise EndpointError(f"{ep.model}@{ep.base_url}: {why}; wrong model name, key or URL?") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            why = f"{getattr(e, 'reason', None) or e}"
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EndpointError(f"{ep.model}@{ep.base_url}: the reply is not an OpenAI chat completion ({e!r}); "
                                "is the URL the API root (…/v1)?") from None
        if attempt + 1 < tries:
            wait = backoff_s * 2 ** attempt
            print(f"longsft: {ep.model}@{ep.base_url}: request failed ({why}); retry {attempt + 1}/{tries - 1} "
                  f"in {wait:g}s", file=sys.stderr, flush=True)
            time.sleep(wait)
    raise EndpointError(f"{ep.model}@{ep.base_url}: no answer after {tries} requests ({why}); is the server "
                        "running at that URL?")


def ask_json(ep: Endpoint, prompt: str, validate, retries: int = 3, backoff_s: float = 0.5,
             cache: Cache | None = None, network_tries: int = 3) -> dict:
    """Ask until ``validate(obj)`` returns None (valid) or the retries run out (:class:`LLMError`).

    ``validate`` returns a complaint string for a parsed-but-wrong object; it is sent back to the
    model on the next try. A request that gets no reply is retried ``network_tries - 1`` times with
    backoff, then raises :class:`EndpointError` (the endpoint is down: stop, do not go on)."""
    key = Cache.key(ep, prompt) if cache else None
    if cache and cache.get(key) is not None:
        return cache.get(key)
    messages = [{"role": "user", "content": prompt}]
    problems = []
    for _ in range(retries + 1):
        text = _request(ep, messages, network_tries, backoff_s)
        obj = extract_json_object(text)
        complaint = "no JSON object in the reply" if obj is None else validate(obj)
        if complaint is None:
            if cache:
                cache.put(key, obj)
            return obj
        problems.append(complaint)
        messages = messages[:1] + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": f"Invalid answer: {complaint}. Reply with the "
                                                               "corrected JSON object only."}]
    raise LLMError(f"{ep.model}: no valid answer after {retries + 1} tries: {'; '.join(problems)}")
