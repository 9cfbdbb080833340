"""Engine events -> what a caller reads: the one output processor of the server and the offline API.

A ``RequestOutputState`` follows one request (its n samples): it detokenizes incrementally,
matches stop strings (and says when that ends a sample the engine is still running, so the
caller aborts it), gathers logprobs and prompt logprobs, and counts usage. The server shapes
its deltas into OpenAI chunks; the offline API accumulates them into ``CompletionOutput``s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .params import SamplingParams
from .request import FinishReason

# {"token_id": id, "logprob": float, "top": [(alternative id, logprob), ...] best first}
TokenLogprob = dict


class EngineRequestError(RuntimeError):
    """The engine failed the request (or the engine itself failed); the message says why."""


@dataclass
class SampleDelta:
    """What one engine event means for one sample."""

    index: int  # sample index within the request
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: str | None = None  # the stop string that ended it
    abort_engine: bool = False  # ended here by a stop string: the engine is still running it


@dataclass
class CompletionOutput:
    """One sample, accumulated (offline API and non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | None = None

    def add(self, d: SampleDelta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        self.finish_reason = d.finish_reason or self.finish_reason
        self.stop_reason = d.stop_reason or self.stop_reason


class RequestOutputState:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.params = params
        self._detoks = [IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop,
                                               params.include_stop_str_in_output) for _ in range(params.n)]
        self.live = set(range(params.n))  # samples not finished yet (as the caller sees them)
        self.completion_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        # Per prompt position: None (the first token, or not asked for) or (logprob, top).
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    @property
    def finished(self) -> bool:
        return not self.live

    def process(self, i: int, ev) -> SampleDelta | None:
        """One engine event (a ``TokenEvent``) for sample ``i``; None when it has nothing for the
        caller (the sample already ended, e.g. by a stop string before the engine's abort
        confirmation). Raises EngineRequestError for an engine error."""
        if i not in self.live:
            return None
        if ev.error:
            self.live.clear()
            raise EngineRequestError(ev.error)
        if ev.prompt_logprobs is not None and i == 0 and self.prompt_logprobs is not None:
            lp, ids, top = ev.prompt_logprobs
            self.prompt_logprobs += [(float(lp[j]), list(zip(ids[j].tolist(), top[j].tolist())))
                                     for j in range(len(lp))]
        tokens, lps = [], None
        if ev.token_id >= 0:
            self.num_cached_tokens = max(self.num_cached_tokens, ev.num_cached_tokens)
            tokens = [ev.token_id]
            self.completion_tokens += 1
            if self.params.logprobs is not None:
                lps = [{"token_id": ev.token_id, "logprob": ev.logprob, "top": ev.top or []}]
        detok = self._detoks[i]
        text, finish = detok.step(ev.token_id, FinishReason(ev.finish_reason).openai)
        if finish:
            self.live.discard(i)
        by_string = detok.stopped_on is not None
        return SampleDelta(i, text, tokens, lps, finish, detok.stopped_on,
                           abort_engine=by_string and ev.finish_reason == FinishReason.NONE)
