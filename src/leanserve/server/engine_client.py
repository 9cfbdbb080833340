"""The API process's handle on the engine-core process.

Spawns the engine process, sends it requests (prompt as a raw int32 frame) and aborts, and
reads its per-iteration outputs in one asyncio task, demultiplexing rows to per-request queues.
A watchdog notices if the engine process dies: pending requests fail at once and ``dead``
turns /health to 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import time

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from ..engine.client import TokenEvent, demux
from ..engine.config import EngineConfig
from ..engine.params import SamplingParams
from ..engine.request import FinishReason
from .engine_proc import run_engine_process
from .messages import Abort, Add, EngineStats, FromEngine, Ready, Rejected, Step

log = logging.getLogger("leanserve.server")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, eos_token_ids: list[int], on_stats=None):
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.on_stats = on_stats  # callback(EngineStats)
        self.dead = False
        self.ready: Ready | None = None
        self.latest_stats: EngineStats | None = None
        self._ids = itertools.count()
        self._queues: dict[int, tuple[asyncio.Queue, int]] = {}  # engine id -> (queue, sample index)
        self._tasks: list[asyncio.Task] = []
        self._proc: multiprocessing.Process | None = None
        self._encoder = msgspec.msgpack.Encoder()

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float = 600.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="leanserve-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.bind(in_addr)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(
            target=run_engine_process, name="leanserve-engine", daemon=True,
            args=(self.config, list(self.eos_token_ids), in_addr, out_addr, os.getpid()),
        )
        self._proc.start()
        decoder = msgspec.msgpack.Decoder(FromEngine)
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError("the engine process did not become ready in time")
            if await self._from_engine.poll(200):
                msg = decoder.decode(await self._from_engine.recv())
                if isinstance(msg, Ready):
                    self.ready = msg
        self._tasks = [asyncio.create_task(self._read_outputs(decoder)), asyncio.create_task(self._watchdog())]

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: np.ndarray, params: SamplingParams) -> tuple[list[int], asyncio.Queue]:
        """Sends a request; returns its engine ids (one per sample) and the queue its events arrive on
        as (sample index, TokenEvent)."""
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        base = next(self._ids)
        for _ in range(params.n - 1):
            next(self._ids)
        ids = [base + i for i in range(params.n)]
        q: asyncio.Queue = asyncio.Queue()
        for i, rid in enumerate(ids):
            self._queues[rid] = (q, i)
        header = self._encoder.encode(Add(base, params, time.monotonic()))
        # The prompt frame is the array's own buffer: no copy on this side either.
        self._to_engine.send_multipart([header, memoryview(np.ascontiguousarray(prompt, np.int32))], copy=False)
        return ids, q

    def abort(self, ids: list[int]) -> None:
        live = [i for i in ids if i in self._queues]
        for i in live:
            self._queues.pop(i, None)
        if live and not self.dead:
            self._to_engine.send_multipart([self._encoder.encode(Abort(live))])

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    # ------------------------------------------------------------------ background tasks
    async def _read_outputs(self, decoder) -> None:
        sock, queues = self._from_engine, self._queues
        while True:
            msg = decoder.decode(await sock.recv())
            if isinstance(msg, Step):
                for rid, ev in demux(msg.out):
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

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if not self._proc.is_alive():
                self.dead = True
                log.error("the engine process died (exit code %s); failing pending requests", self._proc.exitcode)
                for q, i in list(self._queues.values()):
                    q.put_nowait((i, TokenEvent(-1, FinishReason.ERROR, error="the engine process died")))
                self._queues.clear()
                return
