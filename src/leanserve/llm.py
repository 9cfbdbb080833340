"""The offline API: ``LLM(model).generate(prompts, params)``, ``LLM.chat``, ``LLM.stream``.

Tokenization and detokenization run in the caller's thread; the engine loop runs in its own
thread and only ever sees int32 token arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .engine.client import InprocClient, RequestStream
from .engine.config import EngineConfig
from .engine.core import EngineCore
from .engine.params import SamplingParams
from .model.loader import resolve_model_path
from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": [(id, logprob)]}
    stop_reason: str | None = None  # the stop string that ended it, if any


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: np.ndarray
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # [None, (logprob, [(id, logprob)...]), ...]


@dataclass
class StreamDelta:
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """``model``: a GGUF file or HF directory (default: SmolLM2-135M-Instruct); ``engine_args``:
        any EngineConfig field (dtype, max_num_seqs, kv_cache_memory, ...)."""
        path = resolve_model_path(model)
        self.tokenizer = Tokenizer.from_pretrained(path)
        config = EngineConfig(model=path, **engine_args)
        self.client = InprocClient(lambda: EngineCore(config, eos_token_ids=self.tokenizer.eos_token_ids))
        self.engine = self.client.core

    def close(self) -> None:
        self.client.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ prompts
    def _to_ids(self, prompt) -> tuple[str | None, np.ndarray]:
        """The one conversion to int32, at the boundary."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = np.asarray(prompt, dtype=np.int32)
        if ids.ndim != 1 or (len(ids) and (ids.min() < 0 or ids.max() >= self.engine.vocab_size)):
            raise ValueError(f"prompt: token ids must be a flat list in [0, {self.engine.vocab_size})")
        return None, ids

    def chat_prompt(self, messages: list[dict]) -> np.ndarray:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or a single one for all")
        submitted = []
        try:
            for prompt, p in zip(prompts, params_list):
                text, ids = self._to_ids(prompt)
                submitted.append((text, ids, p, self.client.submit(ids, p)))
        except ValueError:
            for *_, streams in submitted:
                self.client.abort([s.request_id for s in streams])
            raise
        bar = _progress(len(submitted), use_tqdm)
        results = []
        for text, ids, p, streams in submitted:
            results.append(self._collect(text, ids, p, streams))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return results

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool | None = None):
        """One conversation (a list of message dicts) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(m) for m in convs], params, use_tqdm)

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Text deltas of a single request as they are generated (n must be 1)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("n: stream() takes n=1")
        _, ids = self._to_ids(prompt)
        (stream,) = self.client.submit(ids, params)
        detok = self._detokenizer(params)
        for ev in stream:
            if ev.error:
                raise RuntimeError(ev.error)
            delta, finish = detok.step(ev.token_id, ev.finish_reason.openai)
            if detok.stopped_on is not None:
                self.client.abort([stream.request_id])
            if delta or finish or ev.token_id >= 0:
                yield StreamDelta(0, delta, [ev.token_id] if ev.token_id >= 0 else [], finish)
            if finish:
                return

    def _detokenizer(self, p: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop, p.include_stop_str_in_output)

    def _collect(self, text, ids, p: SamplingParams, streams: list[RequestStream]) -> RequestOutput:
        outputs = []
        cached = 0
        prompt_lps = None
        for i, stream in enumerate(streams):
            detok = self._detokenizer(p)
            tokens, lps = [], [] if p.logprobs is not None else None
            finish = None
            for ev in stream:
                if ev.error:
                    raise RuntimeError(f"request failed in the engine: {ev.error}")
                cached = max(cached, ev.num_cached_tokens)
                if ev.prompt_logprobs is not None and i == 0:
                    prompt_lps = (prompt_lps or []) + [ev.prompt_logprobs]
                if finish is not None:
                    continue  # ended by a stop string: drain until the engine confirms the abort
                _, finish = detok.step(ev.token_id, ev.finish_reason.openai)
                if ev.token_id >= 0:
                    tokens.append(ev.token_id)
                    if lps is not None:
                        lps.append({"token_id": ev.token_id, "logprob": ev.logprob, "top": ev.top or []})
                if detok.stopped_on is not None:
                    self.client.abort([stream.request_id])
            outputs.append(CompletionOutput(i, detok.text, tokens, finish, lps, detok.stopped_on))
        return RequestOutput(text, ids, outputs, cached, _join_prompt_logprobs(prompt_lps))


def _join_prompt_logprobs(chunks) -> list | None:
    if chunks is None:
        return None
    out = [None]  # the first prompt token has no logprob
    for lp, ids, tlp in chunks:
        for j in range(len(lp)):
            out.append((float(lp[j]), list(zip(ids[j].tolist(), tlp[j].tolist()))))
    return out


def _progress(total: int, use_tqdm: bool | None):
    if use_tqdm is False or (use_tqdm is None and total < 64):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
