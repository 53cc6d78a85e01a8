"""``longsft serve``: an OpenAI-compatible endpoint over one HF model, on uvicorn, bounded against bad clients.

    longsft serve model=runs/tiny/stages/s4k/best [tokenizer=qwen] [port=8000] [host=127.0.0.1]
        [max_new_tokens=512] [temperature=0] [served_model_name=NAME] [api_key=KEY | $LONGSFT_API_KEY]
        [max_body_bytes=8388608] [timeout=30] [max_queue=64] [max_pending=128] [batch=1]

Scope: ``POST /v1/chat/completions`` (the whole conversation through the tokenizer's chat template) and
``POST /v1/completions`` (a plain prompt), each whole or streamed (``stream: true``: server-sent events,
OpenAI's chunks, ``stream_options.include_usage``); ``max_tokens``/``max_completion_tokens``,
``temperature``, ``top_p``, ``seed``; no tools, ``stop``, logprobs or ``n`` > 1. ``GET /v1/models``, and
``GET /health`` (no key needed). For checkpoints without a serving stack and for the tests of the ``openai``
backend; for throughput use ``vllm serve`` or SGLang. Unlike OpenAI's: a request without ``temperature``
gets the server's (0: greedy), its ``model`` is not checked, and each connection carries one request.

Limits, each a key: a body over ``max_body_bytes`` gets 413 (``Expect: 100-continue``: before it is sent);
``max_tokens`` over ``max_new_tokens`` gets 400 (refused, not clamped: a silently shortened answer would
skew an evaluation); a request's headers must arrive within ``timeout`` seconds of the connection and its
body within ``timeout`` of its headers (408), and a connection that sends nothing holds no thread and is
closed after ``timeout`` (or sooner, oldest first, beyond ``max_pending``); beyond ``max_queue`` requests
waiting for the model, a request gets 503. Every error is JSON in OpenAI's shape. The model generates one
request at a time, in arrival order, so a request waits at most for those ahead of it, each bounded by
``max_new_tokens``: that cap is the fairness guarantee (no preemption). ``batch=N`` (default 1: none)
generates greedy whole requests that wait together as one left-padded batch of up to N (a GPU makes
N replies in about the time of one; in bf16 padding can round a reply differently from its unbatched
one); streamed and sampled requests still go one at a time. A streamed request whose
client goes away stops generating at the next token. A missing or cut-off model, and a port in use, are
reported (exit 2) before the model loads; a host other than loopback is warned about.

The transport is uvicorn (HTTP/1.1 by h11, one asyncio loop; :mod:`.serve_http`) with Starlette's routing; the
model runs on one worker thread. The protocol's objects are in :mod:`.serve_protocol`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from longsft.eval.backends import HFBackend
from longsft.eval.eval_config import EvalConfig, check_model, model_config
from longsft.eval.serve_http import Server, read_body
from longsft.eval.serve_protocol import Reply, Request, RequestError, error_body, parse_chat, parse_completion
from longsft.train.common.errors import ConfigError
from longsft.train.config.help import config_help
from longsft.train.config.loader import from_args

API_KEY_ENV = "LONGSFT_API_KEY"


@dataclass
class ServeConfig:
    model: str = ""
    tokenizer: str | None = None
    recipe: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed)
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    enable_thinking: bool = False
    served_model_name: str | None = None  # the id in /v1/models; default: the model folder's name
    api_key: str | None = None  # Bearer key required on every route but /health; default $LONGSFT_API_KEY
    max_new_tokens: int = 512  # the most a request may ask for (max_tokens), and its default
    temperature: float = 0.0  # for a request that gives none (0: greedy)
    max_body_bytes: int = 8 << 20  # larger request bodies: 413, unread
    timeout: float = 30.0  # seconds: for a request's headers, then for its body; idle connections closed after it
    max_queue: int = 64  # requests waiting while the model generates another; beyond: 503
    batch: int = 1  # greedy whole (not streamed) requests waiting together generated as one batch, up to this many
    max_pending: int = 128  # open connections whose request has not arrived; beyond: the oldest is closed

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("model= is required (longsft serve model=PATH)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in 0..65535 (0: any free port)")
        for key in ("max_new_tokens", "max_body_bytes", "max_queue", "max_pending", "batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError(f"timeout={self.timeout} must be a positive number of seconds")
        if not 0 <= self.temperature <= 2:
            raise ConfigError(f"temperature={self.temperature} must be in [0, 2]")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key= is empty (an unset shell variable?); omit it for no key")
        if self.served_model_name is not None and not str(self.served_model_name).strip():
            raise ConfigError("served_model_name= is empty")


def served_name(cfg: ServeConfig) -> str:
    """The model id clients see: ``served_model_name``, else the folder's name (never its local path)."""
    if cfg.served_model_name:
        return str(cfg.served_model_name)
    path = Path(cfg.model)
    return path.resolve().name if path.exists() else cfg.model  # not a folder: a hub id, shown as given


