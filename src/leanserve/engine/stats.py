"""Per-iteration statistics: every loop iteration is measured and kept in a bounded ring buffer.

Host step time follows TensorRT-LLM's ``host_step_time``: wall time from the top of one loop
iteration to the top of the next, i.e. everything the host does (fetch, schedule, input
preparation, forward, sampling, output, GC). Forward time is wall time (``perf_counter``) around
the model call. On CUDA that call only queues kernels; the sampler's copy of its results to the
host waits for them, so there the GPU's forward time shows up in sample time.
"""

from __future__ import annotations

import threading
import time

import numpy as np

FIELDS = (
    "start_time_s",  # when the iteration began, seconds since the epoch: places it among events outside the engine
    "host_step_ms",  # top of this iteration to top of the next
    "forward_ms",
    "fetch_ms",  # draining the inbox (new requests, aborts)
    "schedule_ms",
    "prepare_ms",  # building model inputs
    "broadcast_ms",  # handing them to the other tensor-parallel ranks (0 with one rank)
    "sample_ms",
    "output_ms",  # stop checks, state updates, emitting the step's outputs
    "grammar_ms",  # structured outputs: filling and applying token bitmasks, advancing matchers
    "num_context_tokens",  # prefill tokens in the batch
    "num_generation_requests",  # decode rows in the batch
    "num_running",
    "num_waiting",
    "num_waiting_for_kv",  # requests holding blocks while their prompt's KV arrives (decode worker)
    "kv_blocks_used",
    "num_preemptions",  # preemptions in this iteration
    "num_new_requests",  # requests this iteration's fetch took from the inbox (n samples count once)
)


SUMMARIZED = tuple(f for f in FIELDS if f != "start_time_s")  # what a percentile means for: not a time stamp

PHASES = ("fetch_ms", "schedule_ms", "prepare_ms", "broadcast_ms", "forward_ms", "grammar_ms", "sample_ms",
          "output_ms")


class PhaseClock:
    """An iteration's phases by name: ``lap(name)`` at the end of each adds the milliseconds
    since the previous lap to ``ms[name]`` (``lap()`` skips a span measured elsewhere). Phases
    an iteration never reached stay 0."""

    __slots__ = ("start", "start_time", "_last", "ms")

    def __init__(self):
        self.start_time = time.time()
        self.start = self._last = time.perf_counter()
        self.ms = dict.fromkeys(PHASES, 0.0)

    def lap(self, name: str | None = None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.ms[name] += (now - self._last) * 1e3
        self._last = now

    @property
    def total_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3


class IterationStats:
    """A ring buffer of the last ``capacity`` iterations; thread-safe reads."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._data = np.zeros((capacity, len(FIELDS)), np.float64)
        self._count = 0  # total iterations ever recorded
        self._lock = threading.Lock()
        self.index = {name: i for i, name in enumerate(FIELDS)}

    def record(self, **values: float) -> None:
        """One iteration, every field of FIELDS by name."""
        if len(values) != len(FIELDS):
            raise ValueError(f"stats: missing fields {sorted(set(FIELDS) - set(values))}")
        self.append([values[name] for name in FIELDS])

    def append(self, row) -> None:
        """One iteration as a row in FIELDS order (rows copied from another process's buffer)."""
        with self._lock:
            self._data[self._count % self.capacity] = row
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def window(self, last: int | None = None) -> np.ndarray:
        """The most recent ``last`` rows (all kept rows by default), oldest first."""
        with self._lock:
            n = min(self._count, self.capacity)
            if last is not None:
                n = min(n, last)
            end = self._count % self.capacity
            idx = (np.arange(end - n, end)) % self.capacity
            return self._data[idx].copy()

    def since(self, count: int) -> np.ndarray:
        """Rows recorded after the iteration counter was ``count`` (at most ``capacity``)."""
        return self.window(max(0, self._count - count))

    def column(self, rows: np.ndarray, name: str) -> np.ndarray:
        return rows[:, self.index[name]]

    def summary(self, last: int | None = None) -> dict[str, dict[str, float]]:
        rows = self.window(last)
        out = {"iterations": {"count": float(len(rows))}}
        if not len(rows):
            return out
        for name in SUMMARIZED:
            col = self.column(rows, name)
            p50, p95, p99 = np.percentile(col, [50, 95, 99])
            out[name] = {"mean": float(col.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}
        return out
