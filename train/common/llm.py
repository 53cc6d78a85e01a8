"""The one client for OpenAI-compatible chat endpoints (vLLM, SGLang, llama.cpp, hosted APIs).

Data construction (ERHG, MMA), ``longsft eval backend=openai`` and ConStory's judge all ask through
:class:`Endpoint`, on the ``openai`` SDK: one client per endpoint keeps its connections open, and
connection errors, timeouts and HTTP 408/409/429/5xx are retried with exponential backoff, honouring
the server's ``Retry-After`` (up to two minutes, as openai 3.x does; ``compat.SUPPORTED``). Each retry
is printed with why the request before it failed (httpx event hooks). An endpoint that gives no
answer after the retries, or refuses the request (wrong model, key or URL), is
:class:`EndpointError`: a build stops at the first request instead of grinding through every sample.

:func:`reask_json` is the one "re-ask with the complaint" loop: a JSON object is parsed from the
reply and checked by the caller's validator; a complaint goes back to the model as the next turn.
:func:`ask_json` adds the answer cache.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from longsft.train.common.cache import AppendCache
from longsft.train.common.jsontext import extract_json_object


@dataclass(frozen=True)
class Endpoint:
    """``model@base_url``; the key is read from ``api_key_env``; ``retries`` after the first request.
    ``temperature`` and ``seed`` are sent with every request (seed: only when set)."""

    model: str
    base_url: str
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0
    timeout_s: float = 300.0
    retries: int = 2
    max_tokens: int = 1024  # the most tokens a reply may have (a request's max_tokens)
    seed: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "Endpoint":
        """``MODEL@URL``, optionally ``#temperature=T,seed=S`` after the URL (a fragment: never sent to
        the server): the same served model asked another way, e.g. a second MMA judge that samples."""
        where, _, options = spec.partition("#")
        model, at, url = where.partition("@")
        if not at or not model or not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint {spec!r}: expected MODEL@http(s)://host:port/v1[#temperature=T,seed=S]")
        kw: dict = {}
        for item in filter(None, options.split(",")):
            key, eq, value = item.partition("=")
            try:
                if key == "temperature" and eq:
                    kw[key] = float(value)
                    if not 0 <= kw[key] <= 2:
                        raise ValueError
                elif key == "seed" and eq:
                    kw[key] = int(value)
                    if kw[key] < 0:
                        raise ValueError
                else:
                    raise KeyError(key)
            except KeyError:
                raise ValueError(f"endpoint {spec!r}: unknown option {item!r} (temperature=T, seed=S)") from None
            except ValueError:
                want = "a number in [0, 2]" if key == "temperature" else "an integer >= 0"
                raise ValueError(f"endpoint {spec!r}: {item!r}: {key} must be {want}") from None
        return cls(model, url.rstrip("/"), **kw)

    def __str__(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.sampling())
        return f"{self.model}@{self.base_url}" + (f"#{options}" if options else "")

    def sampling(self) -> list[tuple[str, float | int]]:
        """The sampling settings that differ from greedy decoding without a seed."""
        return [*((("temperature", self.temperature),) if self.temperature != 0 else ()),
                *((("seed", self.seed),) if self.seed is not None else ())]

    def cache_key(self, prompt: str) -> str:
        """The cache key of this endpoint's answer to ``prompt``: model, URL, sampling settings, prompt
        (a greedy endpoint's keys are those of earlier versions: caches built by them still resume)."""
        return answer_key(self.model, self.base_url, *(f"{k}={v}" for k, v in self.sampling()), prompt)

    def chat(self, messages: list[dict], max_tokens: int | None = None) -> "Reply":
        """One chat completion (after the SDK's retries), or :class:`EndpointError`. ``max_tokens``: the
        endpoint's own by default."""
        max_tokens = max_tokens or self.max_tokens
        import openai

        call = _Call(str(self), self.retries)
        token = _CALL.set(call)
        try:
            r = _client(self.base_url, os.environ.get(self.api_key_env) or "none", self.timeout_s, self.retries) \
                .chat.completions.create(model=self.model, messages=messages, temperature=self.temperature,
                                         max_tokens=max_tokens, **({"seed": self.seed} if self.seed is not None else {}))
            choice = r.choices[0]
            text, usage, finish = choice.message.content or "", r.usage, choice.finish_reason
        except openai.APIStatusError as e:
            why = f"HTTP {e.status_code}" + (f": {detail}" if (detail := _detail(e)) else "")
            if _retryable(e.status_code):
                wait = e.response.headers.get("retry-after")
                asked = (f"; it asked to wait {wait} s, longer than the client waits (2 minutes)"
                         if wait and call.attempts == 1 and self.retries else "")
                raise EndpointError(f"{self}: no answer after {_requests(call.attempts)} ({why}{asked})") from None
            raise EndpointError(f"{self}: {why}; wrong model name, key or URL?") from None
        except openai.APIConnectionError as e:
            cause = e.__cause__ or e.__context__
            why = f"{e.message} {cause}".strip() if cause else e.message
            raise EndpointError(f"{self}: no answer after {_requests(call.attempts)} ({why}); is the server "
                                "running at that URL?") from None
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, openai.APIResponseValidationError) as e:
            raise EndpointError(f"{self}: the reply is not an OpenAI chat completion ({type(e).__name__}); is the "
                                "URL the API root (…/v1)?") from None
        finally:
            _CALL.reset(token)
        return Reply(text, getattr(usage, "prompt_tokens", 0) or 0, getattr(usage, "completion_tokens", 0) or 0,
                     "length" if finish == "length" else "stop")


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"  # "length": cut at max_tokens


