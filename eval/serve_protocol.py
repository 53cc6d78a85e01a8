"""The OpenAI protocol of ``longsft serve``: request bodies checked into typed requests, and the response
objects (whole, and the chunks of a server-sent-event stream) for ``/v1/chat/completions`` and
``/v1/completions``. No HTTP here (:mod:`longsft.eval.serve`)."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RequestError(Exception):
    """A request the server refuses, as an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return error_body(self.status, str(self), self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Request:
    """One generation request: ``messages`` (chat) or ``prompt`` (completions), and how to sample it."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    messages: list[dict] | None = None
    prompt: str | None = None


def _number(obj: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = obj.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not (lo < v if lo_open else lo <= v) or v > hi:
        raise RequestError(400, f"{key} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _content(v: Any, i: int) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in v):
        return "\n".join(p["text"] for p in v)
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _object(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def _sampling(obj: dict, max_new_tokens: int, temperature: float, key: str = "max_tokens") -> dict:
    """The keys both routes share, checked: length, sampling, seed, n, stop, streaming."""
    if obj.get("n") not in (None, 1):
        raise RequestError(400, "only n=1 is supported", "n")
    if obj.get("stop"):
        raise RequestError(400, "stop sequences are not supported by longsft serve", "stop")
    max_tokens = obj.get(key)
    if max_tokens is None:
        max_tokens = max_new_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(400, f"{key} must be a positive integer, got {max_tokens!r}", key)
    elif max_tokens > max_new_tokens:
        raise RequestError(400, f"{key}={max_tokens} is over this server's limit of {max_new_tokens} "
                                f"(longsft serve max_new_tokens=)", key)
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise RequestError(400, f"seed must be a non-negative integer, got {seed!r}", "seed")
    stream = obj.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream must be true or false, got {stream!r}", "stream")
    options = obj.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    return {"max_tokens": max_tokens, "temperature": _number(obj, "temperature", temperature, 0, 2),
            "top_p": _number(obj, "top_p", 1.0, 0, 1, lo_open=True), "seed": seed, "stream": stream,
            "include_usage": bool(options.get("include_usage"))}


def parse_chat(body: bytes, max_new_tokens: int, temperature: float) -> Request:
    """A ``/chat/completions`` body -> :class:`Request`; anything malformed -> ``RequestError(400)``."""
    obj = _object(body)
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}].role must be one of {sorted(ROLES)}", f"messages[{i}].role")
        messages.append({"role": ROLES[m["role"]], "content": _content(m.get("content"), i)})
    if obj.get("tools"):
        raise RequestError(400, "tools are not supported by longsft serve", "tools")
    key = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else "max_tokens"
    return Request(**_sampling(obj, max_new_tokens, temperature, key), messages=messages)


def parse_completion(body: bytes, max_new_tokens: int, temperature: float) -> Request:
    """A ``/completions`` body (one ``prompt`` string, or a list of one) -> :class:`Request`."""
    obj = _object(body)
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "prompt must be a non-empty string (or a list of one; token ids are not taken)",
                           "prompt")
    for key in ("echo", "suffix", "logprobs"):
        if obj.get(key):
            raise RequestError(400, f"{key} is not supported by longsft serve", key)
    if obj.get("best_of") not in (None, 1):
        raise RequestError(400, "only best_of=1 is supported", "best_of")
    return Request(**_sampling(obj, max_new_tokens, temperature), prompt=prompt)


class Reply:
    """The response objects of one request (``chat``: chat.completion, else text_completion), whole or as
    stream chunks, all with one id and creation time."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else
                      {"text": text, "logprobs": None})
        return {**self._head(False), "choices": [choice], "usage": self.usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False,
              usage: dict | None = None) -> dict:
        """A stream chunk: a piece of text (the first chat chunk also names the role), the finish reason,
        or (``usage``) the last chunk, with no choices."""
        if usage is not None:
            return {**self._head(True), "choices": [], "usage": usage}
        choice: dict = {"index": 0, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text or ""} if first else
                               ({"content": text} if text else {}))
        else:
            choice.update({"text": text or "", "logprobs": None})
        return {**self._head(True), "choices": [choice]}
