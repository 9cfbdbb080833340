"""The async client: an API process's handle on one engine-core process (started by the
launcher, ``launch.EngineProcesses``; reached through ``endpoints.EngineEndpoints``).

Sends the engine requests (prompt as a raw int32 frame) and aborts, and reads its per-iteration
outputs in one asyncio task, demultiplexing the rows this client holds to per-request queues.

What can go wrong, and what each pending request then sees (nothing ever waits silently):
  * one request's output cannot be read: that request fails (see ``demux``), no other;
  * the output reader task dies, or the engine process exits (a pidfd tells at once, in every
    API process; for a Ray actor, the launcher's ``Exited`` message as soon as Ray reports the
    death): every pending request fails with the reason, ``failure`` is set and /health answers
    503 from then on;
  * the engine stops making progress (no message for ``watchdog_timeout`` seconds, e.g. the
    process is frozen, or one iteration has run that long; the engine logs its loop's stack
    then): ``stalled`` is set and /health answers 503 until it moves again;
  * shutdown: ``drain`` lets pending requests finish up to a deadline, then ends the rest with
    finish reason "abort".
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from .endpoints import EngineEndpoints
from .kv_transfer.messages import RemotePrefill
from .messages import (STATS_PERIOD_S, Abort, Add, EngineStats, Exited, FromEngine, Ready, Rejected, RequestIds,
                       Step, TokenEvent, demux)
from .params import SamplingParams
from .request import FinishReason

log = logging.getLogger("leanserve.server")

SHUTTING_DOWN = "the server is shutting down"
WATCHDOG_PERIOD_S = 0.5  # how often the progress check runs
# Silence shorter than this is normal: snapshots leave every 0.5-1 s (the output thread checks the
# clock when its queue wait times out), so a heartbeat counts as missed only well after that.
MIN_SILENCE_S = 4 * STATS_PERIOD_S
LAST_WORDS_S = 0.02  # from an engine's exit to failing its requests (see _on_exit)


class EngineDeadError(RuntimeError):
    pass


class EngineOverloaded(RuntimeError):
    pass


class AsyncEngineClient:
    def __init__(self, endpoints: EngineEndpoints, engine_index: int = 0, client_index: int = 0, on_stats=None,
                 max_pending: int = 1024, watchdog_timeout: float = 60.0):
        """``engine_index``: this engine's place among data-parallel ones (see :mod:`.dp_client`);
        ``client_index``: this API process's among several; both are in the request ids."""
        self.endpoints = endpoints
        self.engine_index, self.client_index = engine_index, client_index
        self.on_stats = on_stats  # callback(EngineStats)
        self.max_pending = max_pending  # sequences in flight (running + queued) admitted at once
        self.watchdog_timeout = watchdog_timeout
        self.failure: str | None = None  # why the engine can no longer serve; final
        self.stalled: str | None = None  # why the engine looks stuck now; clears when it moves
        self.draining = False
        self.ready: Ready | None = None
        self.latest_stats: EngineStats | None = None
        self._last_heard = time.monotonic()
        self._ids = RequestIds(engine_index, client_index)
        # With several API processes every one receives each step whole and keeps its own rows
        # (~15 us a step here); alone, every row is its own.
        self._owner = self._ids if endpoints.num_clients > 1 else None
        self._queues: dict[int, tuple[asyncio.Queue, int]] = {}  # engine id -> (queue, sample index)
        self._tasks: list[asyncio.Task] = []
        self._pidfd: int | None = None
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def unavailable(self) -> str | None:
        """Why /health should answer 503 now (None: healthy)."""
        return self.failure or self.stalled or (SHUTTING_DOWN if self.draining else None)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = 600.0) -> None:
        """Binds this client's two sockets and waits for the engine's ``Ready``."""
        k, c = self.engine_index, self.client_index
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.bind(self.endpoints.requests(k, c))
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(self.endpoints.outputs(k, c))
        if self.endpoints.engine_pids:  # else a Ray actor's: its death comes as Exited
            self._watch_process(self.endpoints.engine_pids[k])
        decoder = msgspec.msgpack.Decoder(FromEngine)
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if self.failure is not None:
                raise EngineDeadError(f"{self.failure} during start-up")
            if time.monotonic() > deadline:
                raise EngineDeadError("the engine process did not become ready in time")
            if await self._from_engine.poll(200):
                msg = decoder.decode(await self._from_engine.recv())
                if isinstance(msg, Ready):
                    self.ready = msg
                elif isinstance(msg, Exited):
                    self._fail(msg.reason)
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._read_outputs(decoder), name="engine output reader"),
                       asyncio.create_task(self._watchdog(), name="engine watchdog")]
        for t in self._tasks:
            t.add_done_callback(self._on_task_done)

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: new requests are refused (503) from now on; pending ones get up to
        ``timeout`` seconds to finish, then end with finish reason "abort"."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._queues:
            log.warning("shutdown: ending %d unfinished request(s) after %.1f s of draining",
                        len(self._queues), timeout)
            self._end_all(FinishReason.ABORT, None)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        # Wait for the tasks to leave their socket calls before the sockets go away.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: np.ndarray, params: SamplingParams, do_remote_decode: bool = False,
               remote_prefill: RemotePrefill | None = None) -> tuple[list[int], asyncio.Queue]:
        """Sends a request; returns its engine ids (one per sample) and the queue its events arrive on
        as (sample index, TokenEvent). Either everything is registered and sent, or nothing is.
        ``do_remote_decode``, ``remote_prefill``: disaggregated serving (``EngineCore.add_request``)."""
        self.check_admission(params.n)
        base = self._ids.take(params.n)
        add = Add(base, params, time.monotonic(), do_remote_decode, remote_prefill)
        header = self._encoder.encode(add)  # may raise: nothing held yet
        ids = [base + i for i in range(params.n)]
        q: asyncio.Queue = asyncio.Queue()
        for i, rid in enumerate(ids):
            self._queues[rid] = (q, i)
        # The prompt frame is the array's own buffer: no copy on this side either.
        self._to_engine.send_multipart([header, memoryview(np.ascontiguousarray(prompt, np.int32))], copy=False)
        return ids, q

    def check_admission(self, n: int) -> None:
        """Raises unless ``n`` more sequences can be admitted now."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self.draining:
            raise EngineDeadError(SHUTTING_DOWN)
        if len(self._queues) + n > self.max_pending:
            raise EngineOverloaded(f"server overloaded: more than {self.max_pending} sequences in flight; retry later")

    def abort(self, ids: list[int]) -> None:
        """Stops the given requests and forgets them. The engine is told even about ids this side
        has already dropped (e.g. a row that could not be read): it ignores ids it does not hold."""
        for i in ids:
            self._queues.pop(i, None)
        if ids and self.failure is None:
            self._to_engine.send_multipart([self._encoder.encode(Abort(list(ids)))])

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    # ------------------------------------------------------------------ background tasks
    async def _read_outputs(self, decoder) -> None:
        sock, queues = self._from_engine, self._queues
        while True:
            msg = decoder.decode(await sock.recv())
            self._last_heard = time.monotonic()
            if isinstance(msg, Step):
                for rid, ev in demux(msg.out, self._owner):
                    entry = queues.get(rid)
                    if entry is None:
                        continue  # aborted by us already
                    entry[0].put_nowait((entry[1], ev))
                    if ev.finish_reason != FinishReason.NONE:
                        del queues[rid]
            elif isinstance(msg, EngineStats):
                self.latest_stats = msg
                if self.on_stats is not None:
                    self.on_stats(msg)
            elif isinstance(msg, Rejected):
                n = 0
                while (entry := queues.pop(msg.request_id + n, None)) is not None:
                    entry[0].put_nowait((entry[1], TokenEvent(-1, FinishReason.ERROR, error=msg.error)))
                    n += 1
            elif isinstance(msg, Exited):
                self._on_exit(msg.reason)

    def _watch_process(self, pid: int) -> None:
        """Fails everything the moment the engine process exits: its pidfd turns readable then,
        whoever its parent is (with several API processes, the launcher is)."""
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fail(f"the engine process died (pid {pid})")
            return
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_process_exit, pid)

    def _on_process_exit(self, pid: int) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._on_exit(f"the engine process died ({exit_status(self._pidfd, pid)})")

    def _on_exit(self, reason: str) -> None:
        # What the engine sent last (a failed step's errors, e.g. naming a dead tensor-parallel
        # rank) left it before it exited (process._drain), but may wait unread in this socket,
        # ready in the same turn of the loop as the pidfd (or behind the launcher's Exited): the
        # reader delivers it first, so those requests end with their own reason rather than this one.
        asyncio.get_running_loop().call_later(LAST_WORDS_S, self._fail, reason)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            self._check_progress()

    def _check_progress(self) -> None:
        # The engine sends a stats snapshot every half second whatever it is doing, and says in
        # it how long its current iteration has been running.
        silent = time.monotonic() - self._last_heard
        step = self.latest_stats.current_step_s if self.latest_stats is not None else 0.0
        if silent > max(self.watchdog_timeout, MIN_SILENCE_S):
            why = f"no message from the engine process for {silent:.1f} s"
        elif step > self.watchdog_timeout:
            why = f"one engine iteration has run for {step:.1f} s (its stack is in the engine's log)"
        else:
            why = None
        if why and not self.stalled:
            log.error("engine stalled: %s; /health answers 503", why)
        elif self.stalled and not why:
            log.warning("engine moving again after a stall (%s)", self.stalled)
        self.stalled = why

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self.failure is not None:
            return
        exc = task.exception()
        reason = f"{task.get_name()} failed: {exc!r}" if exc else f"{task.get_name()} ended"
        log.error("%s", reason, exc_info=exc)
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        """The engine can no longer serve: fail every pending request at once, turn /health 503."""
        self.failure = reason
        log.error("%s; failing %d pending request(s)", reason, len(self._queues))
        self._end_all(FinishReason.ERROR, reason)

    def _end_all(self, reason: FinishReason, error: str | None) -> None:
        ids = list(self._queues)
        for q, i in self._queues.values():
            q.put_nowait((i, TokenEvent(-1, reason, error=error)))
        self._queues.clear()
        if reason == FinishReason.ABORT and ids:
            self._to_engine.send_multipart([self._encoder.encode(Abort(ids))])


def exit_status(pidfd: int, pid: int) -> str:
    """"pid P, exit code C" where this process is the exited one's parent (with one API process
    it is also the launcher); "pid P" elsewhere (the launcher logs the code)."""
    try:  # WNOWAIT: the child stays for its reaper (multiprocessing's join)
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return f"pid {pid}"
    code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
    return f"pid {pid}, exit code {code}"