class LLMError(RuntimeError):
    """The endpoint answered, but no answer validated after the re-asks."""


class EndpointError(RuntimeError):
    """The endpoint gave no answer at all: down, wrong URL or model, refusing requests."""


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


def _retryable(status: int) -> bool:
    """The statuses the SDK retries (408 timeout, 409 lock, 429 rate limit, any 5xx)."""
    return status in (408, 409, 429) or status >= 500


def _detail(e) -> str:
    """The server's explanation of an HTTP error: its JSON ``message``, else the body text (shortened)."""
    body = e.body.get("message") if isinstance(e.body, dict) and "message" in e.body else None
    if body is None:
        try:
            body = e.response.text
        except RuntimeError:  # httpx's ResponseNotRead (a streamed body): nothing more to say
            body = ""
    return " ".join(str(body).split())[:300]


# ------------------------------------------------------------------------------ printed retries


@dataclass
class _Call:
    """One ``Endpoint.chat``: its requests so far and why the last one failed."""

    endpoint: str
    retries: int
    attempts: int = 0
    why: str = ""


NO_RESPONSE = "no response (connection failed or timed out)"
_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("longsft_llm_call", default=None)


def _on_request(request) -> None:
    """httpx hook, per attempt: from the second on, one line saying the previous one failed and why."""
    call = _CALL.get()
    if call is None:
        return
    call.attempts += 1
    if call.attempts > 1:
        print(f"longsft: {call.endpoint}: {call.why}; retry {call.attempts - 1}/{call.retries}", file=sys.stderr,
              flush=True)
    call.why = NO_RESPONSE  # unless a response says otherwise


def _on_response(response) -> None:
    call = _CALL.get()
    if call is not None and response.status_code >= 400:
        wait = response.headers.get("retry-after")
        call.why = f"HTTP {response.status_code}" + (f", Retry-After {wait} s" if wait else "")


@functools.cache
def _client(base_url: str, api_key: str, timeout_s: float, retries: int):
    """One SDK client per endpoint and settings: its connection pool stays open across requests."""
    import openai

    http = openai.DefaultHttpxClient(event_hooks={"request": [_on_request], "response": [_on_response]})
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=retries, http_client=http)


# ------------------------------------------------------------------------------ re-asking


def reask(reply: Callable[[list[dict]], str], prompt: str, read: Callable[[str], tuple[object, str | None]],
          retries: int, correction: str = "Reply with the corrected JSON object only.") -> tuple[object, list[str]]:
    """(the first answer ``read`` accepts, complaints so far) after at most ``retries`` re-asks.

    ``reply(messages) -> text`` asks the model; ``read(text) -> (answer, complaint)``: the complaint
    None for an accepted answer, else sent back as the next user turn after the model's own reply,
    with ``correction`` (so even a greedy model is asked something new). None accepted after the
    re-asks: (None, every complaint)."""
    messages = [{"role": "user", "content": prompt}]
    complaints = []
    for _ in range(retries + 1):
        text = reply(messages)
        answer, complaint = read(text)
        if complaint is None:
            return answer, complaints
        complaints.append(complaint)
        messages = messages[:1] + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": f"Invalid answer: {complaint}. {correction}"}]
    return None, complaints


def reask_json(reply: Callable[[list[dict]], str], prompt: str, validate: Callable[[dict], str | None],
               retries: int) -> tuple[dict | None, list[str]]:
    """:func:`reask` for a JSON object that ``validate(obj)`` accepts (None) or complains about."""

    def read(text: str) -> tuple[dict | None, str | None]:
        obj = extract_json_object(text)
        return obj, ("no JSON object in the reply" if obj is None else validate(obj))

    return reask(reply, prompt, read, retries)


def answer_key(*parts: str) -> str:
    """Cache key of an answer: a hash of what determines it (model, endpoint, prompt, ...)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def ask_json(ep: Endpoint, prompt: str, validate: Callable[[dict], str | None], retries: int = 3,
             cache: AppendCache | None = None) -> dict:
    """A valid JSON answer of ``ep`` to ``prompt`` (:func:`reask_json`), cached by (model, endpoint,
    prompt); :class:`LLMError` when none validates, :class:`EndpointError` when the endpoint is down."""
    key = ep.cache_key(prompt)
    hit = cache.get(key) if cache else None
    if hit is not None:
        return hit["answer"]
    obj, complaints = reask_json(lambda messages: ep.chat(messages).text, prompt, validate, retries)
    if obj is None:
        raise LLMError(f"{ep.model}: no valid answer after {retries + 1} tries: {'; '.join(complaints)}")
    if cache:
        cache.put({"key": key, "answer": obj})
    return obj
