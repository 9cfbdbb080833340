"""Several API processes (``--api-server-count``): live servers with two API processes sharing
the port in front of the same engines, against a plain server on the same model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from leanserve.engine.messages import CLIENT_ID_SHIFT, ENGINE_ID_SHIFT, MAX_CLIENTS

from .server_util import LiveServer, free_port, is_error_event
from .test_data_parallel import PROMPTS, completions
from .test_router import metric, wait_for

ARGS = ("--kv-cache-memory", "16M")
LONG = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def servers(tiny_chat_model):
    multi = LiveServer(tiny_chat_model, *ARGS, "--api-server-count", "2", "-dp", "2")
    single = LiveServer(tiny_chat_model, *ARGS)
    yield multi, single
    multi.stop()
    single.stop()


def in_progress(server: LiveServer) -> list[float]:
    """Requests each API process is serving now, by the pid label of their gauge."""
    return [metric(server.url, "leanserve:api_requests_in_progress", pid=str(p)) for p in server.api_pids()]


@contextlib.asynccontextmanager
async def streams_on_every_api_process(server: LiveServer, at_most: int = 24):
    """Opens long streams, a connection each, until every API process serves at least one (the
    kernel gives each connection to whichever process accepts first); yields their line iterators
    and closes them on the way out."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c, contextlib.AsyncExitStack() as stack:
        lines = []
        while not (lines and min(in_progress(server)) > 0):
            assert len(lines) < at_most, f"{at_most} connections, API processes serving {in_progress(server)}"
            for _ in range(4):
                response = await stack.enter_async_context(c.stream("POST", "/v1/completions", json=LONG))
                lines.append(response.aiter_lines())
            for it in lines[-4:]:
                assert (await next_event(it)).startswith("data: {")
        yield lines


async def next_event(lines) -> str:
    while not (line := await anext(lines)):  # SSE events are separated by blank lines
        pass
    return line


def test_outputs_equal_a_plain_server_and_metrics_add_up(servers):
    multi, single = servers
    assert len(multi.api_pids()) == 2 and len(multi.engine_pids()) == 2
    got = completions(multi.url, PROMPTS, n=2)
    want = completions(single.url, PROMPTS, n=2)
    strip = lambda choices: [(c["index"], c["text"], c["logprobs"]["tokens"]) for c in choices]  # noqa: E731
    assert [strip(c) for c in got] == [strip(c) for c in want]

    # Engine metrics arrive in snapshots every 0.5 s: let the last of these requests' come in.
    wait_for(lambda: metric(multi.url, "leanserve:generation_tokens_total") == len(PROMPTS) * 2 * 12,
             what="the first requests' tokens")
    before = metric(multi.url, "leanserve:request_success_total")
    queued = metric(multi.url, "leanserve:request_queue_time_seconds_count")
    completions(multi.url, [f"{i} and" for i in range(16)])  # a connection each: both processes take some
    # Request metrics: summed over the API processes (each saw only its own requests).
    assert metric(multi.url, "leanserve:request_success_total") - before == 16
    # Engine metrics: every API process sees every engine whole; none is counted twice.
    wait_for(lambda: metric(multi.url, "leanserve:generation_tokens_total") == (len(PROMPTS) * 2 + 16) * 12,
             what="16 x 12 more generated tokens")
    assert metric(multi.url, "leanserve:request_queue_time_seconds_count") - queued == 16


def test_both_api_processes_serve_concurrent_streams(servers):
    multi, _ = servers

    async def main():
        async with streams_on_every_api_process(multi) as lines:
            counts = in_progress(multi)
            assert min(counts) > 0 and sum(counts) == len(lines), counts
            for it in lines:  # every stream moves on, whichever process serves it
                assert (await next_event(it)).startswith("data: {")

    asyncio.run(main())
    wait_for(lambda: metric(multi.url, "leanserve:num_requests_running") == 0, what="every engine idle")
    assert in_progress(multi) == [0, 0]


def kv_transfer_config(role: str, kv_port: int) -> str:
    return json.dumps({"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": kv_port})


