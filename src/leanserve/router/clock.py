"""The router's added latency for one request: what counts, and what does not.

Router time is the wall time from the moment the ASGI app is called with the request (uvicorn
has read its head) to the moment the response head is handed to uvicorn for the client, minus
the time spent waiting on backends. Waiting on a backend runs from the first byte of a request
being written to the backend's connection (httpcore's ``send_request_headers`` starting) to that
backend's response head being parsed (``receive_response_headers`` complete). So:

- a relayed request: (request received -> first byte written upstream)
  + (upstream response head parsed -> response head to the client);
- the disaggregated flow adds (prefill head parsed -> decode request's first byte written):
  reading and parsing the prefill answer and building the decode request.

Included: reading the client's body, picking a backend, building the request, a TCP connect on
a pool miss and a connect-time retry. Not included: uvicorn's parse of the request head before
the app runs, h11's parse of the upstream head (tens of microseconds), kernel time, and what
follows the response head (the body is relayed chunk by chunk as it arrives, with no
buffering). ``latency_bench`` measures end to end, all of that included.
"""

from __future__ import annotations

from time import perf_counter


class Clock:
    __slots__ = ("_since", "_total")

    def __init__(self) -> None:
        self._since: float | None = perf_counter()  # None while waiting on a backend
        self._total = 0.0

    async def trace(self, event: str, info: dict) -> None:
        """httpcore's ``trace`` extension: called at each step of an upstream exchange."""
        if event == "http11.send_request_headers.started":
            self._pause()
        elif event == "http11.receive_response_headers.complete":
            self._since = perf_counter()

    def _pause(self) -> None:
        if self._since is not None:
            self._total += perf_counter() - self._since
            self._since = None

    def stop(self) -> float:
        """Seconds of router time so far; call once, when the response head has gone out."""
        self._pause()
        return self._total
