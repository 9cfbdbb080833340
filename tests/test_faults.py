"""Fault injection against live servers: bad input, client disconnects, overload, a frozen or dead
engine, a broken output reader, shutdown. Each test states what a client sees; none may end in a
hang, a 5xx for a valid request, or a server that stops serving others.

The servers run the tiny random model (fast), except where a slow iteration is the point."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from leanserve.engine.async_client import AsyncEngineClient
from leanserve.engine.config import EngineConfig
from leanserve.engine.endpoints import EngineEndpoints
from leanserve.engine.launch import EngineProcesses
from leanserve.engine.params import SamplingParams

from .server_util import LiveServer, write_chat_template

# Renders like ChatML, and refuses tool messages: a template error a client can cause.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_WAITING = 32


@pytest.fixture(scope="module")
def strict_model(tiny_chat_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("strict") / "m")
    shutil.copytree(tiny_chat_model, path)
    write_chat_template(path, STRICT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(strict_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("faults") / "server.log")
    s = LiveServer(strict_model, "--kv-cache-memory", "16M", "--max-model-len", "2048",
                   "--max-waiting-requests", str(MAX_WAITING), "--max-request-body-bytes", "1M", log_path=log)
    yield s
    assert s.stop() == 0


def post(server, path, body, **kw):
    """JSON bodies are written with ASCII escapes, so a lone surrogate arrives as ``\\udfff``."""
    kw.setdefault("timeout", 60)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, **kw)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == status
    if param != "any":
        assert err["param"] == param, err
    return err


def assert_serving(server):
    assert httpx.get(server.url + "/health").status_code == 200
    r = post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def wait_idle(server, timeout=10.0) -> dict:
    """The engine's gauges after every request is gone (the stats snapshot comes every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(server.url + "/stats").json()
        idle = stats.get("num_running") == 0 and stats.get("num_waiting") == 0 and stats.get("kv_blocks_used") == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# ------------------------------------------------------------------------------ one request, one failure


