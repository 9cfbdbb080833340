"""The engine-core process: the executor loop and nothing else.

Three threads, each with one job (and its own ZeroMQ sockets; see ``endpoints`` for their layout):
  * input:  receive and decode Add/Abort messages from every API process, enqueue them (O(1)
            per request);
  * main:   build the EngineCore, then EngineCore.step() while there is work (the thread that
            loaded the model runs its forwards: see EngineLoop);
  * output: encode each iteration's StepOutput and send it to every API process; send a stats
            snapshot every 0.5 s, which is also the heartbeat the API processes watch; and act
            as the hang detector: when one iteration has run longer than the watchdog timeout,
            log the loop thread's stack (once per stall), so the log shows where it is stuck.
No JSON, tokenization or detokenization ever runs here. If the loop itself raises (a bug outside
the per-iteration error handling), the process logs it and exits non-zero: every API process then
fails its pending requests at once.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback

import msgspec
import numpy as np
import zmq

from .config import ResolvedConfig
from .core import EngineCore, EngineLoop
from .messages import (STATS_PERIOD_S, Abort, Add, EngineStats, FromEngine, KVTransferStats, Ready, Rejected, Step,
                       ToEngine)

log = logging.getLogger("leanserve.engine")


def run_engine_process(config: ResolvedConfig, eos_token_ids: list[int], in_addrs: list[str], out_addrs: list[str],
                       parent_pid: int | None, watchdog_timeout: float) -> None:
    """``in_addrs`` / ``out_addrs``: one per API process (``endpoints.EngineEndpoints``);
    ``parent_pid``: the launcher, this process's parent; None in a Ray actor (``ray_engines``),
    which is outside the launcher's process group and which Ray ends with the launcher."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    if parent_pid is not None:
        # Ctrl-C reaches the whole process group; the launcher stops the engines itself, after
        # the API processes have drained their requests.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    core = EngineCore.from_config(config, eos_token_ids)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    ctx = zmq.Context()
    threading.Thread(target=_input_thread, args=(ctx, in_addrs, core, outbox), daemon=True,
                     name="leanserve-input").start()
    loop = EngineLoop(core, lambda out: outbox.put(Step(out)))
    outbox.put(Ready(core.max_model_len, core.vocab_size, core.kv.pool.num_blocks))
    # Start-up allocations are permanent: keep them out of the collector's generations so
    # GC pauses in the loop stay short (vLLM does the same).
    gc.collect()
    gc.freeze()
    threading.Thread(target=_output_thread, args=(ctx, out_addrs, loop, outbox, parent_pid, watchdog_timeout),
                     daemon=True, name="leanserve-output").start()
    try:
        loop.run()
    except BaseException:  # noqa: BLE001 - logged, then the process ends for the API to see
        log.critical("the engine loop crashed:\n%s", traceback.format_exc())
        _drain(outbox)
        logging.shutdown()
        os._exit(1)


def _drain(outbox: queue.SimpleQueue, timeout: float = 1.0) -> None:
    """Lets the output thread send what the loop emitted last (a failed step's errors, which say
    why), so the API sees it before the process ends: waits for the queue to empty, then for
    ZeroMQ's I/O thread to write it out (a local socket takes well under the margin)."""
    deadline = time.monotonic() + timeout
    while not outbox.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


def _input_thread(ctx: zmq.Context, addrs: list[str], core: EngineCore, outbox: queue.SimpleQueue) -> None:
    sock = ctx.socket(zmq.PULL)
    for addr in addrs:  # one PULL for every API process: ZeroMQ queues fairly among them
        sock.connect(addr)
    decoder = msgspec.msgpack.Decoder(ToEngine)
    while True:
        frames = sock.recv_multipart(copy=False)
        msg = decoder.decode(frames[0].buffer)
        if isinstance(msg, Add):
            prompt = np.frombuffer(frames[1].buffer, np.int32)  # zero-copy view of the frame
            try:
                core.enqueue(msg, prompt)
            except ValueError as e:
                outbox.put(Rejected(msg.request_id, str(e)))
        elif isinstance(msg, Abort):
            core.abort(msg.request_ids)


def _output_thread(ctx, addrs: list[str], loop: EngineLoop, outbox: queue.SimpleQueue, parent_pid: int | None,
                   watchdog_timeout: float) -> None:
    socks = [ctx.socket(zmq.PUSH) for _ in addrs]
    for sock, addr in zip(socks, addrs):
        sock.connect(addr)

    def send(buf: bytearray) -> None:
        # Every message goes to every API process, which keeps its own rows (messages.demux):
        # splitting steps by owner here would cost the engine more than a second copy of a
        # few kB costs (bench/results/api_server.md).
        for sock in socks:
            sock.send(buf, copy=True)

    encoder = msgspec.msgpack.Encoder()
    buf = bytearray()
    last_stats = time.monotonic()
    stats_seen = 0
    dumped_for = None  # the stalled iteration whose stack was logged
    while True:
        try:
            msg: FromEngine = outbox.get(timeout=STATS_PERIOD_S)
            encoder.encode_into(msg, buf)  # one reused buffer, no allocation per message
            send(buf)
        except queue.Empty:
            pass
        now = time.monotonic()
        if now - last_stats >= STATS_PERIOD_S:
            if parent_pid not in (None, os.getppid()):  # the launcher is gone: do not linger as an orphan
                os._exit(0)
            started = loop.step_started
            step_s = now - started if started is not None else 0.0
            if step_s > watchdog_timeout and dumped_for != started:
                dumped_for = started
                _log_stack(loop, step_s)
            snapshot, stats_seen = _snapshot(loop.core, stats_seen, step_s)
            encoder.encode_into(snapshot, buf)
            send(buf)
            last_stats = now


def _log_stack(loop: EngineLoop, step_s: float) -> None:
    frame = sys._current_frames().get(loop.thread_id)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the loop thread is gone)\n"
    log.error("hang detector: the current iteration has run for %.1f s; the loop thread is at:\n%s",
              step_s, stack)


def _snapshot(core: EngineCore, seen: int, current_step_s: float) -> tuple[EngineStats, int]:
    rows = core.stats.since(seen)
    sch, pool = core.scheduler, core.kv.pool
    queue_times = []
    while sch.queue_times:
        queue_times.append(sch.queue_times.popleft())
    return EngineStats(
        num_running=len(sch.running),
        num_waiting=len(sch.waiting) + core.num_queued,
        kv_blocks_used=pool.num_used,
        kv_blocks_total=pool.num_blocks - 1,
        prompt_tokens_total=sch.prompt_tokens_total,
        generation_tokens_total=sch.generation_tokens_total,
        prefix_queries_total=sch.prefix_queries,
        prefix_hits_total=sch.prefix_hits,
        preemptions_total=sch.num_preemptions,
        iterations=np.ascontiguousarray(rows).tobytes(),
        queue_times=queue_times,
        current_step_s=current_step_s,
        kv_transfer=None if core.connector is None else _kv_snapshot(core),
    ), core.stats.count


def _kv_snapshot(core: EngineCore) -> KVTransferStats:
    c = core.connector.counters
    times = []
    while c.durations:
        times.append(c.durations.popleft())
    return KVTransferStats(
        transfers_started=c.loads_started, transfers_completed=c.loads_completed, transfers_failed=c.loads_failed,
        received_bytes=c.bytes_received, sent_bytes=c.bytes_sent, leases_created=c.leases_created,
        leases_expired=core.connector.leases.expired_total, leases_held=core.connector.leases.num_held,
        num_waiting_for_kv=len(core.scheduler.receiving), transfer_times=times,
    )
