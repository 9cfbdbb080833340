"""The scheduler: which requests compute how many tokens this iteration.

There are no prefill and decode phases. Each request has ``num_tokens`` (prompt + output so far)
and ``num_computed``; this iteration gives it ``min(num_tokens - num_computed, budget left)``
tokens. Chunked prefill, prefix-cache hits, resumption after preemption and decoding all follow
that one rule. The budget is ``max_num_batched_tokens``, or ``max_prefill_tokens`` in a step
in which no running request decodes (no decode row waits on its chunks). Running requests go
first (so long prompts never starve decodes); waiting ones are admitted only if nothing was
preempted this iteration.

``schedule`` plans the running requests one of three ways, all giving each request
``min(remaining, budget left)`` tokens in order: the steady state (every request decodes one
token; only those opening a new block touch Python), a vectorised plan (some prefill chunks
too), and, when the pool cannot hold that plan, a walk that preempts the newest running request
(its blocks are freed and it is recomputed later; its full blocks usually survive in the prefix
cache, so recomputation is mostly hits). The first two are shortcuts of the walk for when it
would preempt nothing (``tests/test_scheduler.py`` checks that on random states); all three end
in the same tail, ``_schedule_from_plan``.

After the forward, ``update_from_output`` is the one place a step's results change request
state: computed counts, full blocks into the prefix cache, sampled tokens, stop checks,
finished requests released. The scheduler also keeps the engine's counters.

Disaggregated serving (with a ``kv_transfer`` connector) adds one request state and one
admission rule. A request whose prompt KV waits on a prefill worker is admitted when a slot and
its prompt's blocks are free, without spending budget, into ``WAITING_FOR_REMOTE_KVS``; each
``schedule`` first lands the transfers that ended (``_land_transfers``: O(completions), plus a
look at the timeout heap's head), and a landed request runs with all but its last prompt token
computed. On the prefill side, a finished request sent with ``do_remote_decode`` leaves its
prompt's blocks under a lease instead of freeing them; leases that end give them back here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .batch_state import BatchState, blocks_needed
from .kv_cache import BlockPool, block_key
from .kv_transfer.connector import KVConnector
from .kv_transfer.messages import KVLease
from .request import FinishReason, Request, Status
from .stats import PhaseClock
from .structured import backend as structured

# Queue times awaiting the stats thread (drained every 0.5 s): bounded if nobody drains them.
MAX_PENDING_QUEUE_TIMES = 65536


class Chunk(NamedTuple):
    """Tokens ``[start, start + length)`` of a request computed in one step (not a decode row)."""

    request: Request
    start: int
    length: int
    samples: bool  # the chunk reaches the request's last known token: its logits give a new one


@dataclass
class ScheduledBatch:
    decode_slots: np.ndarray  # slots computing exactly their one newest token (and sampling)
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Slots that sample a token this step, in row order (decode rows, then sampling chunks).
    sample_slots: np.ndarray = field(init=False)

    def __post_init__(self):
        chunks = [c.request.slot for c in self.prefills if c.samples]
        self.sample_slots = np.concatenate((self.decode_slots, chunks)).astype(np.int64) if chunks \
            else self.decode_slots

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefills)

    @property
    def empty(self) -> bool:
        return not len(self.decode_slots) and not self.prefills


@dataclass
class StepResult:
    """What ``update_from_output`` made of a step, one row per sampling slot."""

    request_ids: np.ndarray  # int64
    token_ids: np.ndarray  # int32
    finish_reasons: np.ndarray  # int8 FinishReason, 0 while running
    num_cached_tokens: np.ndarray  # int32, prompt tokens served by the prefix cache
    finished: list[Request]
    errors: dict[int, str] = field(default_factory=dict)  # request id -> why it ended with ERROR
    leases: list[KVLease] = field(default_factory=list)  # finished prefills kept for decode workers


class Scheduler:
    def __init__(self, batch: BatchState, pool: BlockPool, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, connector: KVConnector | None = None,
                 max_prefill_tokens: int | None = None):
        self.batch = batch
        self.pool = pool
        self.block_size = batch.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        # A step's budget where no running request decodes (none, or less: the same): no decode
        # row waits on its chunks (engine/config.py's CPU_PREFILL_TOKENS says what it buys).
        self.max_prefill_tokens = max(max_prefill_tokens or 0, max_num_batched_tokens)
        self.enable_prefix_caching = enable_prefix_caching
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receiving: dict[int, Request] = {}  # WAITING_FOR_REMOTE_KVS (and aborted ones whose bytes are landing)
        # Requests a KV transfer failed, ended outside a step: the engine reports them (``take_failed``).
        self._failed: list[tuple[Request, str]] = []
        self._running_slots: np.ndarray | None = None  # cache of [r.slot for r in running]
        # Counters read by the metrics exporter.
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # Prompt tokens to compute, counted at each request's first admission: prefix hits
        # excluded, recomputation after a preemption not counted again.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.queue_times: deque[float] = deque(maxlen=MAX_PENDING_QUEUE_TIMES)  # seconds, per first admission

    # ------------------------------------------------------------------ queue changes
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Removes a request wherever it is (aborts, failures) and frees its blocks and slot.
        A request already finished is left as it is. A request still to receive its prompt's KV
        releases the prefill worker's lease (SGLang #9726: a failed leg left the other waiting)."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self._running_slots = None
            self._release(req)
        elif req.status == Status.WAITING_FOR_REMOTE_KVS:
            # If the transfer thread is writing its blocks now, they are freed when that lands.
            if self.connector.cancel_load(req.request_id):
                del self.receiving[req.request_id]
                self._release(req)
        elif req.status == Status.WAITING:
            if req in self.waiting:  # not yet there while its grammar compiles
                self.waiting.remove(req)  # a waiting request holds no blocks
            if req.kv_remote is not None:
                self.connector.release_remote(req.kv_remote)
        req.status = Status.FINISHED

    def drop_lease(self, request_id: int) -> None:
        """Frees a finished prefill's leased blocks that no decode worker will pull."""
        if self.connector is not None and (block_ids := self.connector.drop_lease(request_id)) is not None:
            self.pool.free(block_ids)

    def take_failed(self) -> list[tuple[Request, str]]:
        failed, self._failed = self._failed, []
        return failed

    def finish_slots(self, slots: np.ndarray, reasons: np.ndarray) -> tuple[list[Request], list[KVLease]]:
        """Finishes the running requests in these slots (one pass over the running list). A
        prefill for a decode worker (``do_remote_decode``) that ends on its length keeps its
        prompt's blocks under a lease; the leases are returned with the finished requests."""
        reqs = [self.batch.requests[s] for s in slots]
        gone = set(map(id, reqs))
        self.running = [r for r in self.running if id(r) not in gone]
        self._running_slots = None
        leases = []
        for r, reason in zip(reqs, reasons):
            if r.do_remote_decode and reason == FinishReason.LENGTH:
                leases.append(self._lease(r))
            else:
                self._release(r)
            r.status = Status.FINISHED
        return reqs, leases

    def _lease(self, req: Request) -> KVLease:
        block_ids = self.batch.remove(req.slot)
        keep = blocks_needed(req.num_prompt_tokens, self.block_size)  # the prompt's: all a decode worker takes
        self.pool.free(block_ids[keep:])
        return self.connector.lease(req.request_id, block_ids[:keep], req.num_cached_tokens)

    def _release(self, req: Request) -> None:
        """A running request gives back its batch slot and KV blocks."""
        self.pool.free(self.batch.remove(req.slot))

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch:
        if self.connector is not None:
            self._land_transfers()
        slots = self._slots()
        remaining = self.batch.num_tokens[slots] - self.batch.num_computed[slots]
        budget = self.max_num_batched_tokens if (remaining == 1).any() else self.max_prefill_tokens
        if self._steady_state(slots, remaining, budget):
            return self._schedule_from_plan(slots, None, budget, [])
        granted, preempted = self._plan_vectorised(slots, remaining, budget), []
        if granted is None:
            granted, preempted = self._plan_with_preemption(budget)
            slots = self._slots()
        return self._schedule_from_plan(slots, granted, budget, preempted)

    def _slots(self) -> np.ndarray:
        if self._running_slots is None:
            self._running_slots = np.fromiter((r.slot for r in self.running), np.int64, len(self.running))
        return self._running_slots

    def _steady_state(self, slots: np.ndarray, remaining: np.ndarray, budget: int) -> bool:
        """Whether every running request (``remaining`` tokens each) decodes its one newest token
        and the blocks they open are free; if so, those blocks are allocated (one token each is
        then the plan)."""
        b = self.batch
        if not len(slots) or len(slots) > budget or not (remaining == 1).all():
            return False
        opening = slots[b.num_blocks[slots] * self.block_size == b.num_computed[slots]]
        if len(opening) > self.pool.num_free:
            return False
        for s in opening:
            self._grow(s, 1)
        return True

    def _plan_vectorised(self, slots: np.ndarray, remaining: np.ndarray, budget: int) -> np.ndarray | None:
        """Running requests in order take ``min(remaining, budget left)`` tokens each. None when
        the blocks for that do not all fit (the walk then decides whom to preempt)."""
        b = self.batch
        before = np.cumsum(remaining) - remaining
        granted = np.clip(budget - before, 0, remaining)
        need = np.maximum(blocks_needed(b.num_computed[slots] + granted, self.block_size) - b.num_blocks[slots], 0)
        if need.sum() > self.pool.num_free:
            return None
        for i in np.flatnonzero(need):
            self._grow(slots[i], int(need[i]))
        return granted

    def _plan_with_preemption(self, budget: int) -> tuple[np.ndarray, list[Request]]:
        """The walk: running requests in order, each taking ``min(remaining, budget left)``
        tokens; when blocks run out, the newest running request is preempted (possibly the one
        at hand). Returns the tokens granted to those still running, and the preempted."""
        b = self.batch
        preempted, granted = [], []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            s = req.slot
            k = min(int(b.num_tokens[s] - b.num_computed[s]), budget)
            need = max(blocks_needed(int(b.num_computed[s]) + k, self.block_size) - int(b.num_blocks[s]), 0)
            while need > self.pool.num_free and self.running[-1] is not req:
                preempted.append(self._preempt(self.running[-1]))
            if need > self.pool.num_free:
                preempted.append(self._preempt(req))
                break
            if need:
                self._grow(s, need)
            granted.append(k)
            budget -= k
            i += 1
        self._running_slots = None
        return np.asarray(granted, np.int64), preempted

    def _schedule_from_plan(self, slots: np.ndarray, granted: np.ndarray | None, budget: int,
                            preempted: list[Request]) -> ScheduledBatch:
        """The tail every plan shares: a running request granted exactly its one remaining token
        is a decode row, any other grant a chunk (``granted`` None: the steady state, all decode
        rows); waiting requests are admitted with the budget left, unless this step preempted
        (they would take the blocks just freed)."""
        if granted is None:
            decode_slots, prefills, spent = slots.copy(), [], len(slots)  # a copy: slots is our cache
        else:
            b = self.batch
            remaining = b.num_tokens[slots] - b.num_computed[slots]
            is_decode = (granted == 1) & (remaining == 1)
            chunked = ~is_decode & (granted > 0)
            decode_slots, spent = slots[is_decode], int(granted.sum())
            prefills = [
                Chunk(b.requests[s], int(b.num_computed[s]), int(k), bool(k == r))
                for s, k, r in zip(slots[chunked], granted[chunked], remaining[chunked])
            ]
        if not preempted:
            prefills += self._admit(budget - spent)
        return ScheduledBatch(decode_slots, prefills, preempted)

    def _grow(self, slot: int, count: int) -> None:
        self.batch.append_blocks(slot, self.pool.allocate(count))

    def _preempt(self, req: Request) -> Request:
        self.running.remove(req)
        self.pool.free(self.batch.remove(req.slot, keep_output=True))
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    def _admit(self, budget: int) -> list[Chunk]:
        b, bs = self.batch, self.block_size
        out = []
        while self.waiting and budget > 0 and b.has_free_slot:
            req = self.waiting[0]
            if req.kv_remote is not None:
                if not self._start_receiving(req):
                    break
                continue
            parent = req.prefix_parent
            if parent is not None:
                if parent.status in (Status.WAITING, Status.WAITING_FOR_REMOTE_KVS) or (
                    parent.status == Status.RUNNING and parent.num_computed_tokens < parent.num_prompt_tokens
                ):
                    break  # share the first sample's prompt blocks once they are computed
                req.prefix_parent = None
            total = req.num_prompt_tokens + (0 if req.saved_output is None else len(req.saved_output))
            use_cache = self._may_use_cache(req)
            if not req.prefix_cacheable and parent is not None and parent.status == Status.RUNNING:
                hits = parent.block_ids[: (total - 1) // bs]  # received KV is not in the prefix cache
            else:
                hits = self._lookup(req, total) if use_cache else []
            computed = len(hits) * bs
            k = min(total - computed, budget)
            need = blocks_needed(computed + k, bs) - len(hits)
            free_after_share = self.pool.num_free - sum(self.pool.blocks[h].ref_count == 0 for h in hits)
            if need > free_after_share:
                break
            self.pool.share(hits)
            if req.first_scheduled_time is None:  # first admission: not a resumption after preemption
                req.first_scheduled_time = time.monotonic()
                self.queue_times.append(req.first_scheduled_time - req.arrival_time)
                self.prompt_tokens_total += req.num_prompt_tokens - computed
                req.num_cached_tokens = computed
                if use_cache:  # counted once admitted, not on every step a request waits for blocks
                    self.prefix_queries += req.num_prompt_tokens
                    self.prefix_hits += computed
            req.status = Status.RUNNING
            self.waiting.popleft()
            b.add(req, computed, hits + self.pool.allocate(need))
            self.running.append(req)
            self._running_slots = None
            out.append(Chunk(req, computed, k, computed + k == total))
            budget -= k
        return out

    def _may_use_cache(self, req: Request) -> bool:
        # n > 1 samples share their prompt's blocks even with prefix caching off. Prompt logprobs
        # need every prompt position computed, so such requests skip the cache.
        return (self.enable_prefix_caching or req.params.n > 1) and req.params.prompt_logprobs is None \
            and req.prefix_cacheable

    # ------------------------------------------------------------------ KV from a prefill worker
    def _start_receiving(self, req: Request) -> bool:
        """Admits a request whose prompt's KV is on a prefill worker: a slot and the prompt's
        blocks now, the transfer started; False (it waits) when the blocks are not free."""
        need = blocks_needed(req.num_prompt_tokens, self.block_size)
        if need > self.pool.num_free:
            return False
        self.waiting.popleft()
        req.first_scheduled_time = time.monotonic()
        self.queue_times.append(req.first_scheduled_time - req.arrival_time)
        self.prompt_tokens_total += 1  # the last prompt token, computed here as a decode row
        req.num_cached_tokens = req.kv_remote.num_cached_tokens
        req.status = Status.WAITING_FOR_REMOTE_KVS
        slot = self.batch.add(req, 0, self.pool.allocate(need))
        self.receiving[req.request_id] = req
        self.connector.start_load(req.request_id, req.kv_remote, self.batch.block_ids(slot))
        return True

    def _land_transfers(self) -> None:
        """Frees the blocks of leases that ended, and moves requests whose transfer ended on:
        into the running batch with their prompt but its last token computed, or, failed, out
        with the error (``kv_load_failure_policy`` "fail") or back to the queue to compute their
        prompt here ("recompute")."""
        events = self.connector.poll()
        for block_ids in events.freed:
            self.pool.free(block_ids)
        for request_id, error in events.landed:
            req = self.receiving.pop(request_id, None)
            if req is None:
                continue
            if req.status == Status.FINISHED:  # aborted while its bytes were being written
                self._release(req)
            elif error is None:
                self.batch.num_computed[req.slot] = req.num_prompt_tokens - 1
                req.kv_remote = None
                req.status = Status.RUNNING
                self.running.append(req)
                self._running_slots = None
            else:
                self._release(req)
                req.kv_remote = None
                if self.connector.config.kv_load_failure_policy == "recompute":
                    req.status = Status.WAITING
                    req.prefix_cacheable = True
                    self.prompt_tokens_total += req.num_prompt_tokens - 1
                    self.waiting.appendleft(req)
                else:
                    req.status = Status.FINISHED
                    self._failed.append((req, f"KV transfer failed: {error}"))

    def _lookup(self, req: Request, total: int) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        hits = []
        for j in range((total - 1) // self.block_size):
            bid = self.pool.lookup(self._block_key(req, j))
            if bid is None:
                break
            hits.append(bid)
        return hits

    def _block_key(self, req: Request, j: int) -> bytes:
        """Key of the request's j-th full block; keys are computed in order and kept."""
        keys, bs = req.block_keys, self.block_size
        while len(keys) <= j:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", self.batch.tokens(req, i * bs, (i + 1) * bs)))
        return keys[j]

    # ------------------------------------------------------------------ after the forward
    def update_from_output(self, sched: ScheduledBatch, token_ids: np.ndarray,
                           clock: PhaseClock | None = None) -> StepResult:
        """Applies a step's sampled tokens (int32, one per ``sched.sample_slots``): computed
        counts advance, newly full blocks enter the prefix cache, tokens are appended, stops are
        checked (vectorised), grammar matchers advance (timed into ``clock`` as grammar_ms) and
        finished requests give back their slot and blocks."""
        b = self.batch
        self._advance_computed(sched)
        ss = sched.sample_slots
        b.out_tokens[ss, b.num_tokens[ss] - b.num_prompt[ss]] = token_ids
        b.num_tokens[ss] += 1
        b.last_token[ss] = token_ids
        self.generation_tokens_total += len(ss)
        # stop_ids holds EOS too, unless the request ignores it
        reasons = (b.num_tokens[ss] >= b.stop_len[ss]).astype(np.int8) * np.int8(FinishReason.LENGTH)
        reasons[(b.stop_ids[ss] == token_ids[:, None]).any(axis=1)] = FinishReason.STOP
        result = StepResult(b.request_id[ss], token_ids, reasons, b.num_cached[ss], [])  # fancy indexing copies
        constrained = b.constrained[ss]
        if constrained.any():
            if clock is not None:
                clock.lap("output_ms")
            self._advance_grammars(ss, token_ids, np.flatnonzero(constrained & (reasons != FinishReason.STOP)), result)
            if clock is not None:
                clock.lap("grammar_ms")
        done = reasons != 0
        if done.any():
            result.finished, result.leases = self.finish_slots(ss[done], reasons[done])
        return result

    def _advance_grammars(self, slots: np.ndarray, token_ids: np.ndarray, rows: np.ndarray,
                          result: StepResult) -> None:
        """Constrained rows not ended by a stop token: the matcher takes the token. A grammar
        that is complete ends its request ("stop": nothing but EOS could follow, so the step
        that would sample it is saved); a token the grammar refuses (possible only when a
        row's mask allowed nothing, e.g. min_tokens banning the EOS a finished grammar needs)
        ends it with an error."""
        reasons = result.finish_reasons
        for i in rows.tolist():
            matcher = self.batch.requests[slots[i]].grammar
            if not structured.accept(matcher, int(token_ids[i])):
                reasons[i] = FinishReason.ERROR
                result.errors[int(result.request_ids[i])] = "the grammar could not accept the sampled token"
            elif structured.is_terminated(matcher):
                reasons[i] = FinishReason.STOP

    def _advance_computed(self, sched: ScheduledBatch) -> None:
        b, bs = self.batch, self.block_size
        d = sched.decode_slots
        if len(d):
            b.num_computed[d] += 1  # slots are unique, so fancy-indexed += is exact
            for s in d[b.num_computed[d] % bs == 0]:
                end = int(b.num_computed[s])
                self._register_full_blocks(b.requests[s], end - 1, end)
        for req, start, n, _ in sched.prefills:
            b.num_computed[req.slot] = start + n
            self._register_full_blocks(req, start, start + n)

    def _register_full_blocks(self, req: Request, old_computed: int, new_computed: int) -> None:
        if not req.prefix_cacheable:
            return
        bs, row = self.block_size, self.batch.block_table[req.slot]
        for j in range(old_computed // bs, new_computed // bs):
            self.pool.register(int(row[j]), self._block_key(req, j))
