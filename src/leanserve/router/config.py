"""The router's settings, checked once at start-up so a bad flag is one line."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

POLICIES = ("round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    backends: tuple[str, ...] = ()  # aggregated replicas (--backend)
    prefill: tuple[str, ...] = ()  # disaggregated: prefill workers (--prefill) ...
    decode: tuple[str, ...] = ()  # ... and decode workers (--decode)
    policy: str = "round_robin"
    # A failed backend is out of rotation within one interval, and back within one after it
    # answers again; each poll is one GET per backend on a kept-alive connection.
    health_interval_s: float = 1.0

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    def validate(self) -> None:
        if bool(self.backends) == bool(self.prefill or self.decode):
            raise ValueError("give either --backend URL..., or --prefill URL... and --decode URL...")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode go together: a disaggregated router needs both roles")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: one of {', '.join(POLICIES)}, got {self.policy!r}")
        for url in (*self.backends, *self.prefill, *self.decode):
            parts = urlsplit(url)
            # Plain HTTP: backends sit on the serving cluster's own network (no TLS in the socket layer).
            if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"backend URL {url!r}: expected http://host:port")
        if self.health_interval_s <= 0:
            raise ValueError("health_interval_s: must be positive")
