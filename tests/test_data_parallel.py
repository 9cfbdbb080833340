"""Data-parallel engines (``--data-parallel-size``): one live server with two engine-core
processes, against a one-engine server on the same model; and the engines as Ray actors
(``--distributed-executor-backend ray``) on a Ray cluster the tests start on loopback."""

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

from .server_util import LiveServer, free_port, is_error_event
from .test_router import metric, wait_for

ARGS = ("--kv-cache-memory", "16M")
LONG = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
RAY = ("--distributed-executor-backend", "ray")


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


async def open_long_streams(c: httpx.AsyncClient, n: int) -> tuple[list, list]:
    """``n`` streamed LONG completions, each past its first event: their contexts (to close) and
    line iterators. Hold each iterator: one dropped is closed by the collector, which closes its
    stream."""
    streams = [c.stream("POST", "/v1/completions", json=LONG) for _ in range(n)]
    lines = [(await st.__aenter__()).aiter_lines() for st in streams]
    for it in lines:
        assert (await anext(it)).startswith("data: ")
    return streams, lines


PROMPTS = [f"Count with me: {i}, {i + 1}," for i in range(8)]


def assert_same_completions(server: LiveServer, reference: LiveServer) -> None:
    got = completions(server.url, PROMPTS, n=2)
    want = completions(reference.url, PROMPTS, n=2)
    strip = lambda choices: [(c["index"], c["text"], c["logprobs"]["tokens"]) for c in choices]  # noqa: E731
    assert [strip(c) for c in got] == [strip(c) for c in want]


def assert_both_engines_served(server: LiveServer) -> None:
    """After ``assert_same_completions``: every engine generated, and the per-engine counters add up."""
    # Engine counters reach the API process in its 0.5 s stats snapshots: wait for the last one.
    total = len(PROMPTS) * 2 * 12
    read = lambda: [metric(server.url, "leanserve:generation_tokens_total", engine=k) for k in "01"]  # noqa: E731
    wait_for(lambda: sum(read()) >= total, what="every engine's counters")
    tokens = read()
    assert min(tokens) > 0 and sum(tokens) == total, tokens


def test_outputs_equal_one_engine_and_both_engines_serve(servers):
    dp, single = servers
    assert len(dp.engine_pids()) == 2
    assert_same_completions(dp, single)
    assert_both_engines_served(dp)


def test_requests_go_to_the_least_loaded_engine_and_aborts_follow_them(servers):
    dp, _ = servers

    async def main():
        async with httpx.AsyncClient(base_url=dp.url, timeout=60) as c:
            streams, lines = await open_long_streams(c, 4)  # lines held, see open_long_streams
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
                streams, lines = await open_long_streams(c, 2)
                os.kill(s.engine_pids()[0], signal.SIGKILL)
                # One stream ends with the error (its engine died); the other keeps streaming (or finishes).
                ends = await asyncio.gather(*(_until_error_or(it, 3.0) for it in lines))
                assert _kinds(ends) == ["error", "served"], _ends_report(ends, s)
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


async def _until_error_or(lines, seconds: float) -> tuple[str, str]:
    """("error", its event) if the stream carries an error event within ``seconds``; ("served", "")
    if it kept sending tokens all that time or ended with ``[DONE]`` within it (the tiny model can
    finish a long completion in a few seconds); ("cut", "") if it ended without either."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            line = await anext(lines)
        except StopAsyncIteration:
            return "cut", ""
        if is_error_event(line):
            return "error", line
        if line == "data: [DONE]":
            return "served", ""
    return "served", ""


def _kinds(ends: list[tuple[str, str]]) -> list[str]:
    return sorted(kind for kind, _ in ends)


def _ends_report(ends: list, server: LiveServer) -> str:
    """A failure message shown whole (pytest shortens the repr of a tuple, not a string): how each
    stream ended and the tail of the server's log."""
    return "\n".join(f"stream {i}: {end}" for i, end in enumerate(ends)) + "\n--- server log ---\n" + \
        server.log_text()[-3000:]


def test_ray_without_a_cluster_is_one_line(tiny_chat_model):
    pytest.importorskip("ray", reason="ray is not installed: pip install 'leanserve[ray]'")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "leanserve.cli", "serve", tiny_chat_model, "-dp", "2", *RAY,
                        "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        "leanserve: error: distributed_executor_backend (--distributed-executor-backend): no Ray cluster to join ("), \
        r.stderr[-2000:]


def test_bad_size_is_one_line():
    r = subprocess.run([sys.executable, "-m", "leanserve.cli", "serve", "-dp", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "leanserve: error: data_parallel_size: must be >= 1, got 0"


# ------------------------------------------------------------------------------ Ray


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.parametrize("tp", ["1", "2"])
def test_ray_engines_match_local_ones_and_stop_with_the_server(servers, tiny_chat_model, ray_cluster, tp):
    """Each engine a Ray actor (at TP=2 placing its own rank actor), reached over TCP: greedy
    outputs equal the local engines', both serve, and SIGTERM drains a stream, then ends them."""
    dp, _ = servers
    s = LiveServer(tiny_chat_model, *ARGS, "-dp", "2", "-tp", tp, *RAY, env={"RAY_ADDRESS": ray_cluster})
    try:
        assert "(Ray actors on " in s.log_text()
        engines = s.engine_pids()
        assert_same_completions(s, dp)
        assert_both_engines_served(s)

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                body = {"prompt": "x", "max_tokens": 100, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as st:
                    lines = st.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    s.proc.send_signal(signal.SIGTERM)
                    events = [line async for line in lines if line.startswith("data: {")]
                    assert '"finish_reason":"length"' in events[-1], events[-1]

        asyncio.run(asyncio.wait_for(main(), 60))
        assert s.proc.wait(30) == 0
        wait_for(lambda: not _alive(engines), what="the engine actors to end")
    finally:
        s.stop()


def test_a_dead_ray_engine_fails_only_its_requests_and_the_rest_end_with_the_launcher(tiny_chat_model,
                                                                                      ray_cluster):
    """Ray's word (the actor's ``run`` ref raising), not a pidfd, fails the dead engine's stream
    at once; the other engine serves on. A launcher killed outright takes it along."""
    s = LiveServer(tiny_chat_model, *ARGS, "-dp", "2", *RAY, env={"RAY_ADDRESS": ray_cluster})
    try:
        engines = s.engine_pids()

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                streams, lines = await open_long_streams(c, 2)
                killed = time.monotonic()

                async def end(it):
                    return await _until_error_or(it, 3.0), time.monotonic() - killed

                os.kill(engines[0], signal.SIGKILL)
                ends = sorted(await asyncio.gather(*(end(it) for it in lines)))
                # A token's text can be "error" too: CI once counted one as a second error end when the
                # check was a substring (now the event's JSON); the report shows each end and the log.
                assert _kinds([e for e, _ in ends]) == ["error", "served"], _ends_report(ends, s)
                assert ends[0][1] < 2.0, ends  # ~0.1 s here: Ray's notice, then LAST_WORDS_S
                health = await c.get("/health")
                assert health.status_code == 503
                assert "degraded: 1 of 2 engines down: engine 0: the engine's Ray actor (pid" in \
                    health.json()["error"]["message"]
                for _ in range(4):
                    r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                    assert r.status_code == 200, r.text
                for st in streams:
                    await st.__aexit__(None, None, None)

        asyncio.run(asyncio.wait_for(main(), 60))
        s.proc.kill()
        wait_for(lambda: not _alive(engines), what="Ray to end the launcher's actors")
    finally:
        s.stop()
