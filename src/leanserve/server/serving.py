"""Completions and chat completions: one generation stream shared by both, then OpenAI shapes.

A ``Generation`` submits one engine request and reads its events through the shared output
processor (``engine/output_processor.py``: detokenization, stop strings, logprobs, usage) as
per-choice deltas, observes latency metrics, and, when the consumer goes away (client
disconnect, error), aborts whatever is still running, so the engine frees the request's blocks
within one iteration. The rest of this module is OpenAI shaping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec
import numpy as np
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..engine.async_client import EngineDeadError, EngineOverloaded
from ..engine.dp_client import DataParallelClient
from ..engine.core import prompt_from_token_ids, validate_request
from ..engine.kv_transfer.config import KVTransferConfig
from ..engine.kv_transfer.messages import KVLease, RemotePrefill
from ..engine.output_processor import CompletionOutput, EngineRequestError, RequestOutputState, SampleDelta
from ..engine.params import SamplingParams
from ..tokenizer import Tokenizer
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, KVTransferParams,
                       bad_request_from, error_body, error_type)
from .structured_outputs import constraint, resolve_tool_choice
from .tool_calls import make_parser, parse_all

log = logging.getLogger("leanserve.server")


@dataclass
class ServerState:
    engine: DataParallelClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" works
    sampling_defaults: dict = field(default_factory=dict)  # --generation-config; request fields override
    kv_transfer: KVTransferConfig | None = None  # disaggregated serving: this worker's role


def usage_json(gens: list[Generation]) -> dict:
    prompt = sum(g.prompt_len for g in gens)
    completion = sum(g.output.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.output.num_cached_tokens for g in gens)}}


class Generation:
    """One engine request (its n samples), read as SampleDeltas with choice indices.

    It is submitted when made, so admission (503) is decided before any response starts, and
    from then on it owns the engine's work: ``aclose()`` aborts whatever still runs, on every
    way out (finished, stop string, error, client gone). Consumers close it with
    ``contextlib.aclosing``; ``start_all`` submits several all-or-nothing.
    """

    def __init__(self, state: ServerState, prompt: np.ndarray, params: SamplingParams, index_base: int = 0,
                 kv: KVHandOff | None = None):
        kv = kv or KVHandOff()
        try:
            self.ids, self._queue = state.engine.submit(prompt, params, kv.do_remote_decode, kv.remote_prefill)
        except (EngineDeadError, EngineOverloaded) as e:
            raise APIError(503, str(e)) from None
        self.prompt_len = len(prompt)
        self.output = RequestOutputState(state.tokenizer, params)
        self.kv_lease: KVLease | None = None  # a prefill's blocks, kept for the decode worker
        self._state, self._index_base = state, index_base
        self._events = self._deltas()

    @staticmethod
    def start_all(state: ServerState,
                  jobs: list[tuple[np.ndarray, SamplingParams, int, KVHandOff]]) -> list[Generation]:
        started: list[Generation] = []
        try:
            for job in jobs:
                started.append(Generation(state, *job))
        except BaseException:
            for g in started:
                g.abort()
            raise
        return started

    def __aiter__(self) -> AsyncIterator[SampleDelta]:
        return self._events

    async def aclose(self) -> None:
        await self._events.aclose()
        self.abort()

    def abort(self) -> None:
        live = self.output.live
        if live:
            self._state.engine.abort([self.ids[i] for i in live])
            live.clear()

    def release_kv_lease(self) -> None:
        """No decode worker will pull this prefill's blocks: the engine frees them now."""
        if self.kv_lease is not None:
            self._state.engine.abort([self.kv_lease.request_id])
            self.kv_lease = None

    async def _deltas(self) -> AsyncIterator[SampleDelta]:
        metrics, out = self._state.metrics, self.output
        start = time.monotonic()
        last = [None] * out.params.n
        while not out.finished:
            i, ev = await self._queue.get()
            try:
                d = out.process(i, ev)
            except EngineRequestError:
                metrics.request_finished("error")
                raise
            if ev.kv_lease is not None:
                self.kv_lease = ev.kv_lease
                if d is None or d.finish_reason != "length":  # it ended on a stop string: nothing to decode
                    self.release_kv_lease()
            if d is None:
                continue
            now = time.monotonic()
            if d.token_ids:
                (metrics.ttft if last[i] is None else metrics.itl).observe(now - (last[i] or start))
                last[i] = now
            if d.abort_engine:
                self._state.engine.abort([self.ids[i]])
            if d.finish_reason:
                metrics.e2e.observe(now - start)
                metrics.request_finished(d.finish_reason)
            d.index += self._index_base
            yield d