def api_key(cfg: ServeConfig) -> str | None:
    """``api_key``, else ``$LONGSFT_API_KEY`` (kept out of ``ps``), else None: no key needed."""
    return cfg.api_key or os.environ.get(API_KEY_ENV) or None


class ModelQueue:
    """The model, one generation at a time in arrival order (asyncio's lock wakes its waiters first come,
    first served) on one worker thread, with at most ``max_queue`` requests waiting behind the one running.
    With ``batch`` > 1 a greedy request takes the greedy requests waiting with it (up to ``batch``, oldest
    first) into one batched generation (:meth:`greedy`)."""

    def __init__(self, backend, max_queue: int, batch: int = 1):
        self.backend, self.max_queue, self.batch, self.admitted = backend, max_queue, batch, 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="longsft-model")
        self._lock: asyncio.Lock | None = None
        self.waiting: list[tuple[list[int], int, asyncio.Future]] = []  # greedy requests not yet generated

    def admit(self) -> Callable[[], None]:
        """Count a request in, or refuse it (503) when ``max_queue`` already wait. Returns the call that counts
        it out (once, however often it is called)."""
        if self.admitted > self.max_queue:  # one generating, max_queue waiting
            raise RequestError(503, f"the server is busy (a request generating and {self.max_queue} waiting); "
                                    "retry shortly")
        self.admitted += 1
        done = []

        def leave() -> None:
            if not done:
                done.append(True)
                self.admitted -= 1

        return leave

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # made in the serving loop
            self._lock = asyncio.Lock()
        return self._lock

    async def run(self, fn):
        """``fn()`` on the model's thread, after every request admitted before this one."""
        async with self.lock:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def greedy(self, ids: list[int], max_tokens: int):
        """The greedy reply to ``ids``. With ``batch`` > 1: queued, and whoever holds the model next takes the
        oldest ``batch`` queued into one batch (:meth:`_generate_queued`); a request whose reply another's
        batch made returns without waiting for the model again."""
        if self.batch <= 1:
            return await self.run(lambda: self.backend.generate_ids(ids, max_tokens))
        mine = asyncio.get_running_loop().create_future()
        self.waiting.append((ids, max_tokens, mine))
        while not mine.done():
            turn = asyncio.ensure_future(self.lock.acquire())
            await asyncio.wait({mine, turn}, return_when=asyncio.FIRST_COMPLETED)
            if not turn.done():
                turn.cancel()  # (a cancelled acquire that was already granted passes the lock on)
                break
            try:
                await self._generate_queued(mine)
            finally:
                self.lock.release()
            if not mine.done() and all(f is not mine for *_, f in self.waiting):
                break  # in a batch still running, whose holder was cancelled: its end settles this one
        return await mine

    async def _generate_queued(self, mine: asyncio.Future) -> None:
        """Batches of the oldest ``batch`` queued requests until ``mine`` is among those made (the lock is
        first come, first served, so it is in the first unless requests ahead of it were given up). Each
        batch's replies reach their requests when it ends, even if this one's task is cancelled meanwhile."""
        loop = asyncio.get_running_loop()
        while not mine.done() and self.waiting:
            take, self.waiting = self.waiting[:self.batch], self.waiting[self.batch:]
            job = loop.run_in_executor(self.pool, self._batch, [t[0] for t in take], [t[1] for t in take])
            job.add_done_callback(lambda j, take=take: _settle(j, [t[2] for t in take]))
            await asyncio.shield(job)

    def _batch(self, prompts: list[list[int]], max_tokens: list[int]) -> list:
        """One batched generation; out of GPU memory, the same requests one at a time."""
        import torch

        try:
            return self.backend.generate_batch(prompts, max_tokens)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return [self.backend.generate_ids(p, m) for p, m in zip(prompts, max_tokens)]


