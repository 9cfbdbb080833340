"""The disaggregated request flow of issue 13, with vLLM's proxy's field names.

1. Prefill leg: the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1`` if the
   client set it), ``stream=false``, ``kv_transfer_params={"do_remote_decode": true}``, to a
   prefill worker; its whole answer is read. A client whose own limit is one token gets no
   ``kv_transfer_params`` there: its answer is final, and a worker would keep the prompt's KV
   for a decode leg that never comes, until its lease expires.
2. A prefill leg that fails never reaches a decode worker: any answer but a 200 (a 4xx for a
   bad request, a 5xx) goes to the client as the worker gave it; no answer at all is the
   router's 502 (or 503 when no prefill worker is up).
3. If the prefill answer finished the request — the client's own limit was 1 token, or no choice
   ended on our one-token cap (EOS, a stop string or stop token) — it is the answer: returned as
   is, or as an SSE stream if the client asked for one. No decode worker is called.
4. Otherwise the client's body plus the answer's ``kv_transfer_params`` goes to a decode worker
   (same path, same headers), and its answer is relayed unchanged, streaming or not.

Cancelling: a client that leaves cancels whichever leg is running (its connection closes, so
that worker aborts the request), and a failed decode leg is answered to the client; either way
the router does nothing more. The workers own the KV lease: the prefill worker keeps the
request's blocks until the decode worker confirms the transfer or the lease's deadline passes,
so a decode leg that never starts, fails or is cancelled costs at most one lease timeout of
prefill KV, and the router keeps no per-request state past the request.
"""

from __future__ import annotations

import msgspec

from .clock import Clock
from .pool import Pool
from .upstream import Headers, Send, Upstream, UpstreamError, response_headers

CHAT_PATH = "/v1/chat/completions"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]  # as a leanserve server's streams


async def run(up: Upstream, prefill: Pool, decode: Pool, path: str, headers: Headers, body: bytes, send: Send,
              clock: Clock) -> None:
    chat = path == CHAT_PATH
    req = _json_object(body)
    # A body that is not a JSON object goes to the prefill worker as it is, which answers the 400
    # a single server would.
    prefill_bytes = body if req is None else msgspec.json.encode(prefill_request(req, chat))
    # Uncompressed, so the answer can be parsed here and, if final, relayed as it came.
    prefill_headers = [(k, v) for k, v in headers if k != b"accept-encoding"]
    response, content = await up.fetch(prefill, "POST", path, prefill_headers, prefill_bytes, clock)
    if response.status_code != 200 or req is None:
        return await up.respond(send, response.status_code, response_headers(response), content, clock)
    try:
        answer = msgspec.json.decode(content)
        final = finished_by_prefill(req, answer, chat)
    except (msgspec.DecodeError, TypeError, KeyError, AttributeError):
        raise UpstreamError(502, f"the prefill worker's answer is not a {path} response: {content[:200]!r}") from None
    if final:
        if req.get("stream"):
            events = as_stream(answer, req, chat)
            return await up.respond(send, 200, _SSE_HEADERS + [(b"content-length", str(len(events)).encode())],
                                    events, clock)
        return await up.respond(send, 200, response_headers(response), content, clock)
    await up.forward(decode, "POST", path, headers, decode_request(body, req, answer), send, clock)


def _json_object(body: bytes) -> dict | None:
    try:
        req = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return req if isinstance(req, dict) else None


def prefill_request(req: dict, chat: bool) -> dict:
    body = {**req, "max_tokens": 1, "stream": False}
    if _client_max_tokens(req, chat) != 1:
        body["kv_transfer_params"] = {"do_remote_decode": True}
    body.pop("stream_options", None)  # a server refuses it on a non-streaming request (400)
    if "max_completion_tokens" in req:  # chat: it takes precedence over max_tokens
        body["max_completion_tokens"] = 1
    if req.get("min_tokens"):  # min_tokens > max_tokens is a 400; 1 still keeps EOS off the first token
        body["min_tokens"] = 1
    return body


def _client_max_tokens(req: dict, chat: bool) -> int | None:
    if chat:
        return req.get("max_completion_tokens") or req.get("max_tokens")
    return req.get("max_tokens", 16)  # the completions API's default


def finished_by_prefill(req: dict, answer: dict, chat: bool) -> bool:
    if _client_max_tokens(req, chat) == 1:
        return True
    return all(c["finish_reason"] != "length" for c in answer["choices"])


def decode_request(body: bytes, req: dict, answer: dict) -> bytes:
    params = answer.get("kv_transfer_params")
    if params is None:
        # A prefill worker without KV hand-off (today's `leanserve serve`) returns none: the
        # decode worker then computes the prompt itself, as behind vLLM's proxy. The answer is
        # the same; the prefill was wasted work.
        return body
    return msgspec.json.encode({**req, "kv_transfer_params": params})


def as_stream(answer: dict, req: dict, chat: bool) -> bytes:
    """A finished non-streaming answer as the SSE stream a single server would have sent: one
    chunk per choice (text, logprobs, finish reason), the usage chunk if asked for, [DONE]."""
    head = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    chunks = []
    for c in answer["choices"]:
        if chat:
            choice = {"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                      "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]}
        else:
            choice = {"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                      "finish_reason": c["finish_reason"]}
        chunks.append({**head, "choices": [choice]})
    if (req.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": answer.get("usage")})
    return b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
