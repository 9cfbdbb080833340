"""Prometheus metrics, vLLM's names under a ``leanserve:`` prefix, each with a model_name label.

Two kinds, kept apart because they aggregate differently across API processes:

* Request metrics (TTFT, inter-token and end-to-end latency, finished requests, requests in
  progress) are observed here, in the API process where tokens reach clients. With several API
  processes (``--api-server-count``) each sees only its own requests, so they are kept in
  prometheus-client's multiprocess mode (the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` to a
  private directory) and every process exports the sum over all of them; the in-progress gauge
  keeps one series per process (a ``pid`` label) to show how the load is spread.
* Engine metrics arrive in the engines' stats snapshots, which every API process receives
  complete, and carry an ``engine`` label (vLLM's, one value per data-parallel engine): each
  process exports them from its own copy, never through the multiprocess files, which would
  add up one copy per API process. Gauges and counters are read from each engine's latest
  snapshot at scrape time; queue times, per-iteration host step / forward times and (with
  disaggregated serving) KV transfer times are counted into histogram buckets as snapshots
  arrive.
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from ..engine.messages import EngineStats, KVTransferStats
from ..engine.stats import FIELDS, IterationStats

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it when it is imported

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_HOST, _FORWARD = FIELDS.index("host_step_ms"), FIELDS.index("forward_ms")
_CONTEXT, _GENERATION = FIELDS.index("num_context_tokens"), FIELDS.index("num_generation_requests")
_WAITING_FOR_KV = FIELDS.index("num_waiting_for_kv")


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1, kv_transfer: bool = False):
        """``kv_transfer``: the engines hand off or receive KV (disaggregated serving)."""
        self.model_name = model_name
        self.latest: list[EngineStats | None] = [None] * num_engines  # by engine index
        # Every engine's iteration rows, mirrored here so /stats can summarise any window of them.
        self.iterations = IterationStats(capacity=1 << 16)

        self.registry = CollectorRegistry()  # this process's request metrics

        def hist(name, doc):
            return Histogram(f"leanserve:{name}", doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self._success = Counter("leanserve:request_success_total", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.in_progress = Gauge("leanserve:api_requests_in_progress",
                                 "OpenAI API requests (/v1/...) being served (one series per API process).",
                                 ["model_name"], registry=self.registry, multiprocess_mode="all").labels(model_name)

        def per_engine(bounds):
            return [BucketCounts(bounds) for _ in range(num_engines)]

        self.queue = per_engine(_LATENCY_BUCKETS)
        self.host_step = per_engine(_STEP_BUCKETS)
        self.forward = per_engine(_STEP_BUCKETS)
        self.iteration_tokens = per_engine(_TOKEN_BUCKETS)
        self.engine_histograms = (
            ("request_queue_time_seconds", "Time from arrival to first scheduling.", self.queue),
            ("iteration_host_step_time_seconds",
             "Host wall time of one executor iteration (top to bottom of the loop body).", self.host_step),
            ("iteration_forward_time_seconds", "Model forward time of one iteration.", self.forward),
            ("iteration_tokens_total", "Tokens computed per iteration.", self.iteration_tokens),
        )
        self.kv_transfer = kv_transfer
        # The latest transfer times themselves (seconds), for /stats: benchmarks take percentiles.
        self.kv_transfer_times: deque[float] = deque(maxlen=1 << 16)
        if kv_transfer:
            self.kv_transfer_time = per_engine(_TRANSFER_BUCKETS)
            # The iterations a decode worker ran while transfers were in flight: compared with
            # iteration_host_step_time_seconds, what receiving KV costs the loop (issue 13: nothing).
            self.host_step_kv_pending = per_engine(_STEP_BUCKETS)
            self.engine_histograms += (
                ("kv_transfer_time_seconds", "KV transfer time into this worker: pull sent to blocks written.",
                 self.kv_transfer_time),
                ("iteration_host_step_time_kv_pending_seconds",
                 "Host step time of iterations while requests waited for KV.", self.host_step_kv_pending),
            )
        engines = CollectorRegistry()
        engines.register(_EngineCollector(self))
        multiproc_dir = os.environ.get(MULTIPROC_DIR_ENV)
        if multiproc_dir:  # every API process's request metrics, summed
            requests = CollectorRegistry()
            MultiProcessCollector(requests, multiproc_dir)
        else:
            requests = self.registry
        self._exported = (requests, engines)

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def on_engine_stats(self, engine: int, s: EngineStats) -> None:
        self.latest[engine] = s
        rows = np.frombuffer(s.iterations, np.float64).reshape(-1, len(FIELDS))
        for row in rows:
            self.iterations.append(row)
        self.queue[engine].observe(np.asarray(s.queue_times))
        self.host_step[engine].observe(rows[:, _HOST] / 1e3)
        self.forward[engine].observe(rows[:, _FORWARD] / 1e3)
        self.iteration_tokens[engine].observe(rows[:, _CONTEXT] + rows[:, _GENERATION])
        if self.kv_transfer:
            self.host_step_kv_pending[engine].observe(rows[rows[:, _WAITING_FOR_KV] > 0, _HOST] / 1e3)
            if s.kv_transfer is not None:
                times = s.kv_transfer.transfer_times
                self.kv_transfer_time[engine].observe(np.asarray(times))
                self.kv_transfer_times.extend(times)

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
        return b"".join(generate_latest(r) for r in self._exported)


class BucketCounts:
    """A Prometheus histogram kept as numpy bucket counts and filled a batch of values at a time
    (one snapshot's rows: one numpy call, not one ``observe`` per row)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = np.asarray(bounds, np.float64)
        self.counts = np.zeros(len(bounds) + 1, np.int64)  # the last: above every bound
        self.sum = 0.0

    def observe(self, values: np.ndarray) -> None:
        # Bucket i holds bounds[i-1] < v <= bounds[i]: Prometheus' "le".
        self.counts += np.bincount(np.searchsorted(self.bounds, values), minlength=len(self.counts))
        self.sum += float(np.sum(values))

    def buckets(self) -> list[tuple[str, float]]:
        cumulative = np.cumsum(self.counts).tolist()
        return [(floatToGoString(b), c) for b, c in zip(self.bounds.tolist(), cumulative)] + [("+Inf", cumulative[-1])]


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        name = self.m.model_name
        for metric, doc, per_engine in self.m.engine_histograms:
            h = HistogramMetricFamily(f"leanserve:{metric}", doc, labels=["model_name", "engine"])
            for k, counts in enumerate(per_engine):
                h.add_metric([name, str(k)], counts.buckets(), counts.sum)
            yield h
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
        if not self.m.kv_transfer:
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
