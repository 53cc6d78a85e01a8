"""``longsft serve``'s transport: uvicorn on a socket bound up front, the connection limits (a request's
headers within ``timeout``, at most ``max_pending`` connections waiting for theirs), JSON for the errors the
HTTP layer answers itself, and the request body read within its time and size limits."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import math
import socket
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from longsft.eval.serve_protocol import RequestError, error_body
from longsft.train.common.errors import ConfigError

if TYPE_CHECKING:
    from longsft.eval.serve import App, ServeConfig


async def read_body(request, cfg: ServeConfig) -> bytes:
    """The request's body within ``cfg.timeout`` (408) and ``cfg.max_body_bytes`` (413: refused on its
    Content-Length before it is read; with ``Expect: 100-continue`` before the client sends it)."""
    limit = cfg.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and int(length) > limit:  # h11 has checked that it is a number
        if "100-continue" not in request.headers.get("expect", "").lower():
            await _drain(request, min(2.0, cfg.timeout))  # so that the client reads our answer, not a reset
        raise RequestError(413, f"the body is {length} bytes; this server takes at most {limit} "
                                "(longsft serve max_body_bytes=)")

    async def whole() -> bytes:
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise RequestError(413, f"the body is over {limit} bytes (longsft serve max_body_bytes=)")
            parts.append(chunk)
        return b"".join(parts)

    from starlette.requests import ClientDisconnect

    try:
        return await asyncio.wait_for(whole(), cfg.timeout)
    except TimeoutError:
        raise RequestError(408, f"the request did not arrive within {cfg.timeout:g}s") from None
    except ClientDisconnect:  # cut off (answered 400 by the protocol already) or gone
        raise RequestError(400, "the body is shorter than its Content-Length") from None


async def _drain(request, seconds: float) -> None:
    """Read and drop what the client sends, at most ``seconds``."""
    async def drop():
        async for _ in request.stream():
            pass

    try:
        await asyncio.wait_for(drop(), seconds)
    except (TimeoutError, Exception):
        pass


class ConnectionLimits:
    """Connections whose request has not arrived (oldest first): each closed ``timeout`` seconds after it
    opened, the oldest closed beyond ``max_pending``."""

    def __init__(self, timeout: float, max_pending: int):
        self.timeout, self.max_pending = timeout, max_pending
        self.waiting: OrderedDict = OrderedDict()


def protocol_class(limits: ConnectionLimits):
    """uvicorn's h11 protocol with the connection limits, and JSON for the errors it answers itself (a
    malformed request: 400)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            limits.waiting[self] = self.loop.call_later(limits.timeout, self._too_slow)
            while len(limits.waiting) > limits.max_pending:
                oldest, timer = limits.waiting.popitem(last=False)
                timer.cancel()
                oldest.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self in limits.waiting:  # its headers have arrived
                limits.waiting.pop(self).cancel()

        def connection_lost(self, exc) -> None:
            timer = limits.waiting.pop(self, None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def eof_received(self) -> bool | None:
            """The client has sent all it will (it may still read: a half-close). A whole request is still
            answered; a cut-off one gets its 400 (h11 is told of the end); with nothing sent, close."""
            if self.cycle is None and not self.conn.trailing_data[0]:
                return None
            if self.cycle is None or self.cycle.more_body:
                self.conn.receive_data(b"")
                self.handle_events()
            return True

        def _too_slow(self) -> None:
            limits.waiting.pop(self, None)
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            data = json.dumps(error_body(400, f"malformed HTTP request: {msg}")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=data),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol


class Server:
    """The listening socket (bound at construction: a port in use is known before the model loads) and
    uvicorn serving :class:`App` on it (:meth:`serve_forever`, in any thread; :meth:`shutdown` from another)."""

    def __init__(self, cfg: ServeConfig):
        self.cfg, self.app, self._uvicorn = cfg, None, None
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((cfg.host, cfg.port))
            self.socket.listen(128)
        except OSError as e:
            self.socket.close()
            raise ConfigError(_bind_message(cfg, e)) from None
        self.server_address = self.socket.getsockname()
        self._stopped = threading.Event()

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
        import uvicorn

        self.app = app
        limits = ConnectionLimits(self.cfg.timeout, self.cfg.max_pending)
        config = uvicorn.Config(app.asgi(), http=protocol_class(limits), loop="asyncio", lifespan="off",
                                log_config=None, log_level="error", access_log=False, server_header=False,
                                timeout_keep_alive=max(1, math.ceil(self.cfg.timeout)))
        self._uvicorn = uvicorn.Server(config)

    def serve_forever(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def shutdown(self) -> None:
        self.stop()
        self._stopped.wait(timeout=30)

    def server_close(self) -> None:
        self.socket.close()
        if self.app is not None:
            self.app.model.pool.shutdown(wait=False, cancel_futures=True)


def _bind_message(cfg: ServeConfig, e: OSError) -> str:
    where = f"{cfg.host}:{cfg.port}"
    if e.errno == errno.EADDRINUSE:
        return f"port {cfg.port} on {cfg.host} is already in use (another server?); choose another with port="
    if e.errno == errno.EACCES:
        return f"not allowed to listen on {where} ({e.strerror}; ports below 1024 need privileges)"
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"host={cfg.host}: not an address of this machine ({e.strerror or e})"
    return f"cannot listen on {where}: {e.strerror or e}"
