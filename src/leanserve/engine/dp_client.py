"""Data-parallel engines (vLLM's ``--data-parallel-size``): N engine-core processes, each with its
own model copy and KV cache, behind the API process(es); this is one API process's view of them.

Each request goes to the live engine with the fewest sequences in flight from this process
(running + waiting + in transit: exact with one API process; with several, each balances its
own share; ties go round robin). A request's ids carry its engine's index in their top bits
(``messages.RequestIds``), so an abort finds its engine with a shift, not a per-request map.
With one engine this is a thin pass-through: the server has one client path.

One engine dying fails only its own pending requests (its client does that the moment the
process exits) and leaves the rotation; the others keep serving while ``unavailable`` reports the
degraded state, so /health answers 503 until every engine serves again.
"""

from __future__ import annotations

import asyncio

import numpy as np

from .async_client import AsyncEngineClient, EngineDeadError, EngineOverloaded
from .endpoints import EngineEndpoints
from .kv_transfer.messages import RemotePrefill
from .messages import ENGINE_ID_SHIFT, Ready
from .params import SamplingParams


class DataParallelClient:
    def __init__(self, endpoints: EngineEndpoints, client_index: int = 0, on_stats=None, max_pending: int = 1024,
                 watchdog_timeout: float = 60.0):
        """``client_index``: this API process's among ``endpoints.num_clients``;
        ``on_stats(engine_index, EngineStats)``; ``max_pending``: sequences in flight per engine
        from this API process."""
        self.engines = [
            AsyncEngineClient(endpoints, k, client_index, None if on_stats is None else _bind(on_stats, k),
                              max_pending, watchdog_timeout)
            for k in range(endpoints.num_engines)
        ]
        self.max_pending = max_pending
        self.ready: Ready | None = None
        self._next = 0  # round-robin start among equally loaded engines

    async def start(self) -> None:
        await asyncio.gather(*(e.start() for e in self.engines))
        readies = [e.ready for e in self.engines]
        # Same model and flags everywhere; the KV pool (sized from free memory) may differ a little.
        self.ready = Ready(min(r.max_model_len for r in readies), readies[0].vocab_size,
                           sum(r.num_kv_blocks for r in readies))

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(e.drain(timeout) for e in self.engines))

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines))

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: np.ndarray, params: SamplingParams, do_remote_decode: bool = False,
               remote_prefill: RemotePrefill | None = None) -> tuple[list[int], asyncio.Queue]:
        """``do_remote_decode``, ``remote_prefill``: disaggregated serving (``EngineCore.add_request``);
        any engine takes either (a lease names the engine it is on)."""
        engine = self._pick(params.n)
        self._next = (engine.engine_index + 1) % len(self.engines)
        return engine.submit(prompt, params, do_remote_decode, remote_prefill)

    def check_admission(self, n: int) -> None:
        """Raises unless some engine admits ``n`` more sequences now (the rotation stays put)."""
        self._pick(n)

    def abort(self, ids: list[int]) -> None:
        if ids:
            self.engines[ids[0] >> ENGINE_ID_SHIFT].abort(ids)

    def _pick(self, n: int) -> AsyncEngineClient:
        """The least-loaded engine that admits ``n`` more sequences; raises the reason none does."""
        size, best, error = len(self.engines), None, None
        for k in range(self._next, self._next + size):
            e = self.engines[k % size]
            try:
                e.check_admission(n)
            except (EngineDeadError, EngineOverloaded) as err:
                error = error if isinstance(error, EngineOverloaded) else err  # "overloaded" says more
                continue
            if best is None or e.num_pending < best.num_pending:
                best = e
        if best is None:
            raise error
        return best

    # ------------------------------------------------------------------ state
    @property
    def num_pending(self) -> int:
        return sum(e.num_pending for e in self.engines)

    @property
    def unavailable(self) -> str | None:
        """Why /health should answer 503 now: any engine down (the others still serve)."""
        down = [(e.engine_index, why) for e in self.engines if (why := e.unavailable)]
        if not down:
            return None
        if len(self.engines) == 1:
            return down[0][1]
        if len(down) == len(self.engines) and len({why for _, why in down}) == 1:
            return down[0][1]  # e.g. all draining: one reason, said once
        return f"degraded: {len(down)} of {len(self.engines)} engines down: " + \
            "; ".join(f"engine {k}: {why}" for k, why in down)


def _bind(on_stats, engine_index: int):
    return lambda stats: on_stats(engine_index, stats)