def free_port_pair() -> int:
    """A port p with p + 1 also free: -dp 2 engines' side channels."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p


def test_prefill_legs_answered_by_either_api_process_are_pulled_by_a_decode_server(tiny_chat_model):
    """--kv-transfer-config with --api-server-count 2 and -dp 2: the launcher starts each engine,
    with its own side channel (kv_port + k), once; whichever API process answers a prefill leg
    hands out a lease on its engine, and a decode server pulls the prompt's KV from there,
    answering as the prefill server does on its own."""
    kv_port = free_port_pair()
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda extra: LiveServer(tiny_chat_model, *ARGS, *extra), (
            ("-asc", "2", "-dp", "2", "--kv-transfer-config", kv_transfer_config("kv_producer", kv_port)),
            ("--kv-transfer-config", kv_transfer_config("kv_consumer", free_port()))))
    try:
        async def prefill_legs(prompts: list[str]) -> list[dict]:
            async with httpx.AsyncClient(base_url=prefill.url, timeout=60) as c:  # a connection each
                answers = await asyncio.gather(*(c.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
                    for p in prompts))
            return [r.json()["kv_transfer_params"] for r in answers]

        legs: dict[str, dict] = {}  # prompt -> its prefill leg's kv_transfer_params
        holders: set[tuple[int, int]] = set()  # (API process, engine) that answered
        while len({api for api, _ in holders}) < 2 or len({engine for _, engine in holders}) < 2:
            assert len(legs) < 48, f"API processes and engines that answered: {holders}"
            prompts = [f"leg {len(legs) + i}: " + "kv " * 40 for i in range(8)]
            for p, params in zip(prompts, asyncio.run(prefill_legs(prompts))):
                rid = params["remote_request_id"]
                api, engine = rid >> CLIENT_ID_SHIFT & (MAX_CLIENTS - 1), rid >> ENGINE_ID_SHIFT
                assert (params["remote_port"], params["remote_engine_id"][-4:]) == (kv_port + engine, f"-dp{engine}")
                holders.add((api, engine))
                legs[p] = params
        prompt_tokens = metric(decode.url, "leanserve:prompt_tokens_total")
        for p, params in legs.items():
            body = {"prompt": p, "max_tokens": 8, "temperature": 0}
            got = httpx.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
            want = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60)
            assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        # Every transfer landed, each decode computed at most its last prompt token, every lease
        # was pulled (and counted once, though both API processes hear every engine).
        wait_for(lambda: metric(decode.url, "leanserve:kv_transfers_completed_total") == len(legs),
                 what="every transfer counted")
        assert metric(decode.url, "leanserve:prompt_tokens_total") - prompt_tokens <= len(legs)
        wait_for(lambda: metric(prefill.url, "leanserve:kv_leases") == 0, what="every lease freed")
        assert metric(prefill.url, "leanserve:kv_leases_created_total") == len(legs)
    finally:
        prefill.stop()
        decode.stop()


def test_a_killed_engine_fails_in_flight_requests_in_every_api_process(tiny_chat_model):
    s = LiveServer(tiny_chat_model, *ARGS, "--api-server-count", "2")
    try:
        async def main():
            async with streams_on_every_api_process(s) as lines:
                os.kill(s.engine_pid(), signal.SIGKILL)
                t0 = time.monotonic()
                for it in lines:
                    async for line in it:
                        if is_error_event(line):
                            assert "engine process died" in line
                            break
                    else:
                        raise AssertionError("a stream ended without the error")
                return time.monotonic() - t0

        # Each API process watches the engine's pidfd: no waiting for the 60 s watchdog.
        assert asyncio.run(main()) < 2.0
        for _ in range(4):  # whichever process answers
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and "engine process died" in r.json()["error"]["message"]
        assert "engine-core process %d exited with code -9" % s.engine_pid() in s.log_text()
    finally:
        s.stop()


def test_sigterm_drains_and_stops_every_process(tiny_chat_model):
    s = LiveServer(tiny_chat_model, *ARGS, "--api-server-count", "2", "-dp", "2", "--shutdown-timeout", "1")
    children = s.api_pids() + s.engine_pids()

    async def main():
        async with streams_on_every_api_process(s) as lines:
            s.proc.send_signal(signal.SIGTERM)
            # Every stream ends as a drained one does: the final chunk says "abort", then [DONE].
            return [[line async for line in it if line.startswith("data: ")][-2:] for it in lines]

    try:
        for last, done in asyncio.run(main()):
            assert '"finish_reason":"abort"' in last and done == "data: [DONE]"
    finally:
        assert s.stop(timeout=30) == 0
    assert_gone(children)


def test_a_dead_api_process_ends_the_whole_server(tiny_chat_model, tmp_path):
    s = LiveServer(tiny_chat_model, *ARGS, "--api-server-count", "2", log_path=str(tmp_path / "log"))
    children = s.api_pids() + s.engine_pids()
    os.kill(children[0], signal.SIGKILL)
    try:
        assert s.proc.wait(30) == 1
    finally:
        s.stop()
    assert f"API server process {children[0]} exited with code -9: shutting the server down" in s.log_text()
    assert_gone(children)


def test_a_killed_launcher_leaves_no_orphans(tiny_chat_model):
    s = LiveServer(tiny_chat_model, *ARGS, "--api-server-count", "2", "--shutdown-timeout", "1")
    children = s.api_pids() + s.engine_pids()
    s.stop(signal.SIGKILL)
    # Engines and API processes check for their parent every 0.5 s; an API process then drains.
    assert_gone(children, timeout=20)


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids), timeout,
             what=f"processes {pids} gone")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1]
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("args, message", [
    (["--api-server-count", "0"], "api_server_count: must be in [1, 256], got 0"),
    (["-asc", "257"], "api_server_count: must be in [1, 256], got 257"),
])
def test_bad_count_is_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "leanserve.cli", "serve", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"leanserve: error: {message}"


def test_a_port_in_use_is_one_line_before_anything_starts():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "leanserve.cli", "serve", "--port", str(port), "-asc", "2"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"leanserve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