def test_echo_with_zero_logprobs_does_not_freeze_the_server(server):
    """Was: prompt logprobs with no top entries raised in the shared output reader, and every
    request after it waited forever."""
    r = post(server, "/v1/completions", {"prompt": "Hello world, how are you", "max_tokens": 2, "echo": True,
                                         "logprobs": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(t == {} for t in lp["top_logprobs"][1:])  # logprobs 0: the token's own, no alternatives
    assert_serving(server)


def test_failed_requests_do_not_leak_admission_capacity(server):
    """Was: a stop string that could not be encoded for the engine raised after the request's ids
    were registered; 64 of them left the server answering 503 to everyone."""
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["\udfff"], "n": 16}
    for _ in range(3 * MAX_WAITING // 16):
        assert_openai_error(post(server, "/v1/completions", body), 400, "stop.0")
    r = post(server, "/v1/completions", {"prompt": ["hi", "ho"], "max_tokens": 2, "n": MAX_WAITING // 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_WAITING  # the full capacity is there


def test_submit_registers_nothing_when_the_message_cannot_be_sent():
    """The same class of leak, one level down: whatever ``submit`` raises, nothing stays held."""
    client = AsyncEngineClient(dataclasses.replace(EngineEndpoints.ipc("/nonexistent", 1, 1), engine_pids=(0,)))
    with pytest.raises(UnicodeEncodeError):
        client.submit(np.array([1, 2], np.int32), SamplingParams(stop=["\udfff"]))
    assert client.num_pending == 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi \ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "bad \udc00"], "max_tokens": 2}, "prompt.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x \udfff"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "user": "\ud800"}, "user"),
    ("/tokenize", {"prompt": "a \ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param):
    assert_openai_error(post(server, path, body), 400, param)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": ["x"] * 4, "n": 16}, 400, "prompt"),  # 64 sequences > --max-waiting-requests
    ("/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 1}, 200, None),
    ("/tokenize", {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages"),
])
def test_validation(server, path, body, status, param):
    r = post(server, path, body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_openai_error(r, status, param)


def test_every_error_has_openai_shape(server):
    assert_openai_error(httpx.get(server.url + "/no/such/route"), 404, None)
    assert_openai_error(httpx.delete(server.url + "/v1/completions"), 405, None)
    assert_openai_error(post(server, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'), 400, None)
    assert_openai_error(post(server, "/v1/completions", b"\x00\x01"), 400, None)


def test_unhandled_errors_are_a_logged_500_in_openai_shape(tmp_path, caplog):
    """The last line of defence, on a route that fails as a handler bug would."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import Gauge

    from leanserve.server.middleware import Gatekeeper

    app = FastAPI()
    app.add_middleware(Gatekeeper, api_key=None, max_body_bytes=1 << 20,
                       in_progress=Gauge("in_progress", "requests in progress", registry=None))

    @app.get("/bug")
    async def bug():
        raise KeyError("a bug")

    with caplog.at_level("ERROR", logger="leanserve.server"):
        r = TestClient(app, raise_server_exceptions=False).get("/bug", headers={"x-request-id": "req-42"})
    err = assert_openai_error(r, 500, None)
    assert "req-42" in err["message"]
    logged = [rec for rec in caplog.records if "req-42" in rec.getMessage()]
    assert len(logged) == 1 and "KeyError" in logged[0].exc_text


# ------------------------------------------------------------------------------ memory and size


def test_oversized_bodies_are_413_before_parsing(server):
    big = json.dumps({"prompt": "hello " * 300_000, "max_tokens": 2}).encode()  # 1.8 MB > 1M
    assert_openai_error(post(server, "/v1/completions", big), 413, None)

    def chunks():  # no content-length: the size is counted as the body arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413, None)
    assert_serving(server)


def test_a_prompt_that_cannot_fit_is_rejected_before_tokenizing(server):
    # 0.6 MB of text, under the body limit: far more characters than 2,048 tokens can hold.
    r = post(server, "/v1/completions", {"prompt": "hello " * 100_000, "max_tokens": 2})
    err = assert_openai_error(r, 400, "prompt")
    assert "cannot fit" in err["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hey " * 150_000}]})
    assert_openai_error(r, 400, "messages")


# ------------------------------------------------------------------------------ clients that leave


def test_non_streaming_disconnect_aborts_the_request(server):
    before = wait_idle(server)["generation_tokens_total"]
    body = {"prompt": "a long one", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", body, timeout=0.3)
    stats = wait_idle(server)
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    # Ended by the abort, not run to its end (here ~2,000 tokens take seconds).
    assert stats["generation_tokens_total"] - before < 2000
    assert_serving(server)


def test_random_disconnects_abort_storms_and_floods(server):
    """Streams and non-streams dropped at random points, floods past the queue limit: every
    request that is answered is answered correctly, and the server ends idle with nothing held."""
    rng = random.Random(7)

    async def one(c: httpx.AsyncClient, i: int):
        stream = rng.random() < 0.5
        leave_after = rng.choice([None, 0, 1, 3])  # chunks (stream) or ~tenths of a second (not)
        n, max_tokens = rng.choice([1, 1, 2, 4]), rng.randint(1, 120)
        body = {"prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True, "n": n, "stream": stream,
                "temperature": 1.0, "seed": i}
        try:
            if not stream:
                timeout = None if leave_after is None else 0.05 + 0.1 * leave_after
                r = await c.post("/v1/completions", json=body, timeout=timeout)
                if r.status_code == 200:  # answered in full
                    assert r.json()["usage"]["completion_tokens"] == n * max_tokens
                return r.status_code
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code
                seen, finished, done = 0, 0, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, line
                        finished += chunk["choices"][0]["finish_reason"] == "length"
                        seen += 1
                        if leave_after is not None and seen > leave_after:
                            return "left"
                assert finished == n  # every sample ran to its length
                return 200 if done else "no [DONE]"
        except httpx.TimeoutException:
            return "left"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(120)))

    results = asyncio.run(main())
    assert set(results) <= {200, 503, "left"}, results
    # Some answered in full, some refused by the flood past --max-waiting-requests, some left.
    assert {200, 503, "left"} <= set(results)
    stats = wait_idle(server)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0)
    assert_serving(server)


# ------------------------------------------------------------------------------ the engine


def test_frozen_engine_turns_health_503_and_recovers(strict_model):
    s = LiveServer(strict_model, "--kv-cache-memory", "16M", "--watchdog-timeout", "1")
    try:
        engine = s.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            err = _wait_health(s, 503, timeout=10)
            assert "no message from the engine" in err["error"]["message"]
        finally:
            os.kill(engine, signal.SIGCONT)
        _wait_health(s, 200, timeout=10)
        assert_serving(s)
    finally:
        s.stop()


def test_a_long_iteration_is_reported_with_the_loop_stack(default_model, tmp_path):
    """The hang detector: an iteration past --watchdog-timeout logs where the loop is (here a
    legitimately long prefill of the real model) and /health says so while it lasts."""
    s = LiveServer(default_model, "--kv-cache-memory", "256M", "--max-model-len", "2048", "--watchdog-timeout",
                   "0.2", "--max-num-batched-tokens", "2048", log_path=str(tmp_path / "log"))
    try:
        prompt = list(range(1000, 2900))  # one 1,900-token prefill step: well over 0.2 s here
        r = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, timeout=120)
        assert r.status_code == 200
        time.sleep(1.0)
        log = s.log_text()
        assert "hang detector: the current iteration has run for" in log
        assert "in step" in log and "in execute" in log  # the loop thread's stack, down to the model call
        assert "engine stalled: one engine iteration has run for" in log
        _wait_health(s, 200, timeout=10)
    finally:
        s.stop()


def test_a_dead_output_reader_fails_everything_at_once(tiny_chat_model):
    """An exception that kills the shared reader (here: a message that is not the engine's
    protocol) fails every pending request with the reason, and the client reports the failure."""
    import zmq

    async def main(endpoints):
        client = AsyncEngineClient(endpoints)
        await client.start()
        _, q = client.submit(np.array([5, 6, 7], np.int32), SamplingParams(max_tokens=2000, ignore_eos=True))
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(endpoints.outputs(0, 0))
        sock.send(b"\xc1 not msgpack")
        sock.close(linger=1000)
        deadline = time.monotonic() + 10
        while True:
            _, ev = await asyncio.wait_for(q.get(), max(0.1, deadline - time.monotonic()))
            if ev.error:
                break
        assert "engine output reader failed" in ev.error
        assert client.failure and client.unavailable == client.failure and client.num_pending == 0
        await client.shutdown()

    config = EngineConfig(model=tiny_chat_model, kv_cache_memory=16 << 20, dtype="float32")
    with EngineProcesses(config.resolve(), [2]) as engines:
        asyncio.run(main(engines.start()))


# An engine that fails a request and exits, as one whose tensor-parallel rank died does
# (process._drain: its last step leaves 0.1 s before it exits).
LAST_WORDS_ENGINE = """
import sys, time
import msgspec, zmq
from leanserve.engine.messages import Ready, Step, StepOutput, ToEngine
ctx = zmq.Context()
out, inp = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
out.connect(sys.argv[1])
inp.connect(sys.argv[2])
out.send(msgspec.msgpack.encode(Ready(64, 100, 8)))
add = msgspec.msgpack.decode(inp.recv_multipart()[0], type=ToEngine)
print("added", flush=True)
time.sleep(0.2)
out.send(msgspec.msgpack.encode(Step(StepOutput.of_aborts([], {add.request_id: "rank 1 was killed"}))))
time.sleep(0.1)
"""


def test_an_engines_last_words_reach_its_requests_before_its_death(tmp_path):
    """The API process notices an engine's exit at once (a pidfd), but a request the engine
    failed just before, with the reason, ends with that reason, even when the API process was
    too busy to read it before the exit (both then wait in the same turn of its loop)."""
    endpoints = EngineEndpoints.ipc(str(tmp_path), 1, 1)
    engine = subprocess.Popen([sys.executable, "-c", LAST_WORDS_ENGINE, endpoints.outputs(0, 0),
                               endpoints.requests(0, 0)], stdout=subprocess.PIPE, text=True)

    async def main():
        client = AsyncEngineClient(dataclasses.replace(endpoints, engine_pids=(engine.pid,)))
        await client.start()
        _, q = client.submit(np.array([5, 6, 7], np.int32), SamplingParams(max_tokens=4))
        assert await asyncio.to_thread(engine.stdout.readline) == "added\n"
        engine.wait(10)  # this loop is blocked meanwhile: it finds the step and the exit together
        _, ev = await asyncio.wait_for(q.get(), 10)
        assert ev.error == "rank 1 was killed", ev
        await asyncio.sleep(0.2)
        assert client.failure and "the engine process died" in client.failure
        await client.shutdown()

    try:
        asyncio.run(main())
    finally:
        engine.kill()
        engine.wait()


def test_engine_death_fails_in_flight_requests(tiny_chat_model):
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
                plain = asyncio.create_task(c.post("/v1/completions", json=body))
                async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                    lines = r.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    os.kill(s.engine_pid(), signal.SIGKILL)
                    rest = [line async for line in lines]
                return (await plain), rest

        plain, rest = asyncio.run(main())
        assert_openai_error(plain, 500)
        assert "engine process died" in plain.json()["error"]["message"]
        events = [line for line in rest if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "engine process died" in events[-2]
    finally:
        s.stop()


def _wait_health(s, status: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(s.url + "/health", timeout=5)
        if r.status_code == status:
            return r.json() if r.content else {}
        assert time.monotonic() < deadline, f"/health stayed {r.status_code}"
        time.sleep(0.1)


# ------------------------------------------------------------------------------ shutdown


def test_sigterm_drains_then_ends_streams_with_a_final_chunk(tiny_chat_model, tmp_path):
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M", "--shutdown-timeout", "1",
                   log_path=str(tmp_path / "log"))
    try:
        async def stream(c, max_tokens):
            body = {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            return events[-1], json.loads(events[-2])["choices"][0]["finish_reason"]

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                # Short ones finish within the drain window; long ones (~10 s here) are ended by it.
                tasks = [asyncio.create_task(stream(c, n)) for n in (3, 2000, 2000)]
                await asyncio.sleep(1.0)
                s.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        assert results == [("[DONE]", "length"), ("[DONE]", "abort"), ("[DONE]", "abort")]
        assert s.proc.wait(30) == 0
        log = s.log_text()
        assert "Traceback" not in log and "never retrieved" not in log, log
        assert "ending 2 unfinished request(s)" in log
    finally:
        s.stop()


def test_a_crashed_offline_engine_loop_fails_pending_and_later_requests(tiny_chat_model):
    """The offline API's loop thread dying (here: a scheduler bug, injected) ends every pending
    stream with the error instead of leaving its reader blocked forever."""
    from leanserve import LLM

    with LLM(tiny_chat_model, dtype="float32", kv_cache_memory=16 << 20) as llm:
        streams = llm.client.submit(np.array([5, 6, 7], np.int32), SamplingParams(max_tokens=1000, ignore_eos=True))

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        llm.engine.scheduler.schedule = broken_schedule
        events = list(streams[0])
        assert events[-1].finish_reason.name == "ERROR" and "scheduler bug" in events[-1].error
        with pytest.raises(RuntimeError, match="engine loop crashed"):
            llm.generate(["more"], SamplingParams(max_tokens=2))
