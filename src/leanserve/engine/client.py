"""Clients of the engine core: turn per-iteration StepOutputs into per-request event streams.

``demux`` is shared by the in-process client (offline API, tests) and the API process's client
(server), so both read the engine's batched output the same way.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .core import EngineCore, EngineLoop
from .params import SamplingParams
from .request import FinishReason, StepOutput

log = logging.getLogger("leanserve.engine")


@dataclass
class TokenEvent:
    token_id: int  # -1: no token (abort / error)
    finish_reason: FinishReason
    num_cached_tokens: int = 0
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    error: str | None = None


def demux(out: StepOutput) -> Iterator[tuple[int, TokenEvent]]:
    """One event per row. A row that cannot be read becomes an error event for its own request:
    one request's output never stops the others' (the reader that calls this is shared)."""
    ids, toks, reasons, cached = out.arrays()
    lps = np.frombuffer(out.logprobs, np.float32) if out.logprobs is not None else None
    k = out.top_k
    top_ids = np.frombuffer(out.top_ids, np.int32).reshape(-1, k) if k else None
    top_lps = np.frombuffer(out.top_logprobs, np.float32).reshape(-1, k) if k else None
    for i, rid in enumerate(ids.tolist()):
        try:
            ev = TokenEvent(int(toks[i]), FinishReason(int(reasons[i])), int(cached[i]))
            if lps is not None:
                ev.logprob = float(lps[i])
                if k:
                    ev.top = list(zip(top_ids[i].tolist(), top_lps[i].tolist()))
            if rid in out.prompt_logprobs:
                ev.prompt_logprobs = _prompt_logprobs(*out.prompt_logprobs[rid])
            if rid in out.errors:
                ev.error = out.errors[rid]
        except Exception as e:  # noqa: BLE001 - reported to the one request it concerns
            ev = TokenEvent(-1, FinishReason.ERROR, error=f"could not read the engine's output: {e!r}")
        yield rid, ev


def _prompt_logprobs(lp: bytes, ids: bytes, tlp: bytes, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob per position, top-k ids, top-k logprobs); k may be 0 (``logprobs: 0`` asks for
    the prompt tokens' own logprobs and no alternatives), so rows come from ``lp``, not from k."""
    lp = np.frombuffer(lp, np.float32)
    return lp, np.frombuffer(ids, np.int32).reshape(len(lp), k), np.frombuffer(tlp, np.float32).reshape(len(lp), k)


class RequestStream:
    """Events of one engine request (one sample), in order; ends with a finishing event."""

    def __init__(self, request_id: int):
        self.request_id = request_id
        self.queue: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            ev = self.queue.get()
            yield ev
            if ev.finish_reason != FinishReason.NONE:
                return


class InprocClient:
    """The engine in a thread of this process (offline API and tests).

    ``make_core`` runs on that thread, so the model is loaded on the thread that steps it (see
    :class:`EngineLoop`); its exceptions (a bad model path, a bad config) are raised here. If the
    loop itself dies (a bug outside the per-iteration error handling), every pending stream ends
    with the error and later submits raise: nobody waits on a loop that is gone.
    """

    def __init__(self, make_core: Callable[[], EngineCore]):
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._streams: dict[int, RequestStream] = {}
        self.failure: str | None = None
        built = threading.Event()
        failure: list[BaseException] = []

        def engine_thread() -> None:
            try:
                self.core = make_core()
                self._loop = EngineLoop(self.core, self._dispatch)
            except BaseException as e:  # handed to the constructing thread below
                failure.append(e)
                return
            finally:
                built.set()
            try:
                self._loop.run()
            except BaseException as e:  # noqa: BLE001 - logged, and handed to every waiting stream
                log.critical("the engine loop crashed", exc_info=True)
                self._fail(f"the engine loop crashed: {e!r}")

        self._thread = threading.Thread(target=engine_thread, name="leanserve-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]

    def submit(self, prompt: np.ndarray, params: SamplingParams) -> list[RequestStream]:
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            base = next(self._ids)
            for _ in range(params.n - 1):
                next(self._ids)
            streams = [RequestStream(base + i) for i in range(params.n)]
            for s in streams:
                self._streams[s.request_id] = s
        try:
            self.core.add_request(base, prompt, params)
        except BaseException:
            with self._lock:
                for s in streams:
                    self._streams.pop(s.request_id, None)
            raise
        return streams

    def abort(self, request_ids) -> None:
        self.core.abort(request_ids)

    def _dispatch(self, out: StepOutput) -> None:
        streams = self._streams
        for rid, ev in demux(out):
            s = streams.get(rid)
            if s is None:
                continue
            s.queue.put(ev)
            if ev.finish_reason != FinishReason.NONE:
                with self._lock:
                    del streams[rid]

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.failure = reason
            for s in self._streams.values():
                s.queue.put(TokenEvent(-1, FinishReason.ERROR, error=reason))
            self._streams.clear()

    def shutdown(self) -> None:
        self._loop.stop()
        self._thread.join(timeout=5)