def _settle(job: asyncio.Future, futures: list[asyncio.Future]) -> None:
    """Each request's reply (or the batch's error) from a finished batch."""
    error = job.exception() if not job.cancelled() else asyncio.CancelledError()
    for k, f in enumerate(futures):
        if not f.done():
            f.set_exception(error) if error is not None else f.set_result(job.result()[k])


def _json(status: int, obj: dict, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(obj, status, headers={"Connection": "close", **(headers or {})})


def _error(e: RequestError):
    return _json(e.status, e.body(), {"Retry-After": "1"} if e.status == 503 else
                 ({"WWW-Authenticate": "Bearer"} if e.status == 401 else None))


class App:
    """The routes, over one backend (:class:`~longsft.eval.backends.HFBackend`: ``encode_chat``,
    ``encode_text``, ``generate_ids``, ``decode``)."""

    def __init__(self, cfg: ServeConfig, backend):
        import time

        self.cfg, self.backend, self.name = cfg, backend, served_name(cfg)
        self.api_key = api_key(cfg)
        self.model = ModelQueue(backend, cfg.max_queue, cfg.batch)
        self.created = int(time.time())

    def asgi(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        async def http_error(request, exc: HTTPException):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return _json(exc.status_code, error_body(exc.status_code, f"no route {request.method} {request.url.path}",
                                                     code=code), dict(exc.headers or {}))

        async def crashed(request, exc: Exception):
            traceback.print_exception(exc)
            return _json(500, error_body(500, "the server failed; see its log"))

        routes = [Route("/health", self.health, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: crashed})

    def _authorize(self, request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if self.api_key and not (scheme.lower() == "bearer" and
                                 hmac.compare_digest(token.strip().encode(), self.api_key.encode())):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    async def health(self, request):
        return _json(200, {"status": "ok"})

    async def models(self, request):
        try:
            self._authorize(request)
        except RequestError as e:
            return _error(e)
        return _json(200, {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                       "owned_by": "longsft"}]})

    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _generate(self, request, chat: bool):
        try:
            self._authorize(request)
            body = await read_body(request, self.cfg)
            parse = parse_chat if chat else parse_completion
            req = parse(body, self.cfg.max_new_tokens, self.cfg.temperature)
            ids = self._encode(req)
            leave = self.model.admit()
        except RequestError as e:
            return _error(e)
        reply = Reply(self.name, chat)
        if req.stream:
            from starlette.responses import StreamingResponse

            events = self._stream(req, ids, reply, leave)
            weakref.finalize(events, leave)  # a stream never started (the client left at once) counts out too
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "Connection": "close"})
        try:
            if req.temperature == 0:
                g = await self.model.greedy(ids, req.max_tokens)
            else:
                g = await self.model.run(lambda: self.backend.generate_ids(ids, req.max_tokens, req.temperature,
                                                                           req.top_p, req.seed))
        except Exception:  # the model failed (out of memory, a bug): say so and keep serving
            traceback.print_exc()
            return _json(500, error_body(500, "generation failed; see the server's log"))
        finally:
            leave()
        return _json(200, reply.whole(g.text, g.finish_reason, g.prompt_tokens, g.gen_tokens))

    def _encode(self, req: Request) -> list[int]:
        try:
            ids = (self.backend.encode_chat(req.messages, self.cfg.enable_thinking) if req.messages is not None
                   else self.backend.encode_text(req.prompt))
        except Exception as e:  # the template's own checks (jinja raise_exception): the client's messages
            raise RequestError(400, f"the chat template rejected the messages: {e}", "messages") from None
        context = self.backend.context
        if context and len(ids) + req.max_tokens > context:
            raise RequestError(400, f"this model's context is {context} tokens; the prompt takes {len(ids)} "
                                    f"and max_tokens asks for {req.max_tokens}", "messages" if req.messages else
                               "prompt", "context_length_exceeded")
        return ids

    async def _stream(self, req: Request, ids: list[int], reply: Reply, leave: Callable[[], None]):
        """Server-sent events: a chunk per piece of new text (whole characters), the finish reason, the usage
        if asked, ``[DONE]``. The client going away (the task cancelled) stops the generation."""
        loop, tokens, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def work():
            return self.backend.generate_ids(ids, req.max_tokens, req.temperature, req.top_p, req.seed,
                                             on_token=lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t),
                                             should_stop=stop.is_set)

        try:
            async with self.model.lock:
                job = asyncio.ensure_future(loop.run_in_executor(self.model.pool, work))
                if reply.chat:
                    yield event(reply.chunk(first=True))
                made, sent = [], ""
                while not (job.done() and tokens.empty()):
                    nxt = asyncio.ensure_future(tokens.get())
                    await asyncio.wait({nxt, job}, return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():
                        nxt.cancel()
                        continue
                    made.append(nxt.result())
                    text = self.backend.decode(made)
                    if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                        yield event(reply.chunk(text[len(sent):]))
                        sent = text
                try:
                    g = job.result()
                except Exception:
                    traceback.print_exc()
                    yield event(error_body(500, "generation failed; see the server's log"))
                    return
                rest = g.text[len(sent):] if g.text.startswith(sent) else ""
                yield event(reply.chunk(rest or None, finish_reason=g.finish_reason))
                if req.include_usage:
                    yield event(reply.chunk(usage=Reply.usage(g.prompt_tokens, g.gen_tokens)))
                yield "data: [DONE]\n\n"
        finally:
            stop.set()
            leave()


def build(cfg: ServeConfig, backend=None) -> Server:
    """Check the model's files (unless ``backend`` is given), bind, warn about an exposed host, load the model.
    A missing or cut-off model is refused before the port is taken, as ``eval`` refuses it."""
    cfg.validate()
    if backend is None:
        model_cfg = model_config(EvalConfig(model=cfg.model, tokenizer=cfg.tokenizer, recipe=cfg.recipe))
        check_model(cfg.model, "hf", gguf_file=model_cfg.gguf_file)
    server = Server(cfg)
    try:
        if not server.loopback:
            port = server.server_address[1]
            risk = ("requests need the API key, but traffic is plain HTTP (use a TLS proxy or an SSH tunnel)"
                    if api_key(cfg) else f"there is no API key, so anyone who reaches port {port} can use the "
                                         f"model (set ${API_KEY_ENV}, or api_key=)")
            print(f"longsft serve: warning: {server.server_address[0]} is reachable from other machines; {risk}",
                  file=sys.stderr, flush=True)
        if backend is None:
            backend = HFBackend(model_cfg, cfg.max_new_tokens, enable_thinking=cfg.enable_thinking, dtype=cfg.dtype)
        server.start(App(cfg, backend))
    except BaseException:
        server.server_close()
        raise
    return server


def serve_help() -> str:
    return config_help(ServeConfig, __doc__.split("\n\n", 2)[1])


def serve(argv: list[str]) -> int:
    cfg = from_args(ServeConfig, argv, "model=PATH port=8000")
    server = build(cfg)
    print(f"longsft serve: {server.app.name} on {server.url} (max_tokens <= {cfg.max_new_tokens}, "
          f"body <= {cfg.max_body_bytes} bytes, timeout {cfg.timeout:g}s, queue {cfg.max_queue})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        server.server_close()
    return 0