async def merge(gens: list[Generation]) -> AsyncIterator[SampleDelta]:
    """Interleaves several generations (a completions request with several prompts); closing the
    merged stream closes every one of them."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]):
            async for p in gens[0]:
                yield p
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g: Generation):
        try:
            async with contextlib.aclosing(g):
                async for p in g:
                    await q.put(p)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await q.put(e)
        finally:
            await q.put(done)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:  # a pump cancelled before it started never entered its ``aclosing``
            g.abort()


# ---------------------------------------------------------------------------------- disaggregated serving


@dataclass
class KVHandOff:
    """What a request asks of KV transfer: keep its prompt's blocks for a decode worker, or take
    its prompt's KV from a prefill worker's lease."""

    do_remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


def _kv_hand_off(state: ServerState, params: KVTransferParams | None, num_prompts: int, stream: bool,
                 prompt_logprobs: int | None) -> KVHandOff:
    """A server without ``--kv-transfer-config`` ignores ``kv_transfer_params``, as it always did."""
    if params is None or state.kv_transfer is None:
        return KVHandOff()
    if params.do_remote_prefill:
        if num_prompts != 1:
            raise APIError(400, "kv_transfer_params: a remote prefill holds one prompt's KV; this request has "
                                f"{num_prompts} prompts", "kv_transfer_params")
        return KVHandOff(remote_prefill=_remote_prefill(params))
    # A decode worker takes the KV of one prompt, and computes only its last position: a stream, or
    # a request for every prompt position's logprobs, is answered here in full (as vLLM's prefill
    # leg, only a whole answer hands off).
    hand_off = params.do_remote_decode and state.kv_transfer.is_producer and not stream and num_prompts == 1 \
        and prompt_logprobs is None
    return KVHandOff(do_remote_decode=hand_off)


def _remote_prefill(p: KVTransferParams) -> RemotePrefill:
    for name in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
                 "remote_epoch"):
        if getattr(p, name) is None:
            raise APIError(400, f"kv_transfer_params.{name}: required with do_remote_prefill",
                           f"kv_transfer_params.{name}")
    return RemotePrefill(p.remote_engine_id, p.remote_request_id, p.remote_epoch, p.remote_block_ids,
                         p.remote_host, p.remote_port, p.remote_num_cached_tokens)


def _kv_transfer_params(gen: Generation) -> dict | None:
    """The answer's ``kv_transfer_params`` (vLLM's fields): where the decode worker finds the KV."""
    lease = gen.kv_lease
    if lease is None:
        return None
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": lease.engine_id,
            "remote_request_id": lease.request_id, "remote_block_ids": lease.block_ids, "remote_host": lease.host,
            "remote_port": lease.port, "remote_epoch": lease.epoch,
            "remote_num_cached_tokens": lease.num_cached_tokens}


async def _collect_answer(request: Request, deltas: AsyncIterator[SampleDelta], n_choices: int,
                          gens: list[Generation]) -> list[CompletionOutput]:
    """A whole answer's choices; a prefill's kept blocks are released if it cannot be given."""
    try:
        return await _collect_unless_disconnected(request, deltas, n_choices)
    except BaseException:
        gens[0].release_kv_lease()
        raise


# ---------------------------------------------------------------------------------- helpers


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def _check_capacity(state: ServerState, n: int, param: str) -> None:
    """Fails fast, before any tokenization or submission; ``submit`` enforces the same limit
    atomically (several requests may pass this check before any of them submits)."""
    if n > state.engine.max_pending:  # could never be admitted, even on an idle server
        raise APIError(400, f"{param}: this request needs {n} sequences, more than the server admits at once "
                            f"(--max-waiting-requests={state.engine.max_pending})", param)
    try:
        state.engine.check_admission(n)
    except (EngineDeadError, EngineOverloaded) as e:
        raise APIError(503, str(e)) from None


def _check_text_length(state: ServerState, num_chars: int, param: str) -> None:
    """Rejects text that cannot fit the context before it is tokenized: a token covers at most
    ``max_token_chars`` characters, so longer text has more than ``max_model_len`` tokens.
    (Tokenizing a 20 MB prompt only to reject it took ~20 s and kept 1.3 GB of RSS.)"""
    if num_chars > state.max_model_len * state.tokenizer.max_token_chars:
        raise APIError(400, f"{param}: {num_chars} characters cannot fit in max_model_len={state.max_model_len} "
                            "tokens", param)


def _validate(state: ServerState, prompt_len: int, params: SamplingParams) -> None:
    try:
        validate_request(prompt_len, params, state.max_model_len, state.vocab_size, state.max_logprobs)
    except ValueError as e:
        raise bad_request_from(e) from None


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _finite(logprob: float) -> float:
    """A token a grammar masked has logprob -inf, which JSON cannot hold (msgspec would write
    null); vLLM's -9999.0 stands in."""
    return max(logprob, -9999.0)


