"""The router's ASGI app (routes, client disconnects, lifespan) and ``serve()``.

Plain ASGI, not FastAPI: the router's hot path is read the body, pick a backend, send, relay,
and it needs no validation, routing table or response classes. Behind uvicorn on this 2-core
Xeon, a FastAPI route answering a fixed body cost 250-310 us of CPU per request, a plain ASGI
app answering the same 165-175 us (3,000 requests each; ``latency_bench`` measures the router).

Routes: POST /v1/completions and /v1/chat/completions (relayed, or the disaggregated flow),
GET /v1/models (relayed), GET /health (200 while every role has a backend up, else 503),
GET /metrics (the router's own). Errors the router makes itself use the server's OpenAI error
shape; errors from backends pass through as they are.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import msgspec
import uvicorn

from ..server.protocol import error_body, error_type
from . import disagg, health
from .clock import Clock
from .config import RouterConfig
from .metrics import RouterMetrics
from .pool import Pool
from .transport import Transport
from .upstream import Headers, Message, Receive, RelayBroken, Send, Upstream, UpstreamError, forwardable

log = logging.getLogger("leanserve.router")

Work = Callable[[Send], Awaitable[None]]  # a proxied request's handling, given where its answer goes

GENERATE_PATHS = ("/v1/completions", disagg.CHAT_PATH)
# Bounds the router's own memory per request; a leanserve server refuses more than 4 MiB by
# default (413), so any body it could accept fits with room for larger --max-request-body-bytes.
MAX_BODY_BYTES = 64 << 20
# A backend that has not accepted a connection within this is unreachable (loopback and LAN
# connects take well under 1 ms): the request goes to another backend.
CONNECT_TIMEOUT_S = 2.0
# Idle upstream connections are dropped before a leanserve server (uvicorn, 5 s keep-alive)
# drops them, so a request is never written to a connection the server is closing.
KEEPALIVE_EXPIRY_S = 4.0
# On SIGTERM, in-flight requests get this long before their connections are cut (which aborts
# them upstream): a backend's own drain takes up to 5 + 3 s by default.
SHUTDOWN_TIMEOUT_S = 10.0


class RouterApp:
    def __init__(self, cfg: RouterConfig):
        cfg.validate()  # before anything starts: a bad flag is one line
        self.cfg = cfg
        if cfg.disaggregated:
            self.prefill: Pool | None = Pool("prefill", cfg.prefill, cfg.policy)
            self.answering = Pool("decode", cfg.decode, cfg.policy)  # the pool whose answers reach the client
            self.pools = [self.prefill, self.answering]
        else:
            self.prefill = None
            self.answering = Pool("backend", cfg.backends, cfg.policy)
            self.pools = [self.answering]
        self.metrics = RouterMetrics(self.pools)
        self._up: Upstream | None = None  # made at start-up, on the server's event loop
        self._health: asyncio.Task | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Message, receive: Receive, send: Send) -> None:
        clock = Clock()
        path, method = scope["path"], scope["method"]
        if path in GENERATE_PATHS:
            if method != "POST":
                return await send_error(send, 405, f"{path} takes POST")
            try:
                body = await _read_body(receive)
            except _BodyTooLarge:
                return await send_error(send, 413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
            except _ClientGone:
                return
            await self._until_disconnect(self._generate(path, forwardable(scope["headers"]), body, clock),
                                         receive, send)
        elif path == "/v1/models" and method == "GET":
            await self._until_disconnect(
                lambda s: self._up.forward(self.answering, "GET", path, forwardable(scope["headers"]), b"", s, clock),
                receive, send)
        elif path == "/health" and method == "GET":
            down = [p.role for p in self.pools if not p.any_up]
            if down:
                return await send_error(send, 503, f"no {' or '.join(down)} backend is up")
            await _send_whole(send, 200, [], b"")
        elif path == "/metrics" and method == "GET":
            await _send_whole(send, 200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                              self.metrics.render())
        elif path in ("/v1/models", "/health", "/metrics"):
            await send_error(send, 405, f"{path} takes GET")
        else:
            await send_error(send, 404, f"no route {path} on this router")

    def _generate(self, path: str, headers: Headers, body: bytes, clock: Clock) -> Work:
        if self.prefill is not None:
            return lambda send: disagg.run(self._up, self.prefill, self.answering, path, headers, body, send, clock)
        return lambda send: self._up.forward(self.answering, "POST", path, headers, body, send, clock)

    async def _until_disconnect(self, work: Work, receive: Receive, send: Send) -> None:
        """Runs ``work(send)``; a client that disconnects before its response is complete cancels
        it, which closes the upstream connection, so the backend aborts the request."""
        task = asyncio.current_task()
        complete = left = False

        async def tracked_send(message: Message) -> None:
            nonlocal complete
            await send(message)
            complete = message["type"] == "http.response.body" and not message.get("more_body", False)

        async def watch() -> None:
            nonlocal left
            # Past the body (read already, or a GET's empty one) the next message is the
            # disconnect, which uvicorn also reports once the response is complete (then there
            # is nothing to cancel).
            while (await receive())["type"] != "http.disconnect":
                pass
            if not complete:
                left = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await work(tracked_send)
        except asyncio.CancelledError:
            if not left:
                raise
            # The client is gone and this task ends here: nothing to answer, nothing to uncancel.
        except UpstreamError as e:
            log.warning("%s", e)
            await send_error(tracked_send, e.status, str(e))
        except RelayBroken as e:
            # The response head is out: the only way to tell the client is to leave the response
            # incomplete, and uvicorn then closes its connection.
            log.warning("%s; cutting the client's connection", e)
        finally:
            watcher.cancel()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        transport = Transport(KEEPALIVE_EXPIRY_S)
        self._up = Upstream(transport, self.metrics.added_latency, CONNECT_TIMEOUT_S)
        backends = [b for p in self.pools for b in p.backends]
        await health.check_all(transport, backends, self.cfg.health_interval_s)  # /health is right from the start
        self._health = asyncio.create_task(health.poll_forever(transport, backends, self.cfg.health_interval_s))
        roles = "; ".join(f"{p.role}: {', '.join(b.url for b in p.backends)}" for p in self.pools)
        log.info("routing on http://%s:%d (%s, %s)", self.cfg.host, self.cfg.port, self.cfg.policy, roles)
        if down := [b.url for b in backends if not b.up]:
            log.warning("not answering /health yet, out of rotation until they do: %s", ", ".join(down))

    async def _stop(self) -> None:
        self._health.cancel()
        await self._up.transport.aclose()


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        if not chunks and not message.get("more_body", False):
            return chunk  # the usual case: one message, no copy
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_whole(send: Send, status: int, headers: Headers, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, status: int, message: str) -> None:
    body = msgspec.json.encode(error_body(message, error_type(status), None, status))
    await _send_whole(send, status, [(b"content-type", b"application/json")], body)


def serve(cfg: RouterConfig) -> None:
    app = RouterApp(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The backends' Date and Server headers are relayed; uvicorn adding its own would duplicate them.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            lifespan="on", server_header=False, date_header=False,
                            timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S)
    # uvicorn re-raises SIGTERM after its shutdown under the handler found at start; this one
    # ends the process with status 0, as a clean shutdown should.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.Server(config).run()
