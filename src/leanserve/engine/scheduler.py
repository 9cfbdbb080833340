"""The scheduler: which requests compute how many tokens this iteration.

There are no prefill and decode phases. Each request has ``num_tokens`` (prompt + output so far)
and ``num_computed``; this iteration gives it ``min(num_tokens - num_computed, budget left)``
tokens. Chunked prefill, prefix-cache hits, resumption after preemption and decoding all follow
that one rule. Running requests go first (so long prompts never starve decodes); waiting ones
are admitted only if nothing was preempted this iteration.

The common case (every running request fits) is vectorised over the batch; only requests that
need a new block touch Python. When the pool runs dry, the newest running request is preempted:
its blocks are freed and it is recomputed later (its full blocks usually survive in the prefix
cache, so recomputation is mostly hits).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .batch_state import BatchState
from .kv_cache import BlockPool, block_key
from .request import Request, Status


@dataclass
class ScheduledBatch:
    decode_slots: np.ndarray  # slots computing exactly their one newest token (and sampling)
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, length)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, _, n in self.prefills)

    @property
    def empty(self) -> bool:
        return not len(self.decode_slots) and not self.prefills


class Scheduler:
    def __init__(self, batch: BatchState, pool: BlockPool, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True):
        self.batch = batch
        self.pool = pool
        self.block_size = batch.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._running_slots: np.ndarray | None = None  # cache of [r.slot for r in running]
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ------------------------------------------------------------------ queue changes
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Removes a request wherever it is (aborts, failures) and frees its blocks and slot."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self._running_slots = None
            self._release(req)
        else:
            if req.status == Status.WAITING and req in self.waiting:
                self.waiting.remove(req)
            self.pool.free(req.block_ids)
            req.block_ids = []
        req.status = Status.FINISHED

    def finish_slots(self, slots: np.ndarray) -> list[Request]:
        """Finishes the running requests in these slots (one pass over the running list)."""
        reqs = [self.batch.requests[s] for s in slots]
        gone = set(map(id, reqs))
        self.running = [r for r in self.running if id(r) not in gone]
        self._running_slots = None
        for r in reqs:
            self._release(r)
            r.status = Status.FINISHED
        return reqs

    def _release(self, req: Request) -> None:
        """A running request gives back its batch slot and KV blocks."""
        self.batch.remove(req.slot)
        req.slot = -1
        self.pool.free(req.block_ids)
        req.block_ids = []

    # ------------------------------------------------------------------ scheduling
    def _slots(self) -> np.ndarray:
        if self._running_slots is None:
            self._running_slots = np.fromiter((r.slot for r in self.running), np.int64, len(self.running))
        return self._running_slots

    def schedule(self) -> ScheduledBatch:
        b, bs = self.batch, self.block_size
        budget = self.max_num_batched_tokens
        preempted: list[Request] = []
        slots = self._slots()
        if len(slots) and len(slots) <= budget:
            # Steady state: every running request decodes one token. Only requests whose next
            # token opens a new block touch Python.
            computed = b.num_computed[slots]
            if (b.num_tokens[slots] - computed == 1).all():
                grow = slots[b.num_blocks[slots] * bs == computed]
                if len(grow) <= self.pool.num_free:
                    for s in grow:
                        b.append_blocks(s, self._allocate(b.requests[s], 1))
                    return ScheduledBatch(slots, self._admit(budget - len(slots)))
        if len(slots):
            remaining = b.num_tokens[slots] - b.num_computed[slots]
            before = np.cumsum(remaining) - remaining
            n = np.clip(budget - before, 0, remaining)
            need = np.maximum(-(-(b.num_computed[slots] + n) // bs) - b.num_blocks[slots], 0)
            if need.sum() <= self.pool.num_free:
                for i in np.flatnonzero(need):
                    b.append_blocks(slots[i], self._allocate(b.requests[slots[i]], int(need[i])))
            else:
                n, preempted = self._schedule_running_with_preemption(budget)
                slots = self._slots()
            budget -= int(n.sum())
            remaining = b.num_tokens[slots] - b.num_computed[slots]
            is_decode = (n == 1) & (remaining == 1)
            decode_slots = slots[is_decode]
            prefills = [
                (b.requests[s], int(b.num_computed[s]), int(k))
                for s, k in zip(slots[~is_decode & (n > 0)], n[~is_decode & (n > 0)])
            ]
        else:
            decode_slots, prefills = slots, []
        if not preempted:
            prefills += self._admit(budget)
        return ScheduledBatch(decode_slots, prefills, preempted)

    def _allocate(self, req: Request, count: int) -> list[int]:
        new = self.pool.allocate(count)
        req.block_ids.extend(new)
        return new

    def _schedule_running_with_preemption(self, budget: int) -> tuple[np.ndarray, list[Request]]:
        """The slow path: walk running requests in order, preempting the newest when blocks run out."""
        b, bs = self.batch, self.block_size
        preempted, granted = [], []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            s = req.slot
            k = min(int(b.num_tokens[s] - b.num_computed[s]), budget)
            need = max(-(-(int(b.num_computed[s]) + k) // bs) - int(b.num_blocks[s]), 0)
            while need > self.pool.num_free and self.running[-1] is not req:
                preempted.append(self._preempt(self.running[-1]))
            if need > self.pool.num_free:
                preempted.append(self._preempt(req))
                break
            if need:
                b.append_blocks(s, self._allocate(req, need))
            granted.append(k)
            budget -= k
            i += 1
        self._running_slots = None
        return np.asarray(granted, np.int64), preempted

    def _preempt(self, req: Request) -> Request:
        b = self.batch
        req.saved_output = b.output_tokens(req.slot).copy()
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    def _admit(self, budget: int) -> list[tuple[Request, int, int]]:
        b, bs = self.batch, self.block_size
        out = []
        while self.waiting and budget > 0 and b.has_free_slot:
            req = self.waiting[0]
            parent = req.prefix_parent
            if parent is not None:
                if parent.status == Status.WAITING or (
                    parent.status == Status.RUNNING and b.num_computed[parent.slot] < parent.num_prompt_tokens
                ):
                    break  # share the first sample's prompt blocks once they are computed
                req.prefix_parent = None
            total = req.num_prompt_tokens + (0 if req.saved_output is None else len(req.saved_output))
            use_cache = self._may_use_cache(req)
            hits = self._lookup(req, total) if use_cache else []
            computed = len(hits) * bs
            k = min(total - computed, budget)
            need = -(-(computed + k) // bs) - len(hits)
            free_after_share = self.pool.num_free - sum(self.pool.blocks[h].ref_count == 0 for h in hits)
            if need > free_after_share:
                break
            self.pool.share(hits)
            req.block_ids = hits + self.pool.allocate(need)
            req.num_computed_tokens = computed
            if req.first_scheduled_time is None:  # first admission: not a resumption after preemption
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = computed
                if use_cache:  # counted once admitted, not on every step a request waits for blocks
                    self.prefix_queries += req.num_prompt_tokens
                    self.prefix_hits += computed
            req.status = Status.RUNNING
            self.waiting.popleft()
            b.add(req)
            self.running.append(req)
            self._running_slots = None
            out.append((req, computed, k))
            budget -= k
        return out

    def _may_use_cache(self, req: Request) -> bool:
        # n > 1 samples share their prompt's blocks even with prefix caching off. Prompt logprobs
        # need every prompt position computed, so such requests skip the cache.
        return (self.enable_prefix_caching or req.params.n > 1) and req.params.prompt_logprobs is None

    def _lookup(self, req: Request, total: int) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        bs = self.block_size
        full = (total - 1) // bs
        hits = []
        for j in range(full):
            key = self.block_key(req, j)
            bid = self.pool.lookup(key)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def block_key(self, req: Request, j: int) -> bytes:
        """Key of the request's j-th full block; keys are computed in order and kept."""
        keys, bs = req.block_keys, self.block_size
        while len(keys) <= j:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", self.batch.tokens(req, i * bs, (i + 1) * bs)))
        return keys[j]

    def register_full_blocks(self, req: Request, old_computed: int, new_computed: int) -> None:
        bs = self.block_size
        for j in range(old_computed // bs, new_computed // bs):
            self.pool.register(req.block_ids[j], self.block_key(req, j))
