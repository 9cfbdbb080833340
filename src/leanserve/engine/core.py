"""The engine core: the executor loop, one iteration per ``step()``.

An iteration (``step``):
  1. fetch    - drain the inbox: new requests (at most ``max_new_requests_per_step``) and aborts;
                requests whose grammar has finished compiling join the scheduler;
  2. schedule - running requests first, then chunked prefill of waiting ones, under the token
                budget; allocate KV blocks, preempting the newest request if the pool is dry;
  3. execute  - build the model input from the persistent batch arrays, forward, mask the
                constrained rows' logits (structured outputs), sample;
  4. update   - the scheduler applies the sampled tokens (``update_from_output``: stop checks,
                grammar matchers advanced, finished requests freed); the iteration's one
                StepOutput is returned.
Each phase is timed by name into the per-iteration stats (``stats.FIELDS``).

``add_request`` and ``abort`` only append to a deque (O(1), thread-safe, never waits on the
loop); validation is O(1) in the prompt length. A request with structured outputs also hands
its spec to the grammar compiler's thread there; the loop never compiles. A failing iteration
fails the requests in it, never the loop.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from typing import Callable

import numpy as np
import torch

from ..model.loader import load_model
from ..model.transformer import Transformer
from ..tokenizer import Tokenizer
from .batch_state import BatchState
from .config import EngineConfig, ResolvedConfig, plan_kv_cache
from .distributed.ranks import Ranks, with_rank_threads
from .distributed.runner import TensorParallelRunner
from .kv_cache import KVCache
from .kv_transfer import make_connector
from .model_runner import ExecutorFailed, ModelOutput, ModelRunner, build_model_input
from .messages import Abort, Add, StepOutput
from .params import SamplingParams
from .kv_transfer.messages import RemotePrefill
from .request import Request, Status
from .scheduler import ScheduledBatch, Scheduler
from .stats import IterationStats, PhaseClock
from .structured import GrammarBitmask, GrammarCompiler
from .structured import backend as structured

log = logging.getLogger("leanserve.engine")

# The loop sleeps on ``wakeup`` (set by every enqueue) when idle; the timeout only bounds how
# long a stop() can take to be noticed.
IDLE_WAIT_S = 0.1
# Work exists but nothing is runnable (e.g. every request waits for blocks): yield the GIL
# briefly rather than spin, without adding visible latency.
BLOCKED_WAIT_S = 0.001


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
    def __init__(self, config: EngineConfig, model: Transformer, eos_token_ids=None,
                 tokenizer_path: str | None = None, ranks: Ranks | None = None):
        """Builds KV cache, batch and scheduler around a loaded ``model``; :meth:`from_config` is
        the start-up path (tests and benchmarks also pass models built in memory).
        ``tokenizer_path``: the checkpoint whose tokenizer structured outputs compile grammars
        against (without it, such requests end with an error). ``ranks``: the other
        tensor-parallel ranks, when ``model`` is rank 0's share."""
        config.validate()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.model = model
        self.tokenizer_path = tokenizer_path
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = sorted(set(mcfg.eos_token_ids) | set(eos_token_ids or ()))
        dtype = self.model.embed_tokens.weight.dtype
        num_blocks, self.max_model_len = plan_kv_cache(config, mcfg, dtype)
        # A tensor-parallel rank caches its own KV heads; the block ids are the same on every rank.
        self.kv = KVCache(mcfg.num_layers, mcfg.num_kv_heads // model.tp.size, mcfg.head_dim, num_blocks,
                          config.block_size, dtype, config.device)
        self.batch = BatchState(config.max_num_seqs, self.max_model_len, config.block_size, self.eos_token_ids)
        self.wakeup = threading.Event()
        self.connector = None if config.kv_transfer is None else \
            make_connector(config.kv_transfer, self.kv, self.model, config.block_size, self.wakeup.set)
        self.scheduler = Scheduler(self.batch, self.kv.pool, config.max_num_batched_tokens,
                                   config.enable_prefix_caching, self.connector, config.max_prefill_tokens)
        bitmask = GrammarBitmask.for_device(config.device, config.max_num_seqs, self.vocab_size, config.threads)
        self.runner = (ModelRunner(self.model, self.kv, config.device, config.seed, grammar_bitmask=bitmask,
                                   attention_backend=config.attention_backend)
                       if ranks is None else
                       TensorParallelRunner(self.model, self.kv, ranks, config.device, config.seed, bitmask,
                                            config.attention_backend))
        self.grammars = GrammarCompiler(self._grammar_tokenizer)
        self.stats = IterationStats(config.stats_capacity)
        self.requests: dict[int, Request] = {}  # by id, for aborts
        self._inbox: deque[tuple[Add, np.ndarray, Future | None] | Abort] = deque()
        # Admitted requests whose grammar is still compiling: they join the scheduler when it is
        # ready; requests that arrived after them do not wait.
        self._compiling: list[tuple[list[Request], Future]] = []
        self._rejected: dict[int, str] = {}  # request id -> why its grammar could not be compiled

    @classmethod
    def from_config(cls, config: ResolvedConfig, eos_token_ids=None) -> EngineCore:
        if config.engine.tensor_parallel_size == 1:
            return cls(config.engine, load_model(config.model), eos_token_ids, config.model.path)
        config = with_rank_threads(config)
        if config.engine.threads:
            torch.set_num_threads(config.engine.threads)  # before loading: this thread runs the forwards
        ranks = Ranks(config)  # the other ranks start, and load their shares while rank 0 loads its own
        try:
            return cls(config.engine, load_model(config.model, ranks.group), eos_token_ids, config.model.path, ranks)
        except BaseException:
            ranks.shutdown()
            raise

    def _grammar_tokenizer(self):
        """The grammar library's view of the vocabulary (built on the compiler's thread)."""
        if self.tokenizer_path is None:
            raise ValueError("structured outputs need the model's tokenizer; this engine was built without its path")
        tokenizer = Tokenizer.from_pretrained(self.tokenizer_path)
        return structured.load_tokenizer(tokenizer.backend.to_str(), self.vocab_size, self.eos_token_ids)

    def close(self) -> None:
        """Stops the grammar compiler's thread, the KV transfer thread (whose sockets it closes)
        and the other tensor-parallel ranks (the loop must have stopped)."""
        self.grammars.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        self.runner.shutdown()

    # ------------------------------------------------------------------ boundary (any thread)
    def add_request(self, request_id: int, prompt: np.ndarray, params: SamplingParams,
                    arrival_time: float | None = None, do_remote_decode: bool = False,
                    remote_prefill: RemotePrefill | None = None) -> None:
        """Enqueues a request; samples of ``n > 1`` get ids ``request_id .. request_id + n - 1``.

        ``prompt`` should be an int32 numpy array: it is held as is, never copied.
        ``do_remote_decode``: keep the prompt's blocks for a decode worker when it finishes;
        ``remote_prefill``: take the prompt's KV from that prefill worker's lease.
        Raises ValueError naming the field; nothing is enqueued then.
        """
        self.enqueue(Add(request_id, params, arrival_time or time.monotonic(), do_remote_decode, remote_prefill),
                     prompt)

    def enqueue(self, add: Add, prompt: np.ndarray) -> None:
        """``add_request`` of an Add as it came over the wire (the engine process's input thread)."""
        if not isinstance(prompt, np.ndarray) or prompt.dtype != np.int32 or prompt.ndim != 1:
            raise ValueError("prompt: must be a 1-D int32 numpy array of token ids")
        params = add.params
        validate_request(len(prompt), params, self.max_model_len, self.vocab_size, self.config.max_logprobs)
        grammar = None
        if params.structured_outputs is not None:  # compiling starts now, on the compiler's thread
            grammar = self.grammars.compile(params.structured_outputs, params.n)
            grammar.add_done_callback(lambda _: self.wakeup.set())
        self._inbox.append((add, prompt, grammar))
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
        sch = self.scheduler
        return (bool(self._inbox) or bool(sch.running) or bool(sch.waiting) or bool(self._compiling)
                or bool(sch.receiving) or (self.connector is not None and self.connector.has_work()))

    # ------------------------------------------------------------------ the loop body
    def step(self) -> StepOutput | None:
        """One iteration: fetch, schedule, execute, update. Returns its output; None when there
        was nothing to run or report. A failing iteration fails its own requests, not the loop."""
        clock = PhaseClock()
        aborted, num_new_requests = self._fetch()
        rejected, self._rejected = self._rejected, {}
        clock.lap("fetch_ms")
        sched = self.scheduler.schedule()
        rejected |= self._failed_outside_step()
        clock.lap("schedule_ms")
        if sched.empty:
            return StepOutput.of_aborts(aborted, rejected) if aborted or rejected else None
        result = None
        try:
            out = self._execute(sched, clock)
            result = self.scheduler.update_from_output(sched, out.sampled.token_ids.numpy().astype(np.int32), clock)
            step_out = StepOutput.of_step(result, out.sampled, out.prompt_logprobs, aborted, rejected)
            self._forget(result.finished)
        except Exception:  # noqa: BLE001 - one bad iteration must not kill the loop
            log.error("iteration failed; failing its requests:\n%s", traceback.format_exc())
            error = traceback.format_exc(limit=1).strip().splitlines()[-1]
            step_out = self._fail(sched, error, aborted, result.finished if result else [])
            step_out.errors.update(rejected)
        clock.lap("output_ms")
        self._record(clock, sched, num_new_requests)
        return step_out

    def _execute(self, sched: ScheduledBatch, clock: PhaseClock) -> ModelOutput:
        inp = build_model_input(self.batch, sched)
        clock.lap("prepare_ms")
        out = self.runner.execute(inp)
        clock.lap()  # broadcast, forward, grammar masks and sampling, which the runner times itself
        clock.ms["broadcast_ms"], clock.ms["forward_ms"], clock.ms["sample_ms"] = (out.broadcast_ms, out.forward_ms,
                                                                                   out.sample_ms)
        clock.ms["grammar_ms"] += out.grammar_ms
        return out

    def _record(self, clock: PhaseClock, sched: ScheduledBatch, num_new_requests: int) -> None:
        self.stats.record(
            start_time_s=clock.start_time, host_step_ms=clock.total_ms, **clock.ms, num_new_requests=num_new_requests,
            num_context_tokens=sched.num_prefill_tokens, num_generation_requests=len(sched.decode_slots),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_waiting_for_kv=len(self.scheduler.receiving),
            kv_blocks_used=self.kv.pool.num_used, num_preemptions=len(sched.preempted),
        )

    def _failed_outside_step(self) -> dict[int, str]:
        """Requests the scheduler ended with an error before the step (KV transfers), forgotten:
        they are reported without a row, as rejected ones are."""
        failed = self.scheduler.take_failed()
        self._forget([req for req, _ in failed])
        return {req.request_id: error for req, error in failed}

    def _fetch(self) -> tuple[list[int], int]:
        """Takes aborts, and at most ``max_new_requests_per_step`` new requests, from the inbox;
        returns the ids it aborted and how many requests it took."""
        if self._compiling:
            self._start_compiled()
        aborted = []
        added = 0
        inbox = self._inbox
        while inbox:
            item = inbox[0]
            if isinstance(item, Abort):
                inbox.popleft()
                reqs = [self.requests[rid] for rid in item.request_ids if rid in self.requests]
                for req in reqs:
                    self.scheduler.finish(req)
                for rid in item.request_ids:  # a finished prefill's lease that nobody will pull
                    if rid not in self.requests:
                        self.scheduler.drop_lease(rid)
                self._forget(reqs)
                aborted += [req.request_id for req in reqs]
                continue
            if added >= self.config.max_new_requests_per_step:
                break
            inbox.popleft()
            added += 1
            self._admit(*item)
        return aborted, added

    def _admit(self, add: Add, prompt: np.ndarray, grammar: Future | None) -> None:
        """Queues the ``n`` samples of a request; samples after the first share its prompt blocks.
        A request whose grammar is still compiling waits aside, holding nothing. With a remote
        prefill the first sample receives the prompt's KV, and the others share it."""
        params, first, reqs = add.params, None, []
        remote = self._usable_remote_prefill(add)
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(self.runner.device).manual_seed((params.seed + i) % 2**64)
            req = Request(add.request_id + i, prompt, params, generator, prefix_parent=first,
                          arrival_time=add.arrival_time)
            if remote is not None:
                req.prefix_cacheable = False
                req.kv_remote = remote if first is None else None
            req.do_remote_decode = first is None and add.do_remote_decode and self.connector is not None \
                and self.connector.config.is_producer
            first = first or req
            self.requests[req.request_id] = req
            reqs.append(req)
        if grammar is None:
            for req in reqs:
                self.scheduler.add(req)
        elif grammar.done():
            self._start_constrained(reqs, grammar)
        else:
            self._compiling.append((reqs, grammar))

    def _start_compiled(self) -> None:
        waiting = []
        for reqs, grammar in self._compiling:
            if grammar.done():
                self._start_constrained(reqs, grammar)
            else:
                waiting.append((reqs, grammar))
        self._compiling = waiting

    def _start_constrained(self, reqs: list[Request], grammar: Future) -> None:
        """Samples (not aborted meanwhile) join the scheduler with their matchers, or end with
        the compiler's error."""
        live = [r for r in reqs if r.status != Status.FINISHED]
        try:
            matchers = grammar.result()
        except Exception as e:  # noqa: BLE001 - the API validates first; this is the backstop
            for req in live:
                req.status = Status.FINISHED
                self._rejected[req.request_id] = f"structured_outputs: {e}"
                if req.kv_remote is not None:
                    self.connector.release_remote(req.kv_remote)
            self._forget(live)
            return
        for req, matcher in zip(reqs, matchers):
            if req.status != Status.FINISHED:
                req.grammar = matcher
                self.scheduler.add(req)

    def _usable_remote_prefill(self, add: Add) -> RemotePrefill | None:
        """The Add's remote prefill if this engine can take its KV; otherwise the prompt is
        computed here, and the prefill worker is told to free its lease now."""
        remote, c = add.remote_prefill, self.connector
        if remote is None or c is None:
            return None
        # A prompt-logprobs request needs every prompt position computed here.
        if not c.config.is_consumer or add.params.prompt_logprobs is not None:
            c.release_remote(remote)
            return None
        return remote

    def _forget(self, reqs: list[Request]) -> None:
        """Drops finished requests from the id table. Tolerant: a failing iteration (``_fail``)
        may reach requests ``update_from_output`` already finished."""
        for req in reqs:
            self.requests.pop(req.request_id, None)

    def _fail(self, sched: ScheduledBatch, error: str, aborted: list[int], finished: list[Request]) -> StepOutput:
        """Ends every request of a failed step with ``error``, including those the step's update
        had already finished (``finished``) before the failure."""
        reqs = {r.request_id: r for r in finished}
        for r in [self.batch.requests[s] for s in sched.decode_slots] + [c.request for c in sched.prefills]:
            if r is not None:  # None: a slot the update released, its request is in ``finished``
                reqs[r.request_id] = r
        for req in reqs.values():
            self.scheduler.finish(req)
        self._forget(list(reqs.values()))
        return StepOutput.of_failure(list(reqs), error, aborted)



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
        """Raises ExecutorFailed once no step can run any more (a tensor-parallel rank died),
        after emitting the step that found it, which fails its requests with the reason."""
        core = self.core
        self.thread_id = threading.get_ident()
        while not self._stop:
            if core.runner.failure is not None:
                raise ExecutorFailed(core.runner.failure)
            if not core.has_work:
                core.wakeup.wait(IDLE_WAIT_S)
                core.wakeup.clear()
                continue
            self.step_started = time.monotonic()
            out = core.step()
            self.step_started = None
            if out is not None:
                self.emit(out)
            else:
                # Work exists but none is runnable now (e.g. waiting for blocks): yield briefly.
                core.wakeup.wait(BLOCKED_WAIT_S)
                core.wakeup.clear()

    def stop(self) -> None:
        """Ends ``run`` after the current iteration (from any thread)."""
        self._stop = True
        self.core.wakeup.set()
