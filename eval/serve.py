"""``longsft serve``: an OpenAI-compatible chat endpoint over one HF model, bounded against bad clients.

    longsft serve model=runs/tiny/stages/s4k/best [tokenizer=qwen] [port=8000] [host=127.0.0.1]
        [max_new_tokens=512] [temperature=0] [served_model_name=NAME] [api_key=KEY | $LONGSFT_API_KEY]
        [max_body_bytes=8388608] [timeout=30] [workers=8] [max_queue=64] [max_pending=128]

Scope: ``POST /v1/chat/completions`` (the whole conversation through the tokenizer's chat template;
``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``; no streaming, tools,
``stop`` or ``n`` > 1), ``GET /v1/models`` and ``GET /health`` (no key needed). For checkpoints without a
serving stack and for the tests of the ``openai`` backend; for throughput use vLLM or SGLang. Unlike
OpenAI's: a request without ``temperature`` gets the server's (0: greedy), its ``model`` is not checked,
and each connection carries one request (``Connection: close``).

Limits, each a key: a body over ``max_body_bytes`` gets 413 unread; ``max_tokens`` over
``max_new_tokens`` gets 400 (refused, not clamped: a silently shortened answer would skew an
evaluation); a request must arrive in full within ``timeout`` seconds; a connection that sends nothing
holds no thread and is closed after ``timeout`` (or sooner, oldest first, beyond ``max_pending``); at
most ``workers`` threads read and answer requests and ``max_queue`` ready ones wait for them, beyond
which a request gets 503. Every error is JSON in OpenAI's shape. The model generates one request at a
time, in arrival order, so a request waits at most for those ahead of it, each bounded by
``max_new_tokens``: that cap is the fairness guarantee (there is no batching or preemption).
A missing or cut-off model, and a port in use, are reported (exit 2) before the model loads; a host other
than loopback is warned about.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import math
import os
import queue
import selectors
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any, Literal

from longsft.eval.backends import HFBackend
from longsft.eval.harness import EvalConfig, check_model, model_config
from longsft.train.common.errors import ConfigError
from longsft.train.config.help import config_help
from longsft.train.config.loader import from_args

API_KEY_ENV = "LONGSFT_API_KEY"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
    timeout: float = 30.0  # seconds: to send a whole request; to send nothing before being dropped; per write
    workers: int = 8  # threads reading, waiting for the model and answering: the server's thread bound
    max_queue: int = 64  # requests ready while every worker is busy (a socket each, no thread); beyond: 503
    max_pending: int = 128  # open connections that sent nothing yet; beyond: the oldest is closed

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("model= is required (longsft serve model=PATH)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in 0..65535 (0: any free port)")
        for key in ("max_new_tokens", "max_body_bytes", "workers", "max_queue", "max_pending"):
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


# ---------------------------------------------------------------------------------------------------------
# Requests


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
class ChatRequest:
    messages: list[dict]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None


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


def parse_chat(body: bytes, cfg: ServeConfig) -> ChatRequest:
    """A ``/chat/completions`` body -> :class:`ChatRequest`; anything malformed -> ``RequestError(400)``."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(obj).__name__}")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}].role must be one of {sorted(ROLES)}", f"messages[{i}].role")
        messages.append({"role": ROLES[m["role"]], "content": _content(m.get("content"), i)})
    if obj.get("stream"):
        raise RequestError(400, "stream=true is not supported by longsft serve", "stream")
    if obj.get("n") not in (None, 1):
        raise RequestError(400, "only n=1 is supported", "n")
    if obj.get("tools"):
        raise RequestError(400, "tools are not supported by longsft serve", "tools")
    if obj.get("stop"):
        raise RequestError(400, "stop sequences are not supported by longsft serve", "stop")
    key = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = obj.get(key)
    if max_tokens is None:
        max_tokens = cfg.max_new_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(400, f"{key} must be a positive integer, got {max_tokens!r}", key)
    elif max_tokens > cfg.max_new_tokens:
        raise RequestError(400, f"{key}={max_tokens} is over this server's limit of {cfg.max_new_tokens} "
                                f"(longsft serve max_new_tokens=)", key)
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise RequestError(400, f"seed must be a non-negative integer, got {seed!r}", "seed")
    return ChatRequest(messages, max_tokens, _number(obj, "temperature", cfg.temperature, 0, 2),
                       _number(obj, "top_p", 1.0, 0, 1, lo_open=True), seed)


# ---------------------------------------------------------------------------------------------------------
# The model


