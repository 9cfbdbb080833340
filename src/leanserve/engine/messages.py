"""The engine's messages: what goes in (Add, Abort), what comes out (one StepOutput per
iteration, read per request with ``demux``), and, between the API process and the engine-core
process (ZeroMQ + msgspec), start-up, rejections and stats.

API -> engine (PUSH/PULL), multipart: frame 0 is a msgpack-encoded ``Add`` or ``Abort``; an
``Add`` carries the prompt as frame 1, the raw int32 buffer, which the engine wraps with
``np.frombuffer`` without copying.
Engine -> API (PUSH/PULL): one ``StepOutput`` per iteration, and an ``EngineStats`` snapshot
every half second (counters, gauges and the iteration rows recorded since the last one), which
doubles as the engine's heartbeat. An engine serving several API processes (``--api-server-count``)
sends every message to each of them; each reads the rows whose ids it gave out (``RequestIds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import msgspec
import numpy as np

from .kv_transfer.messages import KVLease, RemotePrefill
from .params import SamplingParams
from .request import FinishReason

if TYPE_CHECKING:
    from .sampler import SamplerOutput
    from .scheduler import StepResult

# The engine sends an EngineStats snapshot at least this often, idle or not: its heartbeat.
STATS_PERIOD_S = 0.5


class StepOutput(msgspec.Struct, array_like=True, gc=False):
    """Everything one iteration produced, as flat arrays: one message per iteration, not per token.

    Row i: request ``request_ids[i]`` got token ``token_ids[i]`` (-1: no token, a failed step)
    and finished with ``finish_reasons[i]`` (0: still running). Logprob arrays are present only
    when some row asked for them (rows that did not are NaN / -1). ``aborted`` lists the requests
    the iteration aborted (no token, no row). ``errors`` says why a request ended with ERROR,
    whether it has a row or not (a grammar that failed to compile, a KV transfer that failed:
    no row). ``leases`` are the finished prefills whose blocks wait for a decode worker.
    """

    request_ids: bytes  # int64
    token_ids: bytes  # int32
    finish_reasons: bytes  # int8
    num_cached_tokens: bytes  # int32, prompt tokens served from the prefix cache (usage reporting)
    logprobs: bytes | None = None  # float32 [rows]
    top_ids: bytes | None = None  # int32 [rows, k]
    top_logprobs: bytes | None = None  # float32 [rows, k]
    top_k: int = 0
    prompt_logprobs: dict[int, tuple[bytes, bytes, bytes, int]] = {}  # id -> (logprob, top ids, top lps, k)
    errors: dict[int, str] = {}
    aborted: bytes = b""  # int64
    leases: list[KVLease] = []

    @classmethod
    def of_step(cls, result: "StepResult", sampled: "SamplerOutput",
                prompt_logprobs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], aborted: list[int],
                rejected: dict[int, str] | None = None):
        """Packs a step: the scheduler's result rows, the sampler's logprobs (if any row asked),
        prompt logprobs by request id, the ids aborted this iteration, and requests that ended
        before they ran (``rejected``: id -> error; they have no row)."""
        out = cls(result.request_ids.tobytes(), result.token_ids.tobytes(), result.finish_reasons.tobytes(),
                  result.num_cached_tokens.tobytes(), errors={**result.errors, **(rejected or {})},
                  leases=result.leases)
        if aborted:
            out.aborted = np.asarray(aborted, np.int64).tobytes()
        if sampled.logprobs is not None:
            out.logprobs = sampled.logprobs.numpy().astype(np.float32).tobytes()
            if sampled.top_ids is not None:
                out.top_k = sampled.top_ids.shape[1]
                out.top_ids = sampled.top_ids.numpy().astype(np.int32).tobytes()
                out.top_logprobs = sampled.top_logprobs.numpy().astype(np.float32).tobytes()
        if prompt_logprobs:
            out.prompt_logprobs = {rid: (lp.tobytes(), ids.tobytes(), tlp.tobytes(), ids.shape[1])
                                   for rid, (lp, ids, tlp) in prompt_logprobs.items()}
        return out

    @classmethod
    def of_failure(cls, request_ids: list[int], error: str, aborted: list[int]):
        """A step that failed: its requests end with ``error``, without a token."""
        k = len(request_ids)
        return cls(np.asarray(request_ids, np.int64).tobytes(), np.full(k, -1, np.int32).tobytes(),
                   np.full(k, FinishReason.ERROR, np.int8).tobytes(), np.zeros(k, np.int32).tobytes(),
                   errors={rid: error for rid in request_ids}, aborted=np.asarray(aborted, np.int64).tobytes())

    @classmethod
    def of_aborts(cls, aborted: list[int], rejected: dict[int, str] | None = None):
        return cls(b"", b"", b"", b"", errors=rejected or {}, aborted=np.asarray(aborted, np.int64).tobytes())

    def arrays(self):
        return (
            np.frombuffer(self.request_ids, np.int64),
            np.frombuffer(self.token_ids, np.int32),
            np.frombuffer(self.finish_reasons, np.int8),
            np.frombuffer(self.num_cached_tokens, np.int32),
        )


@dataclass
class TokenEvent:
    token_id: int  # -1: no token (abort / error)
    finish_reason: FinishReason
    num_cached_tokens: int = 0
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    error: str | None = None
    kv_lease: KVLease | None = None  # on a prefill's finishing event: its blocks wait for a decode worker


def demux(out: StepOutput, owner: RequestIds | None = None) -> Iterator[tuple[int, TokenEvent]]:
    """One event per row. With ``owner``, only the rows whose ids it gave out are read: an engine
    serving several API processes sends each of them every step (the few aborted and failed ids
    all pass; readers ignore ids they do not hold). A row that cannot be read becomes an error
    event for its own request: one request's output never stops the others' (the reader is shared)."""
    ids, toks, reasons, cached = out.arrays()
    lps = np.frombuffer(out.logprobs, np.float32) if out.logprobs is not None else None
    k = out.top_k
    top_ids = np.frombuffer(out.top_ids, np.int32).reshape(-1, k) if k else None
    top_lps = np.frombuffer(out.top_logprobs, np.float32).reshape(-1, k) if k else None
    leases = {lease.request_id: lease for lease in out.leases}
    rows = range(len(ids)) if owner is None else np.flatnonzero(owner.holds(ids)).tolist()
    id_list = ids.tolist()
    for i in rows:
        rid = id_list[i]
        try:
            ev = TokenEvent(int(toks[i]), FinishReason(int(reasons[i])), int(cached[i]))
            if lps is not None:
                ev.logprob = float(lps[i])
                if k:
                    ev.top = list(zip(top_ids[i].tolist(), top_lps[i].tolist()))
            if rid in out.prompt_logprobs:
                ev.prompt_logprobs = _prompt_logprobs(*out.prompt_logprobs[rid])
            if rid in out.errors:
                ev.error = out.errors[rid]
            ev.kv_lease = leases.get(rid)
        except Exception as e:  # noqa: BLE001 - reported to the one request it concerns
            ev = TokenEvent(-1, FinishReason.ERROR, error=f"could not read the engine's output: {e!r}")
        yield rid, ev
    for rid in np.frombuffer(out.aborted, np.int64).tolist():
        yield rid, TokenEvent(-1, FinishReason.ABORT)
    if out.errors:
        listed = set(id_list)
        for rid, error in out.errors.items():
            if rid not in listed:
                yield rid, TokenEvent(-1, FinishReason.ERROR, error=error)


def _prompt_logprobs(lp: bytes, ids: bytes, tlp: bytes, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob per position, top-k ids, top-k logprobs); k may be 0 (``logprobs: 0`` asks for
    the prompt tokens' own logprobs and no alternatives), so rows come from ``lp``, not from k."""
    lp = np.frombuffer(lp, np.float32)
    return lp, np.frombuffer(ids, np.int32).reshape(len(lp), k), np.frombuffer(tlp, np.float32).reshape(len(lp), k)