def _json(obj) -> bytes:
    return msgspec.json.encode(obj)


def _sse(obj) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


def _error_event(e: Exception) -> bytes:
    status = e.status if isinstance(e, APIError) else 500
    return _sse(error_body(str(e), error_type(status), None, status))


async def _stream(deltas: AsyncIterator[SampleDelta], chunk, final_chunk=None):
    """SSE: a chunk per delta that carries something, the usage chunk if asked for, [DONE]."""
    try:
        async with contextlib.aclosing(deltas):
            async for d in deltas:
                if d.text or d.token_ids or d.finish_reason:
                    yield _sse(chunk(d))
        if final_chunk is not None:
            yield _sse(final_chunk())
    except Exception as e:  # noqa: BLE001 - a mid-stream failure is reported in-band
        log.error("stream failed: %r", e, exc_info=not isinstance(e, (APIError, EngineRequestError)))
        yield _error_event(e)
    yield b"data: [DONE]\n\n"


def _sse_response(stream: AsyncIterator[bytes], gens: list[Generation]) -> StreamingResponse:
    # A client that leaves before the stream takes its first step leaves nothing to close inside
    # it (an unstarted generator runs no ``finally``); Starlette runs the background task after a
    # disconnect too, and it aborts whatever is left.
    async def abort_rest():  # async: it runs on the event loop, beside the engine client's sockets
        for g in gens:
            g.abort()

    return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(abort_rest))


async def _collect(deltas: AsyncIterator[SampleDelta], n_choices: int) -> list[CompletionOutput]:
    choices = [CompletionOutput(i) for i in range(n_choices)]
    try:
        async with contextlib.aclosing(deltas):
            async for d in deltas:
                choices[d.index].add(d)
    except EngineRequestError as e:
        raise APIError(500, f"generation failed: {e}") from None
    return choices


async def _collect_unless_disconnected(request: Request, deltas: AsyncIterator[SampleDelta],
                                       n_choices: int) -> list[CompletionOutput]:
    """A non-streaming request is aborted within one engine iteration when its client goes away,
    as a stream is: the body has been read, so the next ASGI message can only be the disconnect,
    and a watcher cancels the collection then (closing ``deltas`` sends the abort)."""
    collecting = asyncio.current_task()
    left = asyncio.Event()

    async def watch():
        await _wait_for_disconnect(request)
        left.set()
        collecting.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await _collect(deltas, n_choices)
    except asyncio.CancelledError:
        if left.is_set():
            raise APIError(499, "the client closed the request") from None  # nginx's code; nobody reads it
        raise
    finally:
        watcher.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------------- completions


async def prompt_ids(state: ServerState, text: str, add_special_tokens: bool = True) -> np.ndarray:
    """A text prompt -> token ids (completions and /tokenize)."""
    _check_text_length(state, len(text), "prompt")
    return await run_in_threadpool(state.tokenizer.encode, text, add_special_tokens)


