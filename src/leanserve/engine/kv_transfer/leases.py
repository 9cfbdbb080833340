"""Prefill side: a finished prefill's blocks, kept for a decode worker under a lease.

A lease is named by (request id, epoch) and has a deadline. The epoch is the lease's sequence
number on this engine: a pull must name both, so an id from some other lease (a replayed or
stale ``kv_transfer_params``) never reaches another prompt's blocks (vLLM #52234 returned
another prompt's answer for stale block ids).

Two threads touch the table: the engine loop (creates leases, frees blocks) and the transfer
thread (sends a lease's blocks, or drops it when the decode side releases it). Ownership moves
by one ``dict.pop``, atomic under the GIL: whoever pops a lease from ``_held`` decides its
fate. The loop pops to expire or drop it and frees the blocks at once; the transfer thread pops
to send or release it and hands it back through ``_ended`` once no byte of it is read any
more, and the loop frees those blocks on its next iteration. So blocks are never freed while
another thread reads them, and never leaked: every lease leaves ``_held`` exactly once and its
blocks are freed exactly once (TensorRT-LLM #12313: leaked blocks after cancellations hung a
server whose /health said 200).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass


@dataclass
class Lease:
    request_id: int
    epoch: int
    block_ids: list[int]
    deadline: float


class LeaseTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._held: dict[int, Lease] = {}  # by request id
        self._deadlines: list[tuple[float, int, int]] = []  # heap of (deadline, request id, epoch)
        self._ended: deque[Lease] = deque()  # handed back by the transfer thread, blocks to free
        self._epoch = 0
        self.expired_total = 0

    # ------------------------------------------------------------------ engine loop
    def create(self, request_id: int, block_ids: list[int], now: float | None = None) -> Lease:
        self._epoch += 1
        now = time.monotonic() if now is None else now
        lease = Lease(request_id, self._epoch, block_ids, now + self.timeout_s)
        self._held[request_id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, request_id, lease.epoch))
        return lease

    def drop(self, request_id: int) -> Lease | None:
        """This worker will not hand the lease over (its own client left, or the answer ended on
        a stop string): the caller frees its blocks. None when there is none to drop."""
        return self._held.pop(request_id, None)

    def take_ended(self, now: float) -> list[Lease]:
        """Leases whose blocks the caller frees now: handed back by the transfer thread, and
        expired ones. O(1) when there are none: one deque check and one look at the heap's head."""
        out = []
        while self._ended:
            out.append(self._ended.popleft())
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, request_id, epoch = heapq.heappop(heap)
            lease = self._held.get(request_id)
            # Entries of leases that already ended are skipped here: deleted lazily, by deadline.
            if lease is not None and lease.epoch == epoch and self._held.pop(request_id, None) is lease:
                self.expired_total += 1
                out.append(lease)
        return out

    def due(self, now: float) -> bool:
        """Whether ``take_ended`` has something to give back now."""
        return bool(self._ended) or bool(self._deadlines and self._deadlines[0][0] <= now)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ------------------------------------------------------------------ transfer thread
    def take(self, request_id: int, epoch: int) -> Lease | None:
        """The lease, now owned by the caller (to send or release); None when (request id,
        epoch) names no lease held: never made, stale, already taken, or expired meanwhile."""
        lease = self._held.get(request_id)
        if lease is None or lease.epoch != epoch:
            return None
        return self._held.pop(request_id, None)

    def give_back(self, lease: Lease) -> None:
        """A taken lease whose blocks nobody reads any more: the loop frees them next iteration."""
        self._ended.append(lease)