# An engine request id names its holder in its top bits: [engine index | API process index |
# counter]. An abort finds its engine with a shift (no per-request table), and an API process
# picks its own rows out of a step sent to all of them with one vectorised compare.
ENGINE_ID_SHIFT = 48
CLIENT_ID_SHIFT = 40  # 2^40 ids per API process and engine: 12 days at a million requests/s
MAX_CLIENTS = 1 << (ENGINE_ID_SHIFT - CLIENT_ID_SHIFT)  # API processes the id layout can tell apart


class RequestIds:
    """The engine request ids one API process (``client``) gives out for one ``engine``: a request
    of n samples takes n consecutive ids, ``base .. base + n - 1`` (the engine derives the
    samples' ids from ``Add.request_id`` the same way)."""

    def __init__(self, engine: int = 0, client: int = 0):
        self._prefix = engine << (ENGINE_ID_SHIFT - CLIENT_ID_SHIFT) | client
        self._next = self._prefix << CLIENT_ID_SHIFT

    def take(self, n: int) -> int:
        base, self._next = self._next, self._next + n
        return base

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (int64) were given out here."""
        return (ids >> CLIENT_ID_SHIFT) == self._prefix


class Add(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: int
    params: SamplingParams
    arrival_time: float
    # Disaggregated serving: keep the prompt's blocks for a decode worker when finished (prefill
    # side), or take the prompt's KV from a prefill worker (decode side).
    do_remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


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


class KVTransferStats(msgspec.Struct, array_like=True, gc=False):
    """Disaggregated serving's counters: transfers pulled in (decode side), leases kept (prefill side)."""

    transfers_started: int
    transfers_completed: int
    transfers_failed: int
    received_bytes: int
    sent_bytes: int
    leases_created: int
    leases_expired: int
    leases_held: int
    num_waiting_for_kv: int
    transfer_times: list[float]  # seconds, pull sent -> blocks written, since the last snapshot


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
    kv_transfer: KVTransferStats | None = None  # None: the engine moves no KV


class Step(msgspec.Struct, tag="step", array_like=True, gc=False):
    out: StepOutput


class Exited(msgspec.Struct, tag="exited", array_like=True):
    """An engine has died, said for it by the launcher on the engine's output sockets: a Ray actor
    (engine/ray_engines.py) may be on another machine, where no pidfd reaches."""

    reason: str


ToEngine = Add | Abort
FromEngine = Step | EngineStats | Ready | Rejected | Exited
