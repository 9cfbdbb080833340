"""Messages between the API process and the engine-core process (ZeroMQ + msgspec).

API -> engine (PUSH/PULL), multipart: frame 0 is a msgpack-encoded ``Add`` or ``Abort``; an
``Add`` carries the prompt as frame 1, the raw int32 buffer, which the engine wraps with
``np.frombuffer`` without copying.
Engine -> API (PUSH/PULL): one ``StepOutput`` per iteration, and an ``EngineStats`` snapshot
every half second (counters, gauges and the iteration rows recorded since the last one), which
doubles as the engine's heartbeat.
"""

from __future__ import annotations

import msgspec

from ..engine.params import SamplingParams
from ..engine.request import StepOutput

# The engine sends an EngineStats snapshot at least this often, idle or not: its heartbeat.
STATS_PERIOD_S = 0.5


class Add(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: int
    params: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[int]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    """An Add the engine refused at validation (the API validates first; this is the backstop)."""

    request_id: int
    error: str


class EngineStats(msgspec.Struct, tag="stats", array_like=True, gc=False):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_queries_total: int
    prefix_hits_total: int
    preemptions_total: int
    iterations: bytes  # float64 rows of engine.stats.FIELDS recorded since the last snapshot
    queue_times: list[float]
    current_step_s: float  # how long the iteration in progress has run (0 between iterations)


class Step(msgspec.Struct, tag="step", array_like=True, gc=False):
    out: StepOutput


ToEngine = Add | Abort
FromEngine = Step | EngineStats | Ready | Rejected
