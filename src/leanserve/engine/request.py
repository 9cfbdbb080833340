"""A request as the engine holds it.

The prompt is held as the int32 array it arrived as: never copied, never turned back into a
Python list. What changes every step while the request runs (computed-token count, block table,
output tokens) lives in the persistent batch (:mod:`batch_state`), and the request reads it
through its slot; see the table there for where each piece lives in each status.
"""

from __future__ import annotations

import enum
import time

import numpy as np
import torch

from .kv_transfer.messages import RemotePrefill
from .params import SamplingParams


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    # vLLM's name: a decode worker's request holding its slot and blocks while its prompt's KV
    # arrives from a prefill worker (``kv_transfer``); then RUNNING, its last prompt token a decode row.
    WAITING_FOR_REMOTE_KVS = 3


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # EOS or a stop token id (a stop string is decided by the frontend)
    LENGTH = 2
    ABORT = 3
    ERROR = 4

    @property
    def openai(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(self))


class Request:
    __slots__ = (
        "request_id", "prompt", "params", "num_prompt_tokens", "status", "batch", "slot", "block_keys",
        "num_cached_tokens", "saved_output", "prefix_parent", "arrival_time", "first_scheduled_time",
        "num_preemptions", "generator", "grammar", "kv_remote", "do_remote_decode", "prefix_cacheable",
    )

    def __init__(self, request_id: int, prompt: np.ndarray, params: SamplingParams,
                 generator: torch.Generator | None = None, prefix_parent: "Request | None" = None,
                 arrival_time: float | None = None, grammar=None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.num_prompt_tokens = len(prompt)
        self.status = Status.WAITING
        self.batch = None  # the BatchState holding the request while it runs (set with ``slot``)
        self.slot = -1
        self.block_keys: list[bytes] = []  # keys of the request's full blocks, in order
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.saved_output: np.ndarray | None = None  # output tokens, kept only while preempted
        # n > 1: siblings wait for the first sample's prompt to be computed, then share its blocks.
        self.prefix_parent = prefix_parent
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        # Seeded sampling: the request's own random stream. It lives here, not in a batch slot,
        # because it must continue where it was after a preemption gives the slot away.
        self.generator = generator
        # Structured outputs: the grammar matcher, advanced by every output token. Like the
        # generator it survives a preemption: output tokens are kept, so its state stays valid.
        self.grammar = grammar
        # Disaggregated serving (``kv_transfer``). Decode side: where the prompt's KV waits, until
        # it lands. Prefill side: keep the prompt's blocks for a decode worker when finished.
        self.kv_remote: RemotePrefill | None = None
        self.do_remote_decode = False
        # Whether the request's blocks enter the prefix cache. Not for prompts whose KV came from
        # another worker: their keys would be hashed here, on the loop, all at once (O(prompt)).
        self.prefix_cacheable = True

    # Read through the batch while running; a request out of the batch holds no blocks and has
    # no KV computed (preemption recomputes).
    @property
    def num_computed_tokens(self) -> int:
        return int(self.batch.num_computed[self.slot]) if self.slot >= 0 else 0

    @property
    def block_ids(self) -> list[int]:
        return self.batch.block_ids(self.slot) if self.slot >= 0 else []
