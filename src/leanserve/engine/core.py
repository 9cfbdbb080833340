"""The engine core: the executor loop, one iteration per ``step()``.

An iteration:
  1. fetch   - drain the inbox: new requests (at most ``max_new_requests_per_step``) and aborts;
  2. schedule - running requests first, then chunked prefill of waiting ones, under the token
                budget; allocate KV blocks, preempting the newest request if the pool is dry;
  3. prepare - build the model input from the persistent batch arrays;
  4. forward + sample - one call to the model runner;
  5. output  - append tokens, check stops, free finished requests, emit one StepOutput.

``add_request`` and ``abort`` only append to a deque (O(1), thread-safe, never waits on the
loop); validation is O(1) in the prompt length. A failing iteration fails the requests in it,
never the loop.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Callable

import numpy as np
import torch

from ..model.loader import load_model
from ..model.transformer import Transformer
from .batch_state import BatchState
from .config import EngineConfig, available_memory_bytes
from .kv_cache import KVCache
from .model_runner import ModelRunner, build_model_input
from .params import SamplingParams
from .messages import Abort, Add, StepOutput
from .request import FinishReason, Request
from .scheduler import ScheduledBatch, Scheduler
from .stats import IterationStats, PhaseClock

log = logging.getLogger("leanserve.engine")

# The loop sleeps on ``wakeup`` (set by every enqueue) when idle; the timeout only bounds how
# long a stop() can take to be noticed.
IDLE_WAIT_S = 0.1
# Work exists but nothing is runnable (e.g. every request waits for blocks): yield the GIL
# briefly rather than spin, without adding visible latency.
BLOCKED_WAIT_S = 0.001
# Queue times awaiting the stats thread (drained every 0.5 s): bounded if nobody drains them.
MAX_PENDING_QUEUE_TIMES = 65536


def validate_request(prompt_len: int, params: SamplingParams, max_model_len: int, vocab_size: int,
                     max_logprobs: int) -> None:
    """The checks every request passes before it is queued (also run by the API process, so a
    bad request gets its 400 without a round trip). Raises ValueError naming the field."""
    if prompt_len == 0:
        raise ValueError("prompt: is empty")
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt: {prompt_len} tokens leave no room to generate within max_model_len={max_model_len}")
    params.validate(vocab_size, max_logprobs)
    if prompt_len + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: {params.max_tokens} + {prompt_len} prompt tokens exceeds max_model_len={max_model_len}"
        )


def prompt_from_token_ids(ids, vocab_size: int) -> np.ndarray:
    """Caller-given token ids -> the engine's int32 prompt array, checked (the one conversion, at
    the boundary; an int32 array is checked and kept as is). Raises ValueError naming the field."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32:
        wide = ids
    else:
        try:
            wide = np.asarray(ids, np.int64)
        except (OverflowError, ValueError, TypeError):
            wide = None
    if wide is None or wide.ndim != 1 or (len(wide) and (wide.min() < 0 or wide.max() >= vocab_size)):
        raise ValueError(f"prompt: token ids must be a flat list in [0, {vocab_size})")
    return wide if wide is ids else wide.astype(np.int32)


