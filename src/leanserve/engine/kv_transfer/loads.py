"""Decode side: transfers of prompt KV into blocks this worker allocated for them.

A load starts on the engine loop (blocks allocated first, so a worker only asks when it has
room), is claimed by the transfer thread when the blocks' bytes arrive, and ends in a deque of
completions the loop drains. As with leases (``leases.py``), ownership moves by one atomic
``dict.pop`` on ``_pending``: the transfer thread writes into a load's blocks only after it
popped (claimed) it, and the loop frees them at once only if it popped it first (an abort or a
timeout); otherwise the claim's completion is on its way and the loop frees them when it lands.
So bytes that arrive late never land in blocks given to another request.

Timeouts are a heap of deadlines: each iteration looks at its head, O(1), and a load whose
deadline passed is taken back and fails (TensorRT-LLM #12476/#14414, SGLang #31800: receivers
that waited forever froze the loop or leaked slots until throughput collapsed).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from .messages import RemotePrefill


@dataclass
class Load:
    request_id: int
    remote: RemotePrefill
    block_ids: list[int]
    deadline: float
    started: float = field(default_factory=time.monotonic)


class LoadTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._pending: dict[int, Load] = {}  # started, bytes not arrived
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, request id)
        self._done: deque[tuple[int, str | None]] = deque()  # (request id, error or None) from the transfer thread

    # ------------------------------------------------------------------ engine loop
    def start(self, request_id: int, remote: RemotePrefill, block_ids: list[int], now: float | None = None) -> Load:
        now = time.monotonic() if now is None else now
        load = Load(request_id, remote, block_ids, now + self.timeout_s, now)
        self._pending[request_id] = load
        heapq.heappush(self._deadlines, (load.deadline, request_id))
        return load

    def cancel(self, request_id: int) -> Load | None:
        """Takes the load back: the transfer thread will not touch its blocks. None when that
        thread claimed it first (its completion follows) or it already ended."""
        return self._pending.pop(request_id, None)

    def take_done(self) -> list[tuple[int, str | None]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def take_expired(self, now: float) -> list[Load]:
        """Loads past their deadline, taken back (O(1) when none: one look at the heap's head)."""
        out, heap = [], self._deadlines
        while heap and heap[0][0] <= now:
            _, request_id = heapq.heappop(heap)
            load = self._pending.pop(request_id, None)  # None: it landed or was cancelled already
            if load is not None:
                out.append(load)
        return out

    @property
    def busy(self) -> bool:
        return bool(self._pending) or bool(self._done)

    # ------------------------------------------------------------------ transfer thread
    def pending(self, request_id: int) -> Load | None:
        return self._pending.get(request_id)

    def claim(self, request_id: int) -> Load | None:
        """The load, now the caller's to write into; None when the loop took it back."""
        return self._pending.pop(request_id, None)

    def finish(self, request_id: int, error: str | None) -> None:
        """A claimed load is over: its blocks written (``error`` None) or not."""
        self._done.append((request_id, error))
