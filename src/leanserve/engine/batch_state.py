"""The persistent batch: per-slot numpy arrays for every running request.

A running request owns a slot from admission to finish (or preemption). Everything the loop
touches each iteration (token counts, block tables, last token, sampling settings, stop
conditions) lives here as arrays indexed by slot, so scheduling, input preparation, stop checks
and output are vectorised over the batch instead of looping over Python objects. Per-request
fields are written once at admission; an iteration only applies diffs (a new block, a new token).

Where each piece of a request's state lives (one home at any time; moved, never mirrored):

=====================  ==========================  =======================================
state                  WAITING (new or preempted)  RUNNING
=====================  ==========================  =======================================
prompt token ids       ``Request.prompt``          ``Request.prompt`` (never copied)
output token ids       ``Request.saved_output``    ``out_tokens[slot]``, moved in at
                       (None if never ran)         admission, out again at preemption
tokens computed (KV)   none (recomputed)           ``num_computed[slot]``
KV block ids           none (freed)                ``block_table[slot, :num_blocks[slot]]``
full-block hash keys   ``Request.block_keys``      ``Request.block_keys``
random generator       ``Request.generator``       ``Request.generator`` (read via
                                                   ``requests[slot]`` when sampling)
grammar matcher        ``Request.grammar``         ``Request.grammar`` (same), and
                                                   ``constrained[slot]``
sampling, stop rules   ``Request.params``          per-slot arrays, written at admission
=====================  ==========================  =======================================

``Request.num_computed_tokens`` and ``Request.block_ids`` read the RUNNING column through the
request's slot. Only the scheduler changes this state: at admission, preemption and finish,
and after each step in ``Scheduler.update_from_output``.
"""

from __future__ import annotations

import numpy as np

from .request import Request


def blocks_needed(num_tokens, block_size: int):
    """KV blocks that hold ``num_tokens`` tokens (ceil division; ints or numpy arrays)."""
    return -(-num_tokens // block_size)


class BatchState:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, eos_token_ids=()):
        s = max_num_seqs
        self.capacity = s
        self.block_size = block_size
        self.max_blocks = blocks_needed(max_model_len, block_size)
        self.requests: list[Request | None] = [None] * s
        self.request_id = np.full(s, -1, np.int64)
        self.num_prompt = np.zeros(s, np.int64)
        self.num_tokens = np.zeros(s, np.int64)  # prompt + output tokens known so far
        self.num_computed = np.zeros(s, np.int64)  # tokens whose KV is in the cache
        self.num_blocks = np.zeros(s, np.int64)
        self.block_table = np.zeros((s, self.max_blocks), np.int64)
        self.out_tokens = np.zeros((s, max_model_len), np.int32)
        self.last_token = np.zeros(s, np.int32)
        self.num_cached = np.zeros(s, np.int32)  # prompt tokens served by the prefix cache
        # stop conditions
        self.max_model_len = max_model_len
        self.stop_len = np.zeros(s, np.int64)  # finish at this many tokens: min(prompt + max_tokens, max_model_len)
        self.min_total = np.zeros(s, np.int64)  # prompt + min_tokens: EOS/stop ids are masked below it
        # Token ids that end each request: its stop_token_ids plus EOS (unless ignore_eos), so the
        # stop check is one comparison over the batch.
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        # As wide as the most stop ids any request has used (grows on demand; usually 1: EOS).
        self.stop_ids = np.full((s, max(1, len(self.eos_token_ids))), -1, np.int32)
        # sampling settings
        self.temperature = np.zeros(s, np.float32)
        self.top_p = np.ones(s, np.float32)
        self.top_k = np.zeros(s, np.int64)
        self.min_p = np.zeros(s, np.float32)
        self.repetition_penalty = np.ones(s, np.float32)
        self.presence_penalty = np.zeros(s, np.float32)
        self.frequency_penalty = np.zeros(s, np.float32)
        self.penalized = np.zeros(s, np.bool_)  # any of the three penalties set
        # Anything beyond plain sampling (penalties, min_tokens, logprobs): one flag, so a batch
        # without such requests skips all of those checks.
        self.special = np.zeros(s, np.bool_)
        self.num_logprobs = np.full(s, -1, np.int64)
        self.seeded = np.zeros(s, np.bool_)
        self.constrained = np.zeros(s, np.bool_)  # has a grammar matcher (structured outputs)
        self._free_slots = list(range(s - 1, -1, -1))

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def add(self, req: Request, num_computed: int, block_ids: list[int]) -> int:
        """Gives a request a slot, its KV blocks and ``num_computed`` tokens already in them
        (prefix hits), and moves its saved output tokens (after a preemption) in."""
        slot = self._free_slots.pop()
        p = req.params
        req.batch, req.slot = self, slot
        self.requests[slot] = req
        self.request_id[slot] = req.request_id
        n_prompt = req.num_prompt_tokens
        n_out = 0 if req.saved_output is None else len(req.saved_output)
        if n_out:
            self.out_tokens[slot, :n_out] = req.saved_output
            req.saved_output = None
        self.num_prompt[slot] = n_prompt
        self.num_tokens[slot] = n_prompt + n_out
        self.num_computed[slot] = num_computed
        self.block_table[slot, : len(block_ids)] = block_ids
        self.num_blocks[slot] = len(block_ids)
        self.last_token[slot] = self.out_tokens[slot, n_out - 1] if n_out else req.prompt[-1]
        self.stop_len[slot] = min(n_prompt + p.max_tokens, self.max_model_len)
        self.min_total[slot] = n_prompt + p.min_tokens
        self.num_cached[slot] = req.num_cached_tokens
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
        if len(stops) > self.stop_ids.shape[1]:
            grown = np.full((self.capacity, len(stops)), -1, np.int32)
            grown[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = grown
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(stops)] = stops
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = p.top_k if p.top_k > 0 else 0
        self.min_p[slot] = p.min_p
        self.repetition_penalty[slot] = p.repetition_penalty
        self.presence_penalty[slot] = p.presence_penalty
        self.frequency_penalty[slot] = p.frequency_penalty
        self.penalized[slot] = p.uses_penalties
        self.special[slot] = p.uses_penalties or p.min_tokens > 0 or p.logprobs is not None
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.seeded[slot] = req.generator is not None
        self.constrained[slot] = req.grammar is not None
        return slot

    def remove(self, slot: int, keep_output: bool = False) -> list[int]:
        """Frees the slot; returns the KV block ids it held (for the caller to give back).
        ``keep_output``: a preemption, whose output tokens move to ``Request.saved_output``."""
        req = self.requests[slot]
        if keep_output:
            req.saved_output = self.output_tokens(slot).copy()
        block_ids = self.block_ids(slot)
        req.batch, req.slot = None, -1
        self.requests[slot] = None
        self.request_id[slot] = -1
        self.num_blocks[slot] = 0
        self._free_slots.append(slot)
        return block_ids

    def block_ids(self, slot: int) -> list[int]:
        return self.block_table[slot, : self.num_blocks[slot]].tolist()

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = self.num_blocks[slot]
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)

    def output_tokens(self, slot: int) -> np.ndarray:
        return self.out_tokens[slot, : self.num_tokens[slot] - self.num_prompt[slot]]

    def tokens(self, req: Request, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of a request: prompt, then output. Views where possible."""
        p = req.num_prompt_tokens
        if end <= p:
            return req.prompt[start:end]
        out = self.out_tokens[req.slot] if req.slot >= 0 else req.saved_output
        if start >= p:
            return out[start - p : end - p]
        return np.concatenate((req.prompt[start:], out[: end - p]))
