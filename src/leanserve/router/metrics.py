"""Prometheus text for the router's /metrics, under the server's ``leanserve:`` prefix.

Per-backend figures are read from the ``Backend`` objects at scrape time (one home for each
counter); only the added-latency histogram is kept here. One registry per router (no global
state).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .pool import Pool

# The goal is < 1 ms p50 (issue 13); buckets resolve 0.1-2 ms finely, and a stalled loop up to 1 s.
_ADDED_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025,
                  0.1, 1.0)


class RouterMetrics:
    def __init__(self, pools: list[Pool]):
        self.registry = CollectorRegistry()
        self.added_latency = Histogram(
            "leanserve:router_added_latency_seconds",
            "Router time per relayed request: request received -> first byte sent upstream, plus upstream "
            "response head parsed -> response head to the client (see leanserve/router/clock.py).",
            buckets=_ADDED_BUCKETS, registry=self.registry)
        self.registry.register(_BackendCollector(pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BackendCollector:
    def __init__(self, pools: list[Pool]):
        self.pools = pools

    def collect(self):
        labels = ["backend", "role"]
        requests = CounterMetricFamily("leanserve:router_requests", "Requests sent to a backend.", labels=labels)
        errors = CounterMetricFamily("leanserve:router_upstream_errors",
                                     "Requests to a backend that got no HTTP answer, broke off mid-answer, or got a "
                                     "5xx.", labels=labels)
        in_flight = GaugeMetricFamily("leanserve:router_requests_in_flight",
                                      "Requests in flight to a backend through this router.", labels=labels)
        up = GaugeMetricFamily("leanserve:router_backend_up", "1 while a backend is in rotation.", labels=labels)
        for pool in self.pools:
            for b in pool.backends:
                key = [b.url, b.role]
                requests.add_metric(key, b.requests)
                errors.add_metric(key, b.errors)
                in_flight.add_metric(key, b.in_flight)
                up.add_metric(key, float(b.up))
        yield from (requests, errors, in_flight, up)
