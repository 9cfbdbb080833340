"""Backends per role, their counters, and the policies that pick one.

A ``Backend``'s fields are the one home of its state: the health task writes ``up``, requests
write the counters, and /metrics reads them at scrape time (nothing is mirrored). Everything
runs on the router's one event loop, so plain ints need no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx


@dataclass(eq=False)
class Backend:
    url: str  # http://host:port, no trailing slash
    role: str  # "backend" (aggregated), "prefill" or "decode"
    up: bool = False  # until the first health check says otherwise
    in_flight: int = 0  # requests sent here through this router and not yet finished
    requests: int = 0  # requests sent here (a connect-time retry counts on both backends)
    errors: int = 0  # requests that got no HTTP answer, broke mid-answer, or got a 5xx
    _urls: dict[str, httpx.URL] = field(default_factory=dict, repr=False)

    def url_for(self, path: str) -> httpx.URL:
        # Parsed once per path (a handful of routes): httpx.URL() costs ~10 us per request.
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.url + path)
        return url


class Pool:
    """One role's backends and the policy that picks among those that are up.

    round_robin: the next backend that is up after the previous pick. least_loaded: the fewest
    requests in flight through this router, ties broken round robin (so an idle pool still
    spreads its load). Both are O(backends) per pick.
    """

    def __init__(self, role: str, urls: tuple[str, ...], policy: str):
        self.role = role
        self.backends = [Backend(u.rstrip("/"), role) for u in urls]
        self._least_loaded = policy == "least_loaded"
        self._next = 0  # where the round-robin scan starts

    @property
    def any_up(self) -> bool:
        return any(b.up for b in self.backends)

    def pick(self, exclude: Backend | None = None) -> Backend | None:
        """A backend that is up (not ``exclude``), or None when there is none."""
        n = len(self.backends)
        best, best_at = None, 0
        for k in range(n):
            at = (self._next + k) % n
            b = self.backends[at]
            if not b.up or b is exclude:
                continue
            if not self._least_loaded:
                best, best_at = b, at
                break
            if best is None or b.in_flight < best.in_flight:
                best, best_at = b, at
        if best is not None:
            self._next = (best_at + 1) % n
        return best
