"""Prometheus metrics, vLLM's names under a ``leanserve:`` prefix, each with a model_name label.

Request latencies (TTFT, inter-token, end-to-end) are observed here in the API process, where
tokens reach clients. Engine figures arrive in the engines' stats snapshots and carry an
``engine`` label (vLLM's, one value per data-parallel engine): gauges and counters are read from
each engine's latest snapshot at scrape time; queue times and the per-iteration host step /
forward times are observed into histograms as snapshots arrive.
One registry per server (no global state).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.stats import FIELDS, IterationStats
from ..engine.messages import EngineStats, KVTransferStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_HOST, _FORWARD = FIELDS.index("host_step_ms"), FIELDS.index("forward_ms")
_CONTEXT, _GENERATION = FIELDS.index("num_context_tokens"), FIELDS.index("num_generation_requests")
_WAITING_FOR_KV = FIELDS.index("num_waiting_for_kv")


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1, kv_transfer: bool = False):
        """``kv_transfer``: the engines hand off or receive KV (disaggregated serving)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.latest: list[EngineStats | None] = [None] * num_engines  # by engine index
        # Every engine's iteration rows, mirrored here so /stats can summarise any window of them.
        self.iterations = IterationStats(capacity=1 << 16)
        engines = [str(k) for k in range(num_engines)]

        def hist(name, doc, buckets):
            return Histogram(f"leanserve:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        def engine_hist(name, doc, buckets):  # one child per engine, by index
            h = Histogram(f"leanserve:{name}", doc, ["model_name", "engine"], buckets=buckets, registry=self.registry)
            return [h.labels(model_name, k) for k in engines]

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue = engine_hist("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                 _LATENCY_BUCKETS)
        self.host_step = engine_hist("iteration_host_step_time_seconds",
                                     "Host wall time of one executor iteration (top to bottom of the loop body).",
                                     _STEP_BUCKETS)
        self.forward = engine_hist("iteration_forward_time_seconds", "Model forward time of one iteration.",
                                   _STEP_BUCKETS)
        self.iteration_tokens = engine_hist("iteration_tokens_total", "Tokens computed per iteration.",
                                            (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self._success = Counter("leanserve:request_success_total", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.kv_transfer_time = self.host_step_kv_pending = None
        # The latest transfer times themselves (seconds), for /stats: benchmarks take percentiles.
        self.kv_transfer_times: deque[float] = deque(maxlen=1 << 16)
        if kv_transfer:
            self.kv_transfer_time = engine_hist("kv_transfer_time_seconds",
                                                "KV transfer time into this worker: pull sent to blocks written.",
                                                _TRANSFER_BUCKETS)
            # The iterations a decode worker ran while transfers were in flight: compared with
            # iteration_host_step_time_seconds, what receiving KV costs the loop (issue 13: nothing).
            self.host_step_kv_pending = engine_hist("iteration_host_step_time_kv_pending_seconds",
                                                    "Host step time of iterations while requests waited for KV.",
                                                    _STEP_BUCKETS)
        self.registry.register(_EngineCollector(self))

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def on_engine_stats(self, engine: int, s: EngineStats) -> None:
        self.latest[engine] = s
        queue, host_step, forward, tokens = (self.queue[engine], self.host_step[engine], self.forward[engine],
                                             self.iteration_tokens[engine])
        for q in s.queue_times:
            queue.observe(q)
        rows = np.frombuffer(s.iterations, np.float64).reshape(-1, len(FIELDS))
        for row in rows:
            self.iterations.append(row)
        for host, fwd, ctx, gen, waiting_for_kv in rows[:, [_HOST, _FORWARD, _CONTEXT, _GENERATION,
                                                              _WAITING_FOR_KV]].tolist():
            host_step.observe(host / 1e3)
            forward.observe(fwd / 1e3)
            tokens.observe(ctx + gen)
            if waiting_for_kv and self.host_step_kv_pending is not None:
                self.host_step_kv_pending[engine].observe(host / 1e3)
        if s.kv_transfer is not None and self.kv_transfer_time is not None:
            for t in s.kv_transfer.transfer_times:
                self.kv_transfer_time[engine].observe(t)
            self.kv_transfer_times.extend(s.kv_transfer.transfer_times)

    def engine_totals(self) -> dict:
        """The engines' latest snapshots summed field by field (the longest running iteration for
        ``current_step_s``), and each engine's own under ``engines``; {} before the first."""
        skip = ("iterations", "queue_times", "kv_transfer")
        snaps = [None if s is None else
                 {f: getattr(s, f) for f in s.__struct_fields__ if f not in skip}
                 | ({} if s.kv_transfer is None else {"kv_transfer": _kv_counts(s.kv_transfer)})
                 for s in self.latest]
        live = [s for s in snaps if s is not None]
        if not live:
            return {}
        out = {f: (max if f == "current_step_s" else sum)(s[f] for s in live) for f in live[0] if f != "kv_transfer"}
        if "kv_transfer" in live[0]:
            out["kv_transfer"] = {k: sum(s["kv_transfer"][k] for s in live) for k in live[0]["kv_transfer"]}
        out["engines"] = snaps
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        name = self.m.model_name
        engines = [(str(k), s) for k, s in enumerate(self.m.latest) if s is not None]
        if not engines:
            return

        def family(kind, metric, doc, value_of):
            m = kind(f"leanserve:{metric}", doc, labels=["model_name", "engine"])
            for k, s in engines:
                m.add_metric([name, k], value_of(s))
            return m

        G, C = GaugeMetricFamily, CounterMetricFamily
        yield family(G, "num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        yield family(G, "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        yield family(G, "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                     lambda s: s.kv_blocks_used / max(1, s.kv_blocks_total))
        yield family(C, "prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                     lambda s: s.prompt_tokens_total)
        yield family(C, "generation_tokens", "Generated tokens.", lambda s: s.generation_tokens_total)
        yield family(C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda s: s.prefix_queries_total)
        yield family(C, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_hits_total)
        yield family(C, "num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                     lambda s: s.preemptions_total)
        if self.m.kv_transfer_time is None:
            return
        for kind, metric, doc, field in (
            (C, "kv_transfers_started", "KV transfers this worker started pulling.", "transfers_started"),
            (C, "kv_transfers_completed", "KV transfers whose blocks landed here.", "transfers_completed"),
            (C, "kv_transfers_failed", "KV transfers refused, failed or timed out.", "transfers_failed"),
            (C, "kv_transfer_received_bytes", "KV bytes received from prefill workers.", "received_bytes"),
            (C, "kv_transfer_sent_bytes", "KV bytes sent to decode workers.", "sent_bytes"),
            (C, "kv_leases_created", "Finished prefills whose blocks were kept for a decode worker.", "leases_created"),
            (C, "kv_leases_expired", "Leases no decode worker pulled or released in time.", "leases_expired"),
            (G, "kv_leases", "Finished prefills' blocks kept for decode workers now.", "leases_held"),
            (G, "num_requests_waiting_for_kv", "Requests holding blocks while their prompt's KV arrives.",
             "num_waiting_for_kv"),
        ):
            yield family(kind, metric, doc, lambda s, f=field: getattr(s.kv_transfer, f))


def _kv_counts(kv: KVTransferStats) -> dict:
    return {f: getattr(kv, f) for f in kv.__struct_fields__ if f != "transfer_times"}