class FifoLock:
    """A lock granted in arrival order (``threading.Lock`` is not fair): no request waits behind later ones."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class App:
    """Chat completions on one HF model (:class:`~longsft.eval.backends.HFBackend`), one at a time in
    arrival order (the backend's ``encode_chat`` / ``generate_ids``)."""

    def __init__(self, cfg: ServeConfig, backend):
        self.cfg, self.backend, self.name = cfg, backend, served_name(cfg)
        self.api_key = api_key(cfg)
        self.gate = FifoLock()  # the model
        self.created = int(time.time())

    def complete(self, body: bytes) -> dict:
        req = parse_chat(body, self.cfg)
        try:
            ids = self.backend.encode_chat(req.messages, self.cfg.enable_thinking)
        except Exception as e:  # the template's own checks (jinja raise_exception): the client's messages
            raise RequestError(400, f"the chat template rejected the messages: {e}", "messages") from None
        context = self.backend.context
        if context and len(ids) + req.max_tokens > context:
            raise RequestError(400, f"this model's context is {context} tokens; the messages take {len(ids)} "
                                    f"and max_tokens asks for {req.max_tokens}", "messages", "context_length_exceeded")
        with self.gate:
            g = self.backend.generate_ids(ids, req.max_tokens, req.temperature, req.top_p, req.seed)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name,
                "choices": [{"index": 0, "finish_reason": g.finish_reason,
                             "message": {"role": "assistant", "content": g.text}}],
                "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.gen_tokens,
                          "total_tokens": g.prompt_tokens + g.gen_tokens}}


# ---------------------------------------------------------------------------------------------------------
# HTTP


class Handler(BaseHTTPRequestHandler):
    """One request per connection; every answer is JSON and closes the connection."""

    protocol_version = "HTTP/1.1"  # for Expect: 100-continue (refuse a large body before it is sent)
    default_request_version = "HTTP/1.0"  # a garbled request line still gets a status line
    server: Server
    _length: int | None = None

    def version_string(self) -> str:
        return "longsft-serve"

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def log_message(self, format, *args) -> None:
        pass

    def send_error(self, code, message=None, explain=None) -> None:  # the base class's own (bad request line...)
        self._send(code, error_body(code, message or HTTPStatus(code).phrase))

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client is gone or stopped reading
            pass

    def _route(self) -> str:
        path = self.path.split("?", 1)[0].rstrip("/")
        return path[3:] if path.startswith("/v1/") else path

    def _authorized(self) -> bool:
        key = self.server.app.api_key
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if not key or (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())):
            return True
        self._send(401, error_body(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                   code="invalid_api_key"))
        return False

    def _admit(self) -> bool:
        """Route, key and Content-Length, checked before a byte of the body is read."""
        if self._route() != "/chat/completions":
            self._send(404, error_body(404, f"no route POST {self.path}", code="not_found"))
            return False
        if not self._authorized():
            return False
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None:
            self._send(411, error_body(411, "send the body with a Content-Length (chunked bodies are not read)"))
            return False
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self._send(400, error_body(400, f"Content-Length {length!r} is not a byte count"))
            return False
        if n > self.server.cfg.max_body_bytes:
            self._send(413, error_body(413, f"the body is {n} bytes; this server takes at most "
                                            f"{self.server.cfg.max_body_bytes} (longsft serve max_body_bytes=)"))
            self._drain()
            return False
        self._length = n
        return True

    def _drain(self) -> None:
        """Read and drop what the client still sends, briefly, so that it reads our error instead of a reset."""
        deadline = time.monotonic() + min(2.0, self.server.cfg.timeout)
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            while time.monotonic() < deadline and self.connection.recv(1 << 16):
                pass
        except OSError:
            pass

    def handle_expect_100(self) -> bool:
        if self.command == "POST" and not self._admit():
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        route = self._route()
        if route == "/health":
            return self._send(200, {"status": "ok"})
        if not self._authorized():
            return
        if route == "/models":
            app = self.server.app
            return self._send(200, {"object": "list", "data": [{"id": app.name, "object": "model",
                                                                "created": app.created, "owned_by": "longsft"}]})
        self._send(404, error_body(404, f"no route GET {self.path}", code="not_found"))

    def do_POST(self) -> None:
        if self._length is None and not self._admit():
            return
        try:
            body = self.rfile.read(self._length)
        except OSError:  # timed out or cut off at the deadline: the client is too slow or gone
            return self._send(408, error_body(408, f"the request did not arrive within {self.server.cfg.timeout}s"))
        self.server.read_done(self.connection)
        if len(body) < self._length:
            return self._send(400, error_body(400, "the body is shorter than its Content-Length"))
        try:
            status, reply = 200, self.server.app.complete(body)
        except RequestError as e:
            status, reply = e.status, e.body()
        except Exception:  # the model failed (out of memory, a bug): say so and keep serving
            traceback.print_exc()
            status, reply = 500, error_body(500, "generation failed; see the server's log")
        self._send(status, reply)


