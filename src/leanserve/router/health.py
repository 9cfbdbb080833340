"""The background task that takes failing backends out of rotation and puts them back.

Every interval each backend's /health is asked once (all at once, each bounded by the
interval): 200 puts it in rotation, anything else (503 while its engine is stuck or it drains,
a refused connection, a timeout) takes it out. Requests also take a backend out at once when
they cannot connect to it (``upstream``); only this task puts one back.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from .pool import Backend
from .transport import Transport, timeouts

log = logging.getLogger("leanserve.router")


async def check_all(transport: Transport, backends: list[Backend], timeout_s: float) -> None:
    await asyncio.gather(*(_check(transport, b, timeout_s) for b in backends))


async def poll_forever(transport: Transport, backends: list[Backend], interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await check_all(transport, backends, interval_s)


async def _check(transport: Transport, b: Backend, timeout_s: float) -> None:
    request = httpx.Request("GET", b.url_for("/health"), extensions={"timeout": timeouts(timeout_s, timeout_s)})
    try:
        r = await transport.handle_async_request(request)
        try:
            await r.aread()
        finally:
            await r.aclose()
        up, why = r.status_code == 200, f"/health answered {r.status_code}"
    except httpx.HTTPError as e:
        up, why = False, repr(e)
    if up and not b.up:
        log.info("%s backend %s is up: in rotation", b.role, b.url)
    elif b.up and not up:
        log.warning("%s backend %s is down (%s): out of rotation", b.role, b.url, why)
    b.up = up
