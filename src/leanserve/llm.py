"""The offline API: ``LLM(model).generate(prompts, params)``, ``LLM.chat``, ``LLM.stream``.

Tokenization and detokenization run in the caller's thread; the engine loop runs in its own
thread and only ever sees int32 token arrays.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .engine.inproc_client import InprocClient, RequestStream
from .engine.config import EngineConfig
from .engine.core import EngineCore, prompt_from_token_ids
from .engine.output_processor import CompletionOutput, EngineRequestError, RequestOutputState
from .engine.params import SamplingParams
from .engine.structured import grammar_error
from .tokenizer import Tokenizer


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
        config = EngineConfig(model=model, **engine_args).resolve()
        self.tokenizer = Tokenizer.from_pretrained(config.model.path)
        self.client = InprocClient(lambda: EngineCore.from_config(config, self.tokenizer.eos_token_ids))
        self.engine = self.client.core
        # A script that never calls close(): stop the engine thread before the interpreter tears
        # down, or C++ kills the process mid-forward ("terminate called without an active exception").
        self._finalizer = weakref.finalize(self, self.client.shutdown)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ prompts
    def _to_ids(self, prompt) -> tuple[str | None, np.ndarray]:
        """The one conversion to int32, at the boundary. A prompt is text, token ids, or vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``."""
        if isinstance(prompt, dict):
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("prompt: a dict prompt has exactly one of 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, prompt_from_token_ids(prompt, self.engine.vocab_size)

    def chat_prompt(self, messages: list[dict]) -> np.ndarray:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """``prompts``: one prompt or a list (see ``_to_ids`` for the forms); ``sampling_params``:
        one for all, or one per prompt (vLLM's signature)."""
        single = isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: one SamplingParams per prompt, or a single one for all")
        for p in params_list:
            check_structured_outputs(p)
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

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool | None = None):
        """One conversation (a list of message dicts) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(m) for m in convs], sampling_params, use_tqdm)

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Text deltas of a single request as they are generated (n must be 1)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("n: stream() takes n=1")
        check_structured_outputs(params)
        _, ids = self._to_ids(prompt)
        (stream,) = self.client.submit(ids, params)
        out = RequestOutputState(self.tokenizer, params)
        try:
            for ev in stream:
                d = out.process(0, ev)
                if d is None:
                    continue
                if d.abort_engine:
                    self.client.abort([stream.request_id])
                if d.text or d.token_ids or d.finish_reason:
                    yield StreamDelta(0, d.text, d.token_ids, d.finish_reason)
                if d.finish_reason:
                    return
        finally:
            if not out.finished:  # the caller stopped reading early
                self.client.abort([stream.request_id])

    def _collect(self, text, ids, p: SamplingParams, streams: list[RequestStream]) -> RequestOutput:
        out = RequestOutputState(self.tokenizer, p)
        outputs = [CompletionOutput(i, logprobs=[] if p.logprobs is not None else None) for i in range(p.n)]
        for i, stream in enumerate(streams):
            for ev in stream:  # to the engine's own finishing event (after a stop string: its abort)
                try:
                    d = out.process(i, ev)
                except EngineRequestError as e:
                    raise RuntimeError(f"request failed in the engine: {e}") from None
                if d is None:
                    continue
                if d.abort_engine:
                    self.client.abort([stream.request_id])
                outputs[i].add(d)
        return RequestOutput(text, ids, outputs, out.num_cached_tokens, out.prompt_logprobs)


def check_structured_outputs(params: SamplingParams) -> None:
    """An invalid constraint is a ValueError here, in the caller's thread, not an engine error."""
    if params.structured_outputs is not None:
        error = grammar_error(params.structured_outputs)
        if error:
            raise ValueError(f"structured_outputs: {error}")


def _progress(total: int, use_tqdm: bool | None):
    if use_tqdm is False or (use_tqdm is None and total < 64):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
