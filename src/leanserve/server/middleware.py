"""The one ASGI middleware in front of every route: API key, request-body size, the count of
OpenAI API requests in progress, and the last line of defence for errors.

It is plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which runs the route in a task
of its own and hides the client's ``http.disconnect`` from it; the routes here wait for that
message to abort a request whose client left.
"""

from __future__ import annotations

import logging
import uuid

from starlette.exceptions import HTTPException

from .protocol import error_response

log = logging.getLogger("leanserve.server")


class BodyTooLarge(HTTPException):
    """Raised while the body is read; an HTTPException so the framework's body parsing passes it
    on as is (it turns other exceptions into a 400) to the app's HTTPException handler."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body exceeds {limit} bytes (the server's --max-request-body-bytes)")


class Gatekeeper:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, in_progress):
        """``in_progress``: a Prometheus gauge of /v1/ requests being served."""
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.in_progress = in_progress

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1/"):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                return await error_response(401, "Invalid or missing API key.")(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            e = BodyTooLarge(self.max_body_bytes)
            return await error_response(e.status_code, e.detail)(scope, receive, send)

        received = 0
        started = False

        async def counting_receive():
            # Chunked bodies declare no length: count what arrives.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        counted = scope["path"].startswith("/v1/")
        if counted:
            self.in_progress.inc()
        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception:  # noqa: BLE001 - any handler bug: a 500 in OpenAI's shape, logged once
            request_id = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
            log.exception("unhandled error in %s %s (request %s)", scope["method"], scope["path"], request_id)
            if not started:
                await error_response(500, f"internal server error (request {request_id}); see the server log")(
                    scope, receive, send)
        finally:
            if counted:
                self.in_progress.dec()
