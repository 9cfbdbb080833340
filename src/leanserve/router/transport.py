"""The router's pool of HTTP/1.1 keep-alive connections: httpx's transport (its httpcore pool,
h11, exception mapping, models) over asyncio sockets that send a request's head and body in one
write.

Why not ``httpx.AsyncClient``: per request through it, on this 2-core Xeon (user CPU,
keep-alive, a trivial backend, 3,000 requests), ``AsyncClient.send`` took 540 us; httpx's
transport alone 460 us (no auth, redirect, event-hook or cookie-jar layer: the router needs
none, and a cookie jar would be state one client's requests leave for another's); with the
socket layer below instead of anyio's 300 us, and wall time per request 1.24 -> 0.70 ms. The
one write matters as much as the CPU: a head and a body sent apart wake the backend twice.
"""

from __future__ import annotations

import asyncio

import httpcore
import httpx

# Unread upstream bytes past which the socket stops being read, so a slow client slows its
# backend (through TCP) instead of growing the router's memory; reading resumes below a quarter.
_READ_HIGH_WATER = 256 << 10


class Transport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` with the socket layer below. Unlimited connections (a
    backend's own admission limit, a 503, is the one that applies); idle ones kept
    ``keepalive_expiry_s``."""

    def __init__(self, keepalive_expiry_s: float):
        super().__init__(trust_env=False)
        # httpx builds its pool in __init__ and exposes no network_backend: swapped here (every
        # router test goes through this pool).
        self._pool = httpcore.AsyncConnectionPool(max_connections=None, max_keepalive_connections=None,
                                                  keepalive_expiry=keepalive_expiry_s, network_backend=_Backend())


def timeouts(connect: float | None, read: float | None = None) -> dict:
    """A request's ``timeout`` extension (what ``httpx.AsyncClient`` would have set)."""
    return {"connect": connect, "read": read, "write": read, "pool": None}


class _Backend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            # asyncio sets TCP_NODELAY on TCP transports.
            transport, protocol = await asyncio.wait_for(loop.create_connection(_Protocol, host, port), timeout)
        except asyncio.TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection to {host}:{port} within {timeout} s") from None
        except OSError as e:
            raise httpcore.ConnectError(str(e)) from e
        return _Stream(transport, protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False
        self.error: Exception | None = None
        self.readable: asyncio.Future | None = None  # awaited by a read while the buffer is empty
        self.writable: asyncio.Future | None = None  # set while asyncio's write buffer is full
        self.reading_paused = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _READ_HIGH_WATER and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True
        self._wake()

    def eof_received(self) -> None:
        self.eof = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof, self.error = True, exc
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def _wake(self) -> None:
        if self.readable is not None and not self.readable.done():
            self.readable.set_result(None)


class _Stream(httpcore.AsyncNetworkStream):
    """Writes are held until the next read: httpcore writes a request's head, then its body,
    then reads the answer, so each request leaves in one ``send``."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
        self._transport, self._protocol = transport, protocol
        self._pending: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._pending.append(buffer)

    async def _flush(self) -> None:
        if self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self._transport.write(b"".join(self._pending))
        self._pending.clear()
        if self._protocol.writable is not None:
            await self._protocol.writable

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._pending:
            await self._flush()
        p = self._protocol
        while not p.buffer and not p.eof:
            p.readable = asyncio.get_running_loop().create_future()
            try:
                await (p.readable if timeout is None else asyncio.wait_for(p.readable, timeout))
            except asyncio.TimeoutError:
                raise httpcore.ReadTimeout(f"nothing read within {timeout} s") from None
        if not p.buffer:
            if p.error is not None:
                raise httpcore.ReadError(str(p.error))
            return b""
        if len(p.buffer) <= max_bytes:
            data = bytes(p.buffer)
            p.buffer.clear()
        else:
            data = bytes(p.buffer[:max_bytes])
            del p.buffer[:max_bytes]
        if p.reading_paused and len(p.buffer) < _READ_HIGH_WATER // 4:
            self._transport.resume_reading()
            p.reading_paused = False
        return data

    async def aclose(self) -> None:
        # Closing a connection mid-answer is how a backend learns its client left (it aborts).
        self._transport.close()

    def get_extra_info(self, info: str):
        if info == "is_readable":  # asked of idle pooled connections: closed by the server?
            return bool(self._protocol.buffer) or self._protocol.eof
        return self._transport.get_extra_info(info) if info in ("socket", "peername", "sockname") else None
