"""A request as the engine holds it.

The prompt is held as the int32 array it arrived as: never copied, never turned back into a
Python list. Output tokens live in the batch's per-slot buffer while the request runs
(see :mod:`batch_state`); only a preempted request keeps its own copy.
"""

from __future__ import annotations

import enum
import time

import numpy as np

from .params import SamplingParams


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


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
        "request_id", "prompt", "params", "num_prompt_tokens", "status", "slot", "block_ids", "block_keys",
        "num_computed_tokens", "num_cached_tokens", "saved_output", "prefix_parent", "arrival_time",
        "first_scheduled_time", "num_preemptions", "seed",
    )

    def __init__(self, request_id: int, prompt: np.ndarray, params: SamplingParams, seed: int | None = None,
                 prefix_parent: "Request | None" = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.num_prompt_tokens = len(prompt)
        self.status = Status.WAITING
        self.slot = -1
        self.block_ids: list[int] = []
        self.block_keys: list[bytes] = []  # keys of the request's full blocks, in order
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.saved_output: np.ndarray | None = None  # output tokens, kept only while preempted
        # n > 1: siblings wait for the first sample's prompt to be computed, then share its blocks.
        self.prefix_parent = prefix_parent
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.seed = seed
