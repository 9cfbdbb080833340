"""Prometheus metrics, vLLM's names under a ``leanserve:`` prefix, each with a model_name label.

Request latencies (TTFT, inter-token, end-to-end) are observed here in the API process, where
tokens reach clients. Engine figures arrive in the engine's stats snapshots: gauges and
counters are read from the latest snapshot at scrape time; queue times and the per-iteration
host step / forward times are observed into histograms as snapshots arrive.
One registry per server (no global state).
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.stats import FIELDS, IterationStats
from ..engine.messages import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_HOST, _FORWARD = FIELDS.index("host_step_ms"), FIELDS.index("forward_ms")
_CONTEXT, _GENERATION = FIELDS.index("num_context_tokens"), FIELDS.index("num_generation_requests")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.latest: EngineStats | None = None
        # The engine's iteration rows, mirrored here so /stats can summarise any window of them.
        self.iterations = IterationStats(capacity=1 << 16)
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(f"leanserve:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first scheduling.", _LATENCY_BUCKETS)
        self.host_step = hist("iteration_host_step_time_seconds",
                              "Host wall time of one executor iteration (top to bottom of the loop body).",
                              _STEP_BUCKETS)
        self.forward = hist("iteration_forward_time_seconds", "Model forward time of one iteration.", _STEP_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per iteration.",
                                     (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self._success = Counter("leanserve:request_success_total", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def on_engine_stats(self, s: EngineStats) -> None:
        self.latest = s
        for q in s.queue_times:
            self.queue.observe(q)
        rows = np.frombuffer(s.iterations, np.float64).reshape(-1, len(FIELDS))
        for row in rows:
            self.iterations.append(row)
        for host, fwd, ctx, gen in rows[:, [_HOST, _FORWARD, _CONTEXT, _GENERATION]].tolist():
            self.host_step.observe(host / 1e3)
            self.forward.observe(fwd / 1e3)
            self.iteration_tokens.observe(ctx + gen)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        s, name = self.m.latest, self.m.model_name
        if s is None:
            return

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(f"leanserve:{metric}", doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(f"leanserve:{metric}", doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                    s.kv_blocks_used / max(1, s.kv_blocks_total))
        yield counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens_total)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries_total)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits_total)
        yield counter("num_preemptions", "Requests preempted (blocks freed, recomputed later).", s.preemptions_total)