class EngineCore:
    def __init__(self, config: EngineConfig, model: Transformer | None = None, eos_token_ids=None):
        config.validate()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        if model is None:
            model = load_model(config.model, config.dtype, config.device, config.quantization)
        self.model = model
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.eos_token_ids = sorted(set(mcfg.eos_token_ids) | set(eos_token_ids or ()))

        dtype = self.model.embed_tokens.weight.dtype
        bs = config.block_size
        per_block = KVCache.bytes_per_block(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, bs, dtype)
        if config.kv_cache_memory is not None:
            num_blocks = config.kv_cache_memory // per_block
        else:
            budget = int(config.kv_cache_fraction * available_memory_bytes(config.device))
            enough = config.max_num_seqs * -(-self.max_model_len // bs) + 1
            num_blocks = min(budget // per_block, enough)
        # A request must fit the whole pool, or it would wait for blocks forever.
        capacity = (int(num_blocks) - 1) * bs  # block 0 is the null block
        if self.max_model_len > capacity:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len: {self.max_model_len} tokens do not fit in the KV cache, which holds "
                                 f"{max(capacity, 0)}; raise kv_cache_memory or lower max_model_len")
            log.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more",
                        self.max_model_len, capacity)
            self.max_model_len = capacity
        self.kv = KVCache(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, int(num_blocks), bs, dtype,
                          config.device)
        self.batch = BatchState(config.max_num_seqs, self.max_model_len, bs, self.eos_token_ids)
        self.scheduler = Scheduler(self.batch, self.kv.pool, config.max_num_batched_tokens,
                                   config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.kv, config.device, config.seed)
        self.stats = IterationStats(config.stats_capacity)

        self.requests: dict[int, Request] = {}
        self.generators: dict[int, torch.Generator] = {}
        self._inbox: deque[tuple[Add, np.ndarray] | Abort] = deque()
        self.wakeup = threading.Event()
        # Counters read by the metrics exporter.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.queue_times: deque[float] = deque(maxlen=MAX_PENDING_QUEUE_TIMES)  # seconds, per first admission

    # ------------------------------------------------------------------ boundary (any thread)
    def add_request(self, request_id: int, prompt: np.ndarray, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Enqueues a request; samples of ``n > 1`` get ids ``request_id .. request_id + n - 1``.

        ``prompt`` should be an int32 numpy array: it is held as is, never copied.
        Raises ValueError naming the field; nothing is enqueued then.
        """
        if not isinstance(prompt, np.ndarray) or prompt.dtype != np.int32 or prompt.ndim != 1:
            raise ValueError("prompt: must be a 1-D int32 numpy array of token ids")
        validate_request(len(prompt), params, self.max_model_len, self.vocab_size, self.config.max_logprobs)
        self._inbox.append((Add(request_id, params, arrival_time or time.monotonic()), prompt))
        self.wakeup.set()

    def abort(self, request_ids) -> None:
        self._inbox.append(Abort(list(request_ids)))
        self.wakeup.set()

    @property
    def num_queued(self) -> int:
        """Requests and aborts enqueued but not yet taken by the loop."""
        return len(self._inbox)

    @property
    def has_work(self) -> bool:
        return bool(self._inbox) or bool(self.scheduler.running) or bool(self.scheduler.waiting)

    # ------------------------------------------------------------------ the loop body
    def step(self, emit: Callable[[StepOutput], None]) -> bool:
        """Runs one iteration and emits its output. Returns False when there was nothing to run."""
        clock = PhaseClock()
        aborted = self._fetch()
        if aborted:
            emit(self._finished_output(aborted, FinishReason.ABORT))
        fetch_ms = clock.lap()
        sched = self.scheduler.schedule()
        schedule_ms = clock.lap()
        if sched.empty:
            return bool(aborted)
        forward_ms = sample_ms = prepare_ms = 0.0
        try:
            inp = build_model_input(self.batch, sched, self.generators)
            prepare_ms = clock.lap()
            out = self.runner.execute(inp)
            forward_ms, sample_ms = out.forward_ms, out.sample_ms
            clock.lap()
            step_out = self._update(sched, inp, out)
        except Exception:  # noqa: BLE001 - one bad iteration must not kill the loop
            log.error("iteration failed; failing its requests:\n%s", traceback.format_exc())
            clock.lap()
            step_out = self._fail(sched, traceback.format_exc(limit=1).strip().splitlines()[-1])
        emit(step_out)
        self.stats.record(
            host_step_ms=clock.total_ms, forward_ms=forward_ms, fetch_ms=fetch_ms, schedule_ms=schedule_ms,
            prepare_ms=prepare_ms, sample_ms=sample_ms, output_ms=clock.lap(),
            num_context_tokens=sched.num_prefill_tokens, num_generation_requests=len(sched.decode_slots),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.pool.num_used, num_preemptions=len(sched.preempted),
        )
        return True

    def _fetch(self) -> list[int]:
        """Takes aborts, and at most ``max_new_requests_per_step`` new requests, from the inbox;
        returns the ids it aborted."""
        aborted = []
        added = 0
        inbox = self._inbox
        while inbox:
            item = inbox[0]
            if isinstance(item, Abort):
                inbox.popleft()
                for rid in item.request_ids:
                    req = self.requests.get(rid)
                    if req is not None:
                        self.scheduler.finish(req)
                        self._forget(req)
                        aborted.append(rid)
                continue
            if added >= self.config.max_new_requests_per_step:
                break
            inbox.popleft()
            added += 1
            add, prompt = item
            params, first = add.params, None
            for i in range(params.n):
                seed = None if params.seed is None else params.seed + i
                req = Request(add.request_id + i, prompt, params, seed, prefix_parent=first,
                              arrival_time=add.arrival_time)
                first = first or req
                if seed is not None:
                    self.generators[req.request_id] = torch.Generator(self.runner.device).manual_seed(
                        seed % 2**64)
                self.requests[req.request_id] = req
                self.scheduler.add(req)
        return aborted

    def _update(self, sched: ScheduledBatch, inp, out) -> StepOutput:
        b, sch, bs = self.batch, self.scheduler, self.batch.block_size
        d = sched.decode_slots
        # 1. computed counters and newly full blocks (registered in the prefix cache)
        if len(d):
            b.num_computed[d] += 1  # slots are unique, so fancy-indexed += is exact
            for s in d[b.num_computed[d] % bs == 0]:
                sch.register_full_blocks(b.requests[s], int(b.num_computed[s]) - 1, int(b.num_computed[s]))
        for req, start, n in sched.prefills:
            b.num_computed[req.slot] = start + n
            sch.register_full_blocks(req, start, start + n)
            if start == req.num_cached_tokens and req.num_preemptions == 0:
                self.queue_times.append(req.first_scheduled_time - req.arrival_time)
            self.prompt_tokens_total += n
        # 2. sampled tokens
        ss = inp.sample_slots
        tokens = out.sampled.token_ids.numpy().astype(np.int32)
        n_out = b.num_tokens[ss] - b.num_prompt[ss]
        b.out_tokens[ss, n_out] = tokens
        b.num_tokens[ss] += 1
        b.last_token[ss] = tokens
        self.generation_tokens_total += len(ss)
        # 3. stop checks, vectorised (stop_ids holds EOS too, unless the request ignores it)
        reasons = (b.num_tokens[ss] >= b.stop_len[ss]).astype(np.int8) * np.int8(FinishReason.LENGTH)
        reasons[(b.stop_ids[ss] == tokens[:, None]).any(axis=1)] = FinishReason.STOP
        request_ids = b.request_id[ss].copy()
        cached = b.num_cached[ss]
        done = reasons != 0
        if done.any():
            for req in sch.finish_slots(ss[done]):
                self._forget(req)
        step_out = StepOutput(request_ids.tobytes(), tokens.tobytes(), reasons.tobytes(), cached.tobytes())
        sampled = out.sampled
        if sampled.logprobs is not None:
            step_out.logprobs = sampled.logprobs.numpy().astype(np.float32).tobytes()
            if sampled.top_ids is not None:
                step_out.top_k = sampled.top_ids.shape[1]
                step_out.top_ids = sampled.top_ids.numpy().astype(np.int32).tobytes()
                step_out.top_logprobs = sampled.top_logprobs.numpy().astype(np.float32).tobytes()
        if out.prompt_logprobs:
            step_out.prompt_logprobs = {
                rid: (lp.tobytes(), ids.tobytes(), tlp.tobytes(), ids.shape[1])
                for rid, (lp, ids, tlp) in out.prompt_logprobs.items()
            }
        return step_out

    @staticmethod
    def _finished_output(ids: list[int], reason: FinishReason) -> StepOutput:
        """Rows that end requests without a token (aborts, failures)."""
        k = len(ids)
        return StepOutput(
            np.asarray(ids, np.int64).tobytes(), np.full(k, -1, np.int32).tobytes(),
            np.full(k, reason, np.int8).tobytes(), np.zeros(k, np.int32).tobytes(),
        )

    def _forget(self, req: Request) -> None:
        """The core's own records of a request, dropped once the scheduler has finished it.
        Tolerant: a failing iteration (``_fail``) may reach requests ``_update`` already dropped."""
        self.requests.pop(req.request_id, None)
        self.generators.pop(req.request_id, None)

    def _fail(self, sched: ScheduledBatch, error: str) -> StepOutput:
        reqs = [self.batch.requests[s] for s in sched.decode_slots] + [r for r, _, _ in sched.prefills]
        for req in reqs:
            self.scheduler.finish(req)
            self._forget(req)
        failed = [r.request_id for r in reqs]
        out = self._finished_output(failed, FinishReason.ERROR)
        out.errors = {rid: error for rid in failed}
        return out


class EngineLoop:
    """Iterates an EngineCore while there is work and sleeps on an event otherwise.

    Run it on the thread that built the core (loaded the model). torch's OpenMP keeps one thread
    pool per calling thread; a second pool on the same cores (model loaded on one thread, steps
    run on another) made every op of a batch-1 forward ~2x slower here (45 vs 21 ms): with more
    OpenMP threads than cores, libgomp stops spinning at barriers and sleeps in the kernel instead.
    """

    def __init__(self, core: EngineCore, emit: Callable[[StepOutput], None]):
        self.core = core
        self.emit = emit
        self._stop = False
        # When the iteration in progress began (time.monotonic()), None between iterations: a
        # watchdog on another thread reads it to tell a long iteration from a stuck one.
        self.step_started: float | None = None
        self.thread_id: int | None = None

    def run(self) -> None:
        core = self.core
        self.thread_id = threading.get_ident()
        while not self._stop:
            if not core.has_work:
                core.wakeup.wait(IDLE_WAIT_S)
                core.wakeup.clear()
                continue
            self.step_started = time.monotonic()
            ran = core.step(self.emit)
            self.step_started = None
            if not ran:
                # Work exists but none is runnable now (e.g. waiting for blocks): yield briefly.
                core.wakeup.wait(BLOCKED_WAIT_S)
                core.wakeup.clear()

    def stop(self) -> None:
        """Ends ``run`` after the current iteration (from any thread)."""
        self._stop = True
        self.core.wakeup.set()
