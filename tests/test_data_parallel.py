"""Data-parallel engines (``--data-parallel-size``): one live server with two engine-core
processes, against a one-engine server on the same model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .server_util import LiveServer
from .test_router import metric, wait_for

ARGS = ("--kv-cache-memory", "16M")
LONG = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def servers(tiny_chat_model):
    with ThreadPoolExecutor(2) as pool:
        dp, single = pool.map(lambda extra: LiveServer(tiny_chat_model, *ARGS, *extra), (("-dp", "2"), ()))
    yield dp, single
    dp.stop()
    single.stop()


def completions(url: str, prompts: list[str], **extra) -> list[dict]:
    body = {"max_tokens": 12, "temperature": 0, "logprobs": 1} | extra
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: httpx.post(url + "/v1/completions", json=body | {"prompt": p},
                                                  timeout=60).json()["choices"], prompts))


PROMPTS = [f"Count with me: {i}, {i + 1}," for i in range(8)]


def test_outputs_equal_one_engine_and_both_engines_serve(servers):
    dp, single = servers
    assert len(dp.engine_pids()) == 2
    got = completions(dp.url, PROMPTS, n=2)
    want = completions(single.url, PROMPTS, n=2)
    strip = lambda choices: [(c["index"], c["text"], c["logprobs"]["tokens"]) for c in choices]  # noqa: E731
    assert [strip(c) for c in got] == [strip(c) for c in want]
    # Engine counters reach the API process in its 0.5 s stats snapshots: wait for the last one.
    total = len(PROMPTS) * 2 * 12
    read = lambda: [metric(dp.url, "leanserve:generation_tokens_total", engine=k) for k in "01"]  # noqa: E731
    wait_for(lambda: sum(read()) >= total, what="every engine's counters")
    tokens = read()
    assert min(tokens) > 0 and sum(tokens) == len(PROMPTS) * 2 * 12, tokens


def test_requests_go_to_the_least_loaded_engine_and_aborts_follow_them(servers):
    dp, _ = servers

    async def main():
        async with httpx.AsyncClient(base_url=dp.url, timeout=60) as c:
            streams = [c.stream("POST", "/v1/completions", json=LONG) for _ in range(4)]
            # Hold each line iterator: one dropped is closed by the collector, which closes its stream.
            lines = [(await s.__aenter__()).aiter_lines() for s in streams]
            for it in lines:
                assert (await anext(it)).startswith("data: ")
            # Four long streams, two per engine: least loaded, ties taken in turn.
            wait_for(lambda: [metric(dp.url, "leanserve:num_requests_running", engine=k) for k in "01"] == [2, 2],
                     what="two running requests per engine")
            for s in streams:  # client disconnects: each abort must reach the engine that runs it
                await s.__aexit__(None, None, None)

    asyncio.run(main())
    wait_for(lambda: metric(dp.url, "leanserve:num_requests_running") == 0, what="every engine idle")
    assert httpx.get(dp.url + "/stats").json()["num_running"] == 0


def test_a_dead_engine_fails_only_its_requests_and_leaves_the_rotation(tiny_chat_model):
    s = LiveServer(tiny_chat_model, *ARGS, "-dp", "2")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                streams = [c.stream("POST", "/v1/completions", json=LONG) for _ in range(2)]
                lines = [(await st.__aenter__()).aiter_lines() for st in streams]
                for it in lines:
                    assert (await anext(it)).startswith("data: ")
                os.kill(s.engine_pids()[0], signal.SIGKILL)
                # One stream ends with the error (its engine died); the other keeps streaming.
                ends = await asyncio.gather(*(_until_error_or(it, 3.0) for it in lines))
                assert sorted(ends) == ["error", "streaming"], (ends, httpx.get(s.url + "/stats").json())
                health = await c.get("/health")
                assert health.status_code == 503 and "degraded: 1 of 2 engines down" in health.json()["error"]["message"]
                # New requests all go to the engine that is left, and succeed.
                for _ in range(4):
                    r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                    assert r.status_code == 200, r.text
                for st in streams:
                    await st.__aexit__(None, None, None)

        asyncio.run(main())
    finally:
        s.stop()


async def _until_error_or(lines, seconds: float) -> str:
    """"error" if the stream carries an error event within ``seconds``, else "streaming" (it kept
    sending tokens all that time)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = await anext(lines)
        if line.startswith("data: ") and '"error"' in line:
            return "error"
    return "streaming"


def test_bad_size_is_one_line():
    r = subprocess.run([sys.executable, "-m", "leanserve.cli", "serve", "-dp", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "leanserve: error: data_parallel_size: must be >= 1, got 0"
