"""The in-process client: the engine core on a thread of this process (offline API, tests),
its per-iteration StepOutputs turned into per-request event streams by ``messages.demux``, as
the API process's client does with the engine process's."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator

import numpy as np

from .core import EngineCore, EngineLoop
from .params import SamplingParams
from .messages import RequestIds, StepOutput, TokenEvent, demux
from .request import FinishReason

log = logging.getLogger("leanserve.engine")


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
        self._ids = RequestIds()
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
            base = self._ids.take(params.n)
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
        self.core.close()
