"""Sending one request to a backend and relaying its answer to the client.

Bytes are relayed, never re-parsed: the response head as the backend sent it (less hop-by-hop
headers), then each body chunk as it arrives (``aiter_raw``: no decoding, no buffering), so SSE
framing, usage chunks and error objects reach the client exactly as a single server sends them,
4xx and 5xx included. The client's headers, its Authorization (API key) among them, go upstream
unchanged, again less hop-by-hop ones.

A backend that cannot be connected to is taken out of rotation and the request goes once to
another one of its role: nothing has reached a backend then, so a retry cannot run it twice.
Any later failure is the client's: a 502 before the response head, a cut connection after it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Histogram

from .clock import Clock
from .pool import Backend, Pool
from .transport import Transport, timeouts

log = logging.getLogger("leanserve.router")

Headers = list[tuple[bytes, bytes]]
Message = dict[str, Any]  # an ASGI message
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]

# RFC 9110 section 7.6.1's connection-specific headers, plus the two httpx and uvicorn compute
# (host, content-length) for the connection they write to.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                         b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host",
                         b"content-length"})


class UpstreamError(Exception):
    """No backend answered; ``status`` (502 or 503) is what the client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RelayBroken(Exception):
    """The backend's answer broke off after its head had gone to the client."""


def forwardable(headers: Headers) -> Headers:
    """Headers from the client's request (uvicorn gives them lower-cased) minus hop-by-hop ones."""
    return [(k, v) for k, v in headers if k not in _HOP_BY_HOP]


def response_headers(response: httpx.Response) -> Headers:
    # content-length stays: exactly the bytes it counts are relayed.
    return [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP or k.lower() == b"content-length"]


@dataclass
class Upstream:
    """The router's one connection pool and the added-latency histogram it feeds."""

    transport: Transport
    added_latency: Histogram  # observed once per request answered from a backend
    # Only connecting is bounded: a generation takes as long as it takes, and a client that
    # gives up disconnects, which cancels the request here.
    connect_timeout_s: float

    async def open(self, pool: Pool, method: str, path: str, headers: Headers, body: bytes,
                   clock: Clock) -> tuple[Backend, httpx.Response]:
        """Sends to a backend the pool picks; returns once the response head is in. The caller
        must ``close`` the pair. A connect failure marks the backend down and tries another once."""
        failed: Backend | None = None
        for _ in range(2):
            backend = pool.pick(exclude=failed)
            if backend is None:
                break
            backend.requests += 1
            backend.in_flight += 1
            request = httpx.Request(method, backend.url_for(path), headers=headers, content=body,
                                    extensions={"timeout": timeouts(self.connect_timeout_s), "trace": clock.trace})
            try:
                response = await self.transport.handle_async_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self._failed(backend)
                backend.up = False  # until the health task sees it answer again
                log.warning("%s backend %s cannot be reached (%r): out of rotation", pool.role, backend.url, e)
                failed = backend
                continue
            except httpx.HTTPError as e:
                self._failed(backend)
                raise UpstreamError(502, f"{pool.role} backend {backend.url} failed before answering: {e!r}") from None
            except BaseException:  # cancelled: the client left
                backend.in_flight -= 1
                raise
            if response.status_code >= 500:
                backend.errors += 1
            return backend, response
        if failed is not None:
            raise UpstreamError(502, f"no {pool.role} backend could be reached (last tried: {failed.url})")
        raise UpstreamError(503, f"no {pool.role} backend is up")

    @staticmethod
    def _failed(backend: Backend) -> None:
        backend.in_flight -= 1
        backend.errors += 1

    @staticmethod
    async def close(backend: Backend, response: httpx.Response) -> None:
        backend.in_flight -= 1
        # An answer not read to its end closes its connection: the backend sees the client leave
        # and aborts the request (leanserve does within one engine iteration).
        await response.aclose()

    async def fetch(self, pool: Pool, method: str, path: str, headers: Headers, body: bytes,
                    clock: Clock) -> tuple[httpx.Response, bytes]:
        """One whole answer: the response (closed) and its body."""
        backend, response = await self.open(pool, method, path, headers, body, clock)
        try:
            return response, await response.aread()
        except httpx.HTTPError as e:
            backend.errors += 1
            raise UpstreamError(502, f"{pool.role} backend {backend.url} broke off its answer: {e!r}") from None
        finally:
            await self.close(backend, response)

    async def forward(self, pool: Pool, method: str, path: str, headers: Headers, body: bytes, send: Send,
                      clock: Clock) -> None:
        """One request to a backend, its answer relayed to the client chunk by chunk as it comes."""
        backend, response = await self.open(pool, method, path, headers, body, clock)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": response_headers(response)})
            self.added_latency.observe(clock.stop())
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as e:
                backend.errors += 1
                raise RelayBroken(f"{pool.role} backend {backend.url} broke off its answer: {e!r}") from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.close(backend, response)

    async def respond(self, send: Send, status: int, headers: Headers, body: bytes, clock: Clock) -> None:
        """An answer already in hand (the disaggregated flow's prefill answer), sent whole."""
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.added_latency.observe(clock.stop())
        await send({"type": "http.response.body", "body": body, "more_body": False})
