"""The connector interface: what the engine loop asks of KV transfer, whatever moves the bytes.

As vLLM's ``KVConnector`` is split, a scheduler side (here: the methods the loop calls, and the
lease and load tables) decides what to send or receive, and a worker side (a subclass's thread)
moves bytes: ``ZmqConnector`` over ZeroMQ, ``FakeConnector`` not at all, and later a NIXL or
Mooncake connector, without touching the loop.

Every method the loop calls is O(1) or O(events) and never waits: ``lease``, ``drop_lease``,
``start_load``, ``cancel_load`` and ``release_remote`` record state and hand the transport a
command; ``poll`` drains the completions and looks at the two deadline heaps' heads.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple

from .config import KVTransferConfig
from .leases import Lease, LeaseTable
from .loads import Load, LoadTable
from .messages import KVLayout, KVLease, RemotePrefill

# Transfer durations awaiting the stats thread (drained every 0.5 s): bounded if nobody drains.
MAX_PENDING_DURATIONS = 65536


class KVEvents(NamedTuple):
    landed: list[tuple[int, str | None]]  # decode side: (request id, error or None) of loads that ended
    freed: list[list[int]]  # prefill side: block ids of leases that ended, to free


class KVTransferCounters:
    """Read by the stats snapshot (another thread): plain ints, each written by one thread."""

    def __init__(self):
        self.loads_started = 0  # loop
        self.loads_completed = 0  # loop
        self.loads_failed = 0  # loop
        self.bytes_received = 0  # transfer thread
        self.bytes_sent = 0  # transfer thread
        self.leases_created = 0  # loop
        self.durations: deque[float] = deque(maxlen=MAX_PENDING_DURATIONS)  # seconds, pull sent -> blocks written


class KVConnector:
    def __init__(self, config: KVTransferConfig, layout: KVLayout, wakeup: Callable[[], None]):
        self.config = config
        self.engine_id = config.engine_id
        self.layout = layout
        self.leases = LeaseTable(config.kv_lease_timeout_s)
        self.loads = LoadTable(config.kv_transfer_timeout_s)
        self.counters = KVTransferCounters()
        self.wakeup = wakeup  # sets the loop's wake-up event: something for ``poll``

    # ------------------------------------------------------------------ prefill side (engine loop)
    def lease(self, request_id: int, block_ids: list[int], num_cached_tokens: int) -> KVLease:
        """Keeps a finished prefill's blocks for a decode worker; the caller no longer frees them."""
        lease = self.leases.create(request_id, block_ids)
        self.counters.leases_created += 1
        cfg = self.config
        return KVLease(request_id, lease.epoch, block_ids, num_cached_tokens, cfg.engine_id, cfg.kv_ip, cfg.kv_port)

    def drop_lease(self, request_id: int) -> list[int] | None:
        """Block ids to free of a lease nobody will pull; None if there is none (any more)."""
        lease = self.leases.drop(request_id)
        return None if lease is None else lease.block_ids

    # ------------------------------------------------------------------ decode side (engine loop)
    def start_load(self, request_id: int, remote: RemotePrefill, block_ids: list[int]) -> None:
        """Starts moving ``remote``'s blocks into ``block_ids`` (allocated by the caller)."""
        self.counters.loads_started += 1
        self._pull(self.loads.start(request_id, remote, block_ids))

    def cancel_load(self, request_id: int) -> bool:
        """The request will not use its load (abort). True: its blocks are the caller's to free
        now; False: the transfer thread is writing them, and the load lands shortly."""
        load = self.loads.cancel(request_id)
        if load is None:
            return False
        self.release_remote(load.remote)
        return True

    def release_remote(self, remote: RemotePrefill) -> None:
        """Tells the prefill worker to free a lease this worker will not pull."""
        self._release(remote)

    # ------------------------------------------------------------------ every iteration (engine loop)
    def poll(self) -> KVEvents:
        now = time.monotonic()
        landed = self.loads.take_done()
        for load in self.loads.take_expired(now):
            self.release_remote(load.remote)  # the prefill worker frees its lease now, not at its expiry
            landed.append((load.request_id, f"no KV from the prefill worker at {load.remote.host}:"
                                            f"{load.remote.port} within kv_transfer_timeout_s="
                                            f"{self.config.kv_transfer_timeout_s:g}"))
        for _, error in landed:
            if error is None:
                self.counters.loads_completed += 1
            else:
                self.counters.loads_failed += 1
        freed = [lease.block_ids for lease in self.leases.take_ended(now)]
        return KVEvents(landed, freed)

    def has_work(self) -> bool:
        """Whether ``poll`` has, or will soon have, something: the loop keeps iterating then."""
        return self.loads.busy or self.leases.due(time.monotonic())

    # ------------------------------------------------------------------ the transport's part
    def _pull(self, load: Load) -> None:
        """Asks the prefill worker for ``load``'s blocks; the answer claims and finishes it."""
        raise NotImplementedError

    def _release(self, remote: RemotePrefill) -> None:
        raise NotImplementedError

    def _ended_by_transport(self, lease: Lease) -> None:
        """A lease the transport took (sent or released) goes back for its blocks to be freed."""
        self.leases.give_back(lease)
        self.wakeup()

    def shutdown(self) -> None:
        pass
