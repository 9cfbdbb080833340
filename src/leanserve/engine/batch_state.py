"""The persistent batch: per-slot numpy arrays for every running request.

A running request owns a slot from admission to finish. Everything the loop touches each
iteration (token counts, block tables, last token, sampling settings, stop conditions) lives
here as arrays indexed by slot, so scheduling, input preparation, stop checks and output are
vectorised over the batch instead of looping over Python objects. Per-request fields are
written once at admission; an iteration only applies diffs (a new block, a new token).
"""

from __future__ import annotations

import numpy as np

from .request import Request


class BatchState:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, eos_token_ids=()):
        s = max_num_seqs
        self.capacity = s
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
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
        self._free_slots = list(range(s - 1, -1, -1))

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def add(self, req: Request) -> int:
        slot = self._free_slots.pop()
        p = req.params
        req.slot = slot
        self.requests[slot] = req
        self.request_id[slot] = req.request_id
        n_prompt = req.num_prompt_tokens
        n_out = 0 if req.saved_output is None else len(req.saved_output)
        if n_out:
            self.out_tokens[slot, :n_out] = req.saved_output
            req.saved_output = None
        self.num_prompt[slot] = n_prompt
        self.num_tokens[slot] = n_prompt + n_out
        self.num_computed[slot] = req.num_computed_tokens
        self.set_blocks(slot, req.block_ids)
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
        self.seeded[slot] = req.seed is not None
        return slot

    def remove(self, slot: int) -> None:
        self.requests[slot] = None
        self.request_id[slot] = -1
        self.num_blocks[slot] = 0
        self._free_slots.append(slot)

    def set_blocks(self, slot: int, block_ids: list[int]) -> None:
        self.block_table[slot, : len(block_ids)] = block_ids
        self.num_blocks[slot] = len(block_ids)

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