class Server(HTTPServer):
    """Accepts on one thread and hands a connection to one of ``workers`` threads once its request arrives.

    A connection that sends nothing costs a file descriptor, not a thread; a request that has not arrived
    ``timeout`` seconds after its first byte is cut off; ready requests beyond ``max_queue`` get 503.
    Binds in the constructor, so that a port in use is known before the model loads.
    """

    request_queue_size = 128  # the listen backlog

    def __init__(self, cfg: ServeConfig):
        self.cfg, self.app = cfg, None
        if ":" in cfg.host:
            self.address_family = socket.AF_INET6
        try:
            super().__init__((cfg.host, cfg.port), Handler)
        except OSError as e:
            raise ConfigError(_bind_message(cfg, e)) from None
        self._ready: queue.Queue = queue.Queue(cfg.max_queue)
        self._reading: dict[socket.socket, float] = {}  # connection -> when its request must have arrived
        self._guard = threading.Lock()
        self._stop, self._stopped = threading.Event(), threading.Event()
        self._workers: list[threading.Thread] = []

    def server_bind(self) -> None:
        TCPServer.server_bind(self)  # not HTTPServer's: its getfqdn can wait on DNS
        self.server_name, self.server_port = self.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(str(self.server_address[0]).split("%")[0]).is_loopback
        except ValueError:
            return False

    def start(self, app: App) -> None:
        """Start the workers (the dispatcher is :meth:`serve_forever`)."""
        self.app = app
        for i in range(self.cfg.workers):
            t = threading.Thread(target=self._work, name=f"longsft-serve-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        self.socket.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[float, Any]] = {}  # sent nothing yet, oldest first
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept(sel, pending)
                    else:
                        sel.unregister(key.fileobj)
                        self._dispatch(key.fileobj, pending.pop(key.fileobj)[1])
                self._expire(sel, pending)
        finally:
            for sock in pending:
                sock.close()
            sel.close()
            self._stopped.set()

    def stop(self) -> None:
        """Ask the dispatcher and the workers to end (a worker ends after its current request)."""
        self._stop.set()

    def shutdown(self) -> None:
        self.stop()
        self._stopped.wait()
        for t in self._workers:
            t.join(timeout=5)

    def read_done(self, sock: socket.socket) -> None:
        with self._guard:
            self._reading.pop(sock, None)

    def _accept(self, sel, pending: dict) -> None:
        try:
            sock, addr = self.socket.accept()
        except OSError:  # gone already, or out of file descriptors: try again at the next wake-up
            return
        if len(pending) >= self.cfg.max_pending:
            oldest = next(iter(pending))
            sel.unregister(oldest)
            del pending[oldest]
            oldest.close()
        pending[sock] = (time.monotonic(), addr)
        sel.register(sock, selectors.EVENT_READ)

    def _expire(self, sel, pending: dict) -> None:
        now = time.monotonic()
        for sock, (t, _) in list(pending.items()):
            if now - t < self.cfg.timeout:
                break
            sel.unregister(sock)
            del pending[sock]
            sock.close()
        with self._guard:
            late = [s for s, t in self._reading.items() if now > t]
            for sock in late:
                del self._reading[sock]
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the worker blocked reading it
                except OSError:
                    pass

    def _dispatch(self, sock: socket.socket, addr) -> None:
        try:
            self._ready.put_nowait((sock, addr))
        except queue.Full:
            self._refuse(sock)

    def _refuse(self, sock: socket.socket) -> None:
        """503 at once, from the dispatcher: it must not block (the request is already in the buffer)."""
        data = json.dumps(error_body(503, f"the server is busy ({self.cfg.workers} workers and "
                                          f"{self.cfg.max_queue} queued requests); retry shortly")).encode()
        try:
            sock.setblocking(False)
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass
        try:
            sock.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._ready.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                sock.settimeout(self.cfg.timeout)
                with self._guard:
                    self._reading[sock] = time.monotonic() + self.cfg.timeout
                self.finish_request(sock, addr)
            except Exception:  # a bug in a request: log it, keep the worker
                traceback.print_exc()
            finally:
                self.read_done(sock)
                self.shutdown_request(sock)


def _bind_message(cfg: ServeConfig, e: OSError) -> str:
    where = f"{cfg.host}:{cfg.port}"
    if e.errno == errno.EADDRINUSE:
        return f"port {cfg.port} on {cfg.host} is already in use (another server?); choose another with port="
    if e.errno == errno.EACCES:
        return f"not allowed to listen on {where} ({e.strerror}; ports below 1024 need privileges)"
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"host={cfg.host}: not an address of this machine ({e.strerror or e})"
    return f"cannot listen on {where}: {e.strerror or e}"


# ---------------------------------------------------------------------------------------------------------
# Entry points


def build(cfg: ServeConfig, backend=None) -> Server:
    """Check the model's files (unless ``backend`` is given), bind, warn about an exposed host, load the model
    and start the workers. A missing or cut-off model is refused before the port is taken, as ``eval`` refuses it."""
    cfg.validate()
    if backend is None:
        model_cfg = model_config(EvalConfig(model=cfg.model, tokenizer=cfg.tokenizer, recipe=cfg.recipe))
        check_model(cfg.model, "hf", gguf_file=model_cfg.gguf_file)
    server = Server(cfg)
    try:
        app_key = api_key(cfg)
        if not server.loopback:
            port = server.server_address[1]
            risk = ("requests need the API key, but traffic is plain HTTP (use a TLS proxy or an SSH tunnel)" if app_key
                    else f"there is no API key, so anyone who reaches port {port} can use the model "
                         f"(set ${API_KEY_ENV}, or api_key=)")
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
          f"body <= {cfg.max_body_bytes} bytes, timeout {cfg.timeout:g}s, {cfg.workers} workers)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        server.server_close()
    return 0