async def _completion_prompts(state: ServerState, prompt) -> list[tuple[str | None, np.ndarray]]:
    tok = state.tokenizer
    if isinstance(prompt, str):
        return [(prompt, await prompt_ids(state, prompt))]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", "prompt")
    if isinstance(prompt[0], str):
        for i, text in enumerate(prompt):
            _check_text_length(state, len(text), f"prompt.{i}")
        encoded = await run_in_threadpool(tok.encode_batch, prompt)
        return list(zip(prompt, encoded))
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    try:
        return [(None, prompt_from_token_ids(ids, state.vocab_size)) for ids in lists]
    except ValueError as e:
        raise bad_request_from(e) from None


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    _check_model(state, req.model)
    req.check_common()
    if req.suffix:
        raise APIError(400, "suffix: not supported", "suffix")
    spec = constraint(req)
    prompts = await _completion_prompts(state, req.prompt)
    per_prompt = []
    for _text, ids in prompts:
        max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else \
            state.sampling_defaults.get("max_tokens", req.max_tokens)
        if max_tokens is None:
            max_tokens = state.max_model_len - len(ids)
        params = req.sampling_params(max_tokens, req.logprobs, req.logprobs if req.echo and req.logprobs is not None
                                     else None, state.sampling_defaults)
        params.structured_outputs = spec
        _validate(state, len(ids), params)
        per_prompt.append(params)
    _check_capacity(state, req.n * len(prompts), "n" if len(prompts) == 1 else "prompt")
    kv = _kv_hand_off(state, req.kv_transfer_params, len(prompts), req.stream, per_prompt[0].prompt_logprobs)

    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    gens = Generation.start_all(state, [(ids, p, k * req.n, kv)
                                        for k, ((_, ids), p) in enumerate(zip(prompts, per_prompt))])
    deltas = merge(gens)
    tok = state.tokenizer
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    offsets = [0] * (len(prompts) * req.n)

    def logprobs_json(index, lps):
        if req.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in lps or []:
            s = _token_str(tok, t["token_id"])
            out["tokens"].append(s)
            out["token_logprobs"].append(t["logprob"])
            out["top_logprobs"].append({_token_str(tok, a): _finite(v) for a, v in t["top"]})
            out["text_offset"].append(offsets[index])
            offsets[index] += len(s)
        return out

    if req.stream:
        echoed = set()

        def chunk(d: SampleDelta):
            text = d.text
            if req.echo and d.index not in echoed:
                echoed.add(d.index)
                prompt_text = prompts[d.index // req.n][0] or tok.decode(prompts[d.index // req.n][1])
                text = prompt_text + text
            return {**head, "choices": [{"index": d.index, "text": text, "logprobs": logprobs_json(d.index, d.logprobs),
                                         "finish_reason": d.finish_reason}]}

        usage_chunk = (lambda: {**head, "choices": [], "usage": usage_json(gens)}) \
            if req.stream_options and req.stream_options.include_usage else None
        return _sse_response(_stream(deltas, chunk, usage_chunk), gens)

    choices = await _collect_answer(request, deltas, len(prompts) * req.n, gens)
    out = []
    for c in choices:
        text = c.text
        prompt_text, prompt_ids = prompts[c.index // req.n]
        lp = logprobs_json(c.index, c.logprobs) if req.logprobs is not None else None
        if req.echo:
            prompt_text = prompt_text if prompt_text is not None else tok.decode(prompt_ids)
            text = prompt_text + text
            if lp is not None:
                lp = _echo_logprobs(tok, prompt_ids, gens[c.index // req.n].output.prompt_logprobs, lp)
        out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    body = {**head, "choices": out, "usage": usage_json(gens)}
    if (kv_params := _kv_transfer_params(gens[0])) is not None:
        body["kv_transfer_params"] = kv_params
    return Response(_json(body), media_type="application/json")


def _echo_logprobs(tok, prompt_ids, prompt_lps, lp):
    rows = prompt_lps or [None] * len(prompt_ids)
    tokens = [_token_str(tok, t) for t in prompt_ids.tolist()]
    offsets = np.cumsum([0] + [len(s) for s in tokens])[:-1].tolist()
    shift = offsets[-1] + len(tokens[-1]) if tokens else 0
    return {
        "tokens": tokens + lp["tokens"],
        "token_logprobs": [None if r is None else r[0] for r in rows] + lp["token_logprobs"],
        "top_logprobs": [None if r is None else {_token_str(tok, t): v for t, v in r[1]} for r in rows]
        + lp["top_logprobs"],
        "text_offset": offsets + [o + shift for o in lp["text_offset"]],
    }


# ---------------------------------------------------------------------------------- chat


async def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list | None = None) -> np.ndarray:
    """Messages (and the tools, for templates that show them) -> the chat template -> token ids
    (chat completions and /tokenize)."""
    _check_text_length(state, sum(len(m.text()) for m in messages), "messages")
    kwargs = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
    try:
        text = await run_in_threadpool(state.tokenizer.apply_chat_template, [m.for_template() for m in messages],
                                       add_generation_prompt, **kwargs)
    except ValueError as e:
        raise bad_request_from(e) from None
    _check_text_length(state, len(text), "messages")
    return await run_in_threadpool(state.tokenizer.encode, text, False)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    _check_model(state, req.model)
    req.check_common()
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    tok = state.tokenizer
    tool_choice = resolve_tool_choice(req, state.tool_call_parser is not None)
    spec = constraint(req, tool_choice)
    ids = await chat_prompt_ids(state, req.messages, req.add_generation_prompt, req.tools)
    max_tokens = req.max_completion_tokens or req.max_tokens or state.sampling_defaults.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len - len(ids))
    params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None, None,
                                 state.sampling_defaults)
    params.structured_outputs = spec
    if tool_choice == "auto":
        params.skip_special_tokens = False  # a model's tool-call tags may be special tokens (vLLM does the same)
    _validate(state, len(ids), params)
    _check_capacity(state, req.n, "n")
    kv = _kv_hand_off(state, req.kv_transfer_params, 1, req.stream, None)

    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    gens = [Generation(state, ids, params, kv=kv)]
    deltas = merge(gens)
    head = {"id": rid, "created": created, "model": state.model_name}

    def logprobs_json(lps):
        if not req.logprobs:
            return None

        def entry(t, v):
            s = _token_str(tok, t)
            return {"token": s, "logprob": _finite(v), "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(t["token_id"], t["logprob"]), "top_logprobs": [entry(a, b) for a, b in t["top"]]}
                            for t in lps or []]}

    def finish_reason(reason: str | None, called: bool) -> str | None:
        # OpenAI's: "tool_calls" when the model called tools of its own choice ("auto", "required");
        # a named function's call ends with "stop".
        return "tool_calls" if called and reason == "stop" and isinstance(tool_choice, str) else reason

    if req.stream:
        started = set()
        parsers = [make_parser(tool_choice, state.tool_call_parser) for _ in range(req.n)]
        called = [False] * req.n

        def chunk(d: SampleDelta):
            delta, reason = {"content": d.text}, d.finish_reason
            parser = parsers[d.index]
            if parser is not None:
                content, calls = parser.feed(d.text)
                if reason:
                    rest, more = parser.finish()
                    content, calls = content + rest, calls + more
                called[d.index] = called[d.index] or bool(calls)
                delta = {"content": content} if content or not calls else {}
                if calls:
                    delta["tool_calls"] = [c.json() for c in calls]
                reason = finish_reason(reason, called[d.index])
            if d.index not in started:  # the role rides on the choice's first real chunk
                started.add(d.index)
                delta = {"role": "assistant", **delta}
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs_json(d.logprobs),
                                 "finish_reason": reason}]}

        usage_chunk = (lambda: {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage_json(gens)}) \
            if req.stream_options and req.stream_options.include_usage else None
        return _sse_response(_stream(deltas, chunk, usage_chunk), gens)

    choices = await _collect_answer(request, deltas, req.n, gens)
    out = []
    for c in choices:
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        parser = make_parser(tool_choice, state.tool_call_parser)
        if parser is not None:
            message["content"], calls = parse_all(parser, c.text)
            if calls:
                message["tool_calls"] = calls
            reason = finish_reason(reason, bool(calls))
        out.append({"index": c.index, "message": message, "logprobs": logprobs_json(c.logprobs),
                    "finish_reason": reason})
    body = {**head, "object": "chat.completion", "choices": out, "usage": usage_json(gens)}
    if (kv_params := _kv_transfer_params(gens[0])) is not None:
        body["kv_transfer_params"] = kv_params
    return Response(_json(body), media_type="application/json")
