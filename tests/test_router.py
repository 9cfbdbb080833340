"""`leanserve router` in front of real `leanserve serve` replicas (the tiny random model), all
started here: what a client sees through the router is what it sees from one replica.

The same two replicas serve every test: behind a load-balancing router (`--backend`), behind a
second one that polls health only once a minute (so a dead replica is found by a request), and
as the prefill and the decode worker of a disaggregated router. The replicas run with
--api-key, so every request here also checks that the router forwards the key.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from leanserve import cli
from leanserve.engine.config import CPU_BLOCK_SIZE
from leanserve.router.pool import Pool

from . import server_util
from .server_util import LiveServer, free_port

KEY = "sk-router-test"
AUTH = {"authorization": f"Bearer {KEY}"}


class LiveRouter:
    """A `leanserve router` process on 127.0.0.1, started as LiveServer starts a server: ready
    once its /health answers at all (200, or 503 while no backend of a role is up)."""

    def __init__(self, *args: str, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "leanserve.cli", "router", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited during start-up with code {self.proc.returncode}")
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("router did not answer in time")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        return self.proc.returncode


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample over every label set that includes ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
    return total


def served(replica: LiveServer) -> float:
    """Requests a replica finished (any reason)."""
    return metric(replica.url, "leanserve:request_success_total")


def routed(router: LiveRouter, replica: LiveServer, role: str | None = None) -> float:
    return metric(router.url, "leanserve:router_requests_total", backend=replica.url, **({"role": role} if role else {}))


def wait_for(condition, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def replica_args(kv_port: int) -> tuple[str, ...]:
    """Every replica can hand off and receive KV (kv_both): the router decides who prefills."""
    # A lease whose answer never reached the router (its client left while the prefill's bytes
    # were on the wire) is freed by its deadline: 10 s here instead of the default 120 s.
    kv = {"kv_connector": "ZmqConnector", "kv_role": "kv_both", "kv_port": kv_port, "kv_transfer_timeout_s": 3,
          "kv_lease_timeout_s": 10}
    return "--kv-cache-memory", "16M", "--api-key", KEY, "--kv-transfer-config", json.dumps(kv)


@pytest.fixture(scope="module")
def replicas(tiny_chat_model):
    """Two replicas, started at once; a test that restarts one puts the new one in its place."""
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: LiveServer(tiny_chat_model, *replica_args(free_port())), range(2)))
    yield started
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(LiveServer.stop, started))


@pytest.fixture(scope="module")
def routers(replicas):
    a, b = replicas
    with ThreadPoolExecutor(3) as pool:
        jobs = {"lb": pool.submit(LiveRouter, "--backend", a.url, b.url),
                "lazy": pool.submit(LiveRouter, "--backend", a.url, b.url, "--health-interval", "60"),
                "pd": pool.submit(LiveRouter, "--prefill", a.url, "--decode", b.url)}
        started = {k: j.result() for k, j in jobs.items()}
    yield started
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(LiveRouter.stop, started.values())) == [0, 0, 0]  # SIGTERM: clean exits


@pytest.fixture(scope="module")
def router(routers) -> LiveRouter:
    return routers["lb"]


@pytest.fixture(scope="module")
def pd_router(routers) -> LiveRouter:
    return routers["pd"]


# ------------------------------------------------------------------------------ what a client sees

COMPLETION = ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                                   "logprobs": 2, "stop": ["zz"]})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                                  "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2})


def ask(url: str, path: str, body: dict, headers: dict = AUTH) -> tuple[int, object]:
    """Status and the answer without its per-request fields (id, created): the JSON object, or
    for a stream the list of its events."""
    r = httpx.post(url + path, json=body, headers=headers, timeout=60)
    if not body.get("stream") or r.status_code != 200:
        return r.status_code, _strip(r.json())
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return r.status_code, [_strip(json.loads(e)) for e in events[:-1]]


def _strip(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def same(a, b) -> bool:
    """Equal, but for logprobs within 1e-4: two runs of one prompt may batch or hit the prefix
    cache differently, which moves float32 logprobs in the 6th digit (seen: 3.10097 vs 3.10098)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path,body", [COMPLETION, CHAT], ids=["completions", "chat"])
def test_answers_through_the_router_equal_a_replicas(router, replicas, path, body, stream):
    body = {**body, "stream": stream, "n": 2, **({"stream_options": {"include_usage": True}} if stream else {})}
    direct = ask(replicas[0].url, path, body)
    assert direct[0] == 200
    for _ in range(2):  # both replicas, by round robin
        assert same(ask(router.url, path, body), direct)


@pytest.mark.parametrize("kind", ["lb", "pd"])
def test_the_openai_client_through_the_router(routers, replicas, kind):
    via, direct = (openai.OpenAI(base_url=u + "/v1", api_key=KEY, max_retries=0, timeout=60)
                   for u in (routers[kind].url, replicas[0].url))
    model = via.models.list().data[0].id
    assert model == direct.models.list().data[0].id
    kw = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
    want = direct.completions.create(**kw)
    got = via.completions.create(**kw)
    assert (got.choices[0].text, got.choices[0].finish_reason, got.usage) == \
           (want.choices[0].text, want.choices[0].finish_reason, want.usage)
    assert "".join(c.choices[0].text for c in via.completions.create(**kw, stream=True)) == want.choices[0].text

    msgs = [{"role": "user", "content": "Hello there"}]
    want = direct.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
    got = via.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    chunks = via.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content


def test_backend_errors_pass_through_and_the_api_key_is_forwarded(router, replicas):
    bad = {"prompt": "x", "n": 99}
    assert ask(router.url, "/v1/completions", bad) == ask(replicas[0].url, "/v1/completions", bad)
    assert ask(router.url, "/v1/completions", bad)[0] == 400
    for headers in ({"authorization": "Bearer wrong"}, {}):
        status, err = ask(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers)
        assert status == 401 and err["error"]["type"] == "authentication_error"
    assert ask(router.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


def test_router_routes_health_metrics_and_errors(router):
    assert httpx.get(router.url + "/health").status_code == 200
    text = httpx.get(router.url + "/metrics").text
    for name in ("router_requests_total", "router_upstream_errors_total", "router_requests_in_flight",
                 "router_backend_up", "router_added_latency_seconds_bucket"):
        assert f"leanserve:{name}" in text
    r = httpx.get(router.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert httpx.get(router.url + "/v1/completions").status_code == 405


def test_round_robin_spreads_requests_over_both_replicas(router, replicas):
    before = [served(s) for s in replicas]
    for i in range(8):
        assert ask(router.url, "/v1/completions", {"prompt": f"spread {i}", "max_tokens": 2})[0] == 200
    assert [served(s) - b for s, b in zip(replicas, before)] == [4, 4]


# ------------------------------------------------------------------------------ clients that leave, load


def _running(replicas) -> float:
    return sum(metric(s.url, "leanserve:num_requests_running") for s in replicas)


def _generated(replicas) -> float:
    return sum(metric(s.url, "leanserve:generation_tokens_total") for s in replicas)


def _settled_generated(replicas) -> float:
    time.sleep(0.6)  # engine counters arrive with the replicas' stats snapshots (every 0.5 s)
    return _generated(replicas)


def test_a_client_that_leaves_aborts_the_upstream_request(router, replicas):
    """Streaming or not: the replica's request ends when the client leaves the router, long
    before its 2,000 tokens (seconds of work here)."""
    body = {"prompt": "a long one", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    generated = _settled_generated(replicas)
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line after each event
        wait_for(lambda: _running(replicas) == 1, what="the stream to be running upstream")
    wait_for(lambda: _running(replicas) == 0, what="the upstream request to end")
    assert (now := _settled_generated(replicas)) - generated < 2000

    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    wait_for(lambda: _running(replicas) == 0, what="the upstream request to end")
    assert _settled_generated(replicas) - now < 2000


@pytest.mark.parametrize("kind", ["lb", "pd"])
def test_64_concurrent_streams_lose_nothing(routers, replicas, kind):
    """Through the load balancer, half go to each replica; through prefill -> decode, every one
    is prefilled on a and decoded on b from the KV it received."""
    router, (a, b) = routers[kind], replicas
    prompts = [f"stream number {i % 8}" for i in range(64)]
    want = {p: ask(replicas[0].url, "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True})[1]["choices"][0]["text"]
            for p in set(prompts)}

    async def one(c: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
        text, done = [], False
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line:
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert done
        return "".join(text)

    async def main():
        async with httpx.AsyncClient(base_url=router.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    before, pulled = [served(s) for s in replicas], kv_pulled(b)
    expired = metric(a.url, "leanserve:kv_leases_expired_total")
    assert asyncio.run(main()) == [want[p] for p in prompts]
    assert [served(s) - n for s, n in zip(replicas, before)] == ([32, 32] if kind == "lb" else [64, 64])
    assert metric(router.url, "leanserve:router_requests_in_flight") == 0
    if kind == "pd":
        wait_for(lambda: kv_pulled(b) - pulled == 64, what="64 transfers counted")
        # A pulled lease ends on the prefill worker only once its transfer thread sees ZeroMQ done
        # with the answer's frames (it checks every millisecond), and its engine frees the blocks at
        # its next step, which can be after the decode worker counted the pull: wait for that,
        # and check that every lease ended so, none left to its deadline.
        wait_for(lambda: metric(a.url, "leanserve:kv_leases") == 0, what="every lease released")
        assert metric(a.url, "leanserve:kv_leases_expired_total") == expired


# ------------------------------------------------------------------------------ disaggregated prefill/decode


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path,body", [COMPLETION, CHAT], ids=["completions", "chat"])
def test_prefill_then_decode_answers_equal_a_replicas(pd_router, replicas, path, body, stream, n):
    """The decode worker receives the prompt's KV (and computes its last token) and answers as a
    single server: text, logprobs, stop strings, finish reasons, usage, SSE framing."""
    a, b = replicas
    body = {**body, "n": n, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    # Usage reports the prefill worker's prefix-cache hits, as a single server would: the prompt
    # is in a's cache from here on, so the two answers below see the same cache.
    ask(a.url, path, body)
    before = routed(pd_router, a, "prefill"), routed(pd_router, b, "decode"), kv_pulled(b)
    assert same(ask(pd_router.url, path, body), ask(a.url, path, body))
    assert (routed(pd_router, a, "prefill"), routed(pd_router, b, "decode")) == (before[0] + 1, before[1] + 1)
    wait_for(lambda: kv_pulled(b) == before[2] + 1, what="the decode worker's transfer to be counted")


def kv_pulled(replica: LiveServer) -> float:
    return metric(replica.url, "leanserve:kv_transfers_completed_total")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path,body", [COMPLETION, CHAT], ids=["completions", "chat"])
def test_a_request_the_prefill_finishes_never_reaches_decode(pd_router, replicas, path, body, stream):
    a, b = replicas
    limit = {"max_completion_tokens": 1} if path == CHAT[0] else {"max_tokens": 1}
    body = {**body, **limit, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    before = routed(pd_router, b, "decode")
    assert same(ask(pd_router.url, path, body), ask(a.url, path, body))
    assert routed(pd_router, b, "decode") == before


def test_a_failed_prefill_never_reaches_decode(pd_router, replicas):
    a, b = replicas
    before = routed(pd_router, b, "decode")
    bad = {"prompt": "x", "max_tokens": 5, "n": 99}
    assert ask(pd_router.url, "/v1/completions", bad) == ask(a.url, "/v1/completions", bad)
    assert ask(pd_router.url, "/v1/completions", {"prompt": "x", "max_tokens": 5}, {})[0] == 401
    r, direct = (httpx.post(u + "/v1/completions", content=b"{not json", headers=AUTH) for u in (pd_router.url, a.url))
    assert (r.status_code, _strip(r.json())) == (400, _strip(direct.json()))
    assert routed(pd_router, b, "decode") == before


def test_clients_that_leave_a_disaggregated_request_leak_no_lease_or_block(pd_router, replicas):
    """Streams cut after their first token, and non-streaming requests given up at once, at
    every stage of the flow: afterwards both workers hold no KV block and no request, and every
    lease is freed — pulled, released by the worker that saw its client leave, or, for an answer
    that was already on the wire to a router whose client left (no worker can tell it was never
    read), by its deadline."""
    a, b = replicas
    body = {"prompt": "leave me " * 40, "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def leave(c: httpx.AsyncClient, i: int) -> None:
        if i % 2:
            with contextlib.suppress(httpx.TimeoutException):
                await c.post("/v1/completions", json={**body, "seed": i}, timeout=0.05 * (i % 7))
            return
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return

    async def main():
        async with httpx.AsyncClient(base_url=pd_router.url, headers=AUTH, timeout=60) as c:
            await asyncio.gather(*(leave(c, i) for i in range(32)))

    asyncio.run(main())
    for replica in replicas:
        wait_for(lambda: metric(replica.url, "leanserve:kv_leases") == 0 and
                 metric(replica.url, "leanserve:kv_cache_usage_perc") == 0 and
                 metric(replica.url, "leanserve:num_requests_running") == 0, timeout=40,
                 what=f"{replica.url} to free every lease and block")
    assert metric(b.url, "leanserve:num_requests_waiting_for_kv") == 0
    # Most leases were pulled or released at once; only answers lost on the wire wait for expiry.
    created, expired = (metric(a.url, f"leanserve:kv_leases_{n}_total") for n in ("created", "expired"))
    assert expired <= created / 4, (expired, created)


def prefill_params(replica: LiveServer, prompt: str) -> dict:
    """A prefill leg sent straight to a worker: the kv_transfer_params its answer gives."""
    status, answer = ask(replica.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                          "ignore_eos": True,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and answer["kv_transfer_params"]["do_remote_prefill"] is True
    return answer["kv_transfer_params"]


def test_a_transfer_that_never_completes_fails_its_request_within_the_timeout(replicas):
    """Params naming a side channel nobody answers (a prefill worker that died): the decode
    worker fails that request with a clear error within kv_transfer_timeout_s (3 s here) and
    frees its blocks; a stream running beside it is unaffected."""
    a, b = replicas
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": 1, "remote_epoch": 1,
              "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": free_port()}
    body = {"prompt": "a prompt whose prefill worker is gone " * 4, "max_tokens": 8, "temperature": 0}
    beside = {"prompt": "beside", "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(ask, b.url, "/v1/completions", beside)
        start = time.monotonic()
        status, err = ask(b.url, "/v1/completions", {**body, "kv_transfer_params": params})
        took = time.monotonic() - start
        assert running.result()[0] == 200 and len(running.result()[1]) >= 150
    assert status == 500 and "within kv_transfer_timeout_s=3" in err["error"]["message"], err
    assert 3 <= took < 10
    wait_for(lambda: metric(b.url, "leanserve:kv_cache_usage_perc") == 0, what="b to free the request's blocks")
    assert metric(b.url, "leanserve:kv_transfers_failed_total") >= 1


def test_a_decode_worker_with_another_block_size_is_refused_naming_it(replicas, tiny_chat_model):
    a, _ = replicas
    other = LiveServer(tiny_chat_model, *replica_args(free_port()), "--block-size", "8")
    try:
        prompt = "mismatched workers " * 6
        for stream in (False, True):
            r = httpx.post(other.url + "/v1/completions", headers=AUTH, timeout=60, json={
                "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream,
                "kv_transfer_params": prefill_params(a, prompt)})
            message = r.json()["error"]["message"] if not stream else json.loads(r.text.split("\n\n")[0][6:])[
                "error"]["message"]
            named = f"block_size: {CPU_BLOCK_SIZE} on the prefill worker, 8 on the decode worker"
            assert (r.status_code, named in message) == (500 if not stream else 200, True), message
        wait_for(lambda: metric(a.url, "leanserve:kv_leases") == 0, what="the refused leases to be freed")
    finally:
        other.stop()


def test_the_decode_worker_receives_the_prompts_kv_instead_of_computing_it(pd_router, replicas):
    a, b = replicas
    prompt = "a prompt no earlier test sent, so no prefix cache holds it: " + " ".join(["kv"] * 64)
    before = metric(b.url, "leanserve:prompt_tokens_total")
    status, answer = ask(pd_router.url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200
    time.sleep(0.6)  # engine counters arrive with the stats snapshots (every 0.5 s)
    # With the KV handed over, the decode worker computes at most the last prompt token.
    assert metric(b.url, "leanserve:prompt_tokens_total") - before <= 1


# ------------------------------------------------------------------------------ a replica dies and comes back


def test_a_killed_replica_leaves_rotation_and_returns_when_restarted(routers, replicas, tiny_chat_model,
                                                                     monkeypatch):
    lb, lazy, pd = routers["lb"], routers["lazy"], routers["pd"]
    a, b = replicas
    kv_port = json.loads(a.proc.args[-1])["kv_port"]
    old_params = prefill_params(a, "from a worker's former life " * 4)
    # The lazy router's first pick is replica a: a stream on it when it dies is cut, not retried
    # (its first bytes are out), and the client sees an incomplete answer.
    body = {"prompt": "cut short", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", lazy.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        engine = a.engine_pid()
        a.stop(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # it may have seen its parent go and left already
            os.kill(engine, signal.SIGKILL)
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in lines:
                pass

    # The lazy router last asked /health a minute ago: a request finds the dead replica, which
    # refuses the connection, and is retried on the other one.
    before_b = served(b)
    for i in range(4):
        assert ask(lazy.url, "/v1/completions", {"prompt": f"still {i}", "max_tokens": 2})[0] == 200
    assert metric(lazy.url, "leanserve:router_upstream_errors_total", backend=a.url) == 2  # the cut, the refusal
    assert metric(lazy.url, "leanserve:router_backend_up", backend=a.url) == 0
    assert served(b) - before_b == 4

    # The polling router takes it out within a health interval; requests keep succeeding.
    for i in range(4):
        assert ask(lb.url, "/v1/completions", {"prompt": f"still {i}", "max_tokens": 2})[0] == 200
    wait_for(lambda: metric(lb.url, "leanserve:router_backend_up", backend=a.url) == 0, what="a out of rotation")
    assert httpx.get(lb.url + "/health").status_code == 200

    # Disaggregated, with its only prefill worker gone: an error in OpenAI's shape, no decode.
    decoded = routed(pd, b, "decode")
    status, err = ask(pd.url, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status in (502, 503) and err["error"]["code"] == status
    assert routed(pd, b, "decode") == decoded
    wait_for(lambda: httpx.get(pd.url + "/health").status_code == 503, what="the pd router's /health to be 503")

    # Restarted on the same address (HTTP and side channel), with a new engine id, it is back in
    # rotation within a health interval; params of its former life are refused naming that.
    monkeypatch.setattr(server_util, "free_port", lambda: a.port)
    replicas[0] = a = LiveServer(tiny_chat_model, *replica_args(kv_port))
    wait_for(lambda: metric(lb.url, "leanserve:router_backend_up", backend=a.url) == 1, what="a back in rotation")
    before = served(a)
    for i in range(4):
        assert ask(lb.url, "/v1/completions", {"prompt": f"back {i}", "max_tokens": 2})[0] == 200
    assert served(a) - before == 2
    wait_for(lambda: httpx.get(pd.url + "/health").status_code == 200, what="the pd router's /health to be 200")
    status, err = ask(b.url, "/v1/completions", {"prompt": "from a worker's former life " * 4, "max_tokens": 4,
                                                  "kv_transfer_params": old_params})
    assert status == 500 and f"engine {old_params['remote_engine_id']} is not this prefill worker's" in \
        err["error"]["message"]
    pulled = kv_pulled(b)
    assert ask(pd.url, "/v1/completions", {"prompt": "after the restart", "max_tokens": 4})[0] == 200
    wait_for(lambda: kv_pulled(b) == pulled + 1, what="b to pull KV from the restarted worker")


# ------------------------------------------------------------------------------ no processes


def _pool(policy: str, up=(True, True, True)) -> Pool:
    pool = Pool("backend", ("http://a:1", "http://b:1", "http://c:1"), policy)
    for b, u in zip(pool.backends, up):
        b.up = u
    return pool


def test_round_robin_skips_backends_that_are_down():
    pool = _pool("round_robin", up=(True, False, True))
    assert [pool.pick().url for _ in range(4)] == ["http://a:1", "http://c:1"] * 2
    a, _, c = pool.backends
    assert pool.pick(exclude=a) is c and pool.pick(exclude=c) is a
    c.up = False
    assert pool.pick(exclude=a) is None


def test_least_loaded_picks_the_fewest_in_flight_and_breaks_ties_round_robin():
    pool = _pool("least_loaded")
    a, b, c = pool.backends
    assert [pool.pick() for _ in range(3)] == [a, b, c]  # all idle: round robin
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    assert [pool.pick() for _ in range(2)] == [b, c]
    c.in_flight = 0
    assert [pool.pick() for _ in range(2)] == [c, c]
    c.up = False
    assert pool.pick() is b


@pytest.mark.parametrize("args,message", [
    (["--prefill", "http://127.0.0.1:1"], "--prefill and --decode go together"),
    (["--backend", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "give either --backend"),
    (["--backend", "127.0.0.1:8001"], "backend URL '127.0.0.1:8001': expected http://host:port"),
])
def test_bad_router_flags_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["router", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("leanserve: error: " + message) and err.count("\n") == 1


def test_the_router_imports_neither_the_engine_nor_torch():
    """It must start fast and stay light: its modules import the server's protocol at most."""
    root = Path(__file__).parents[1] / "src" / "leanserve" / "router"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [("." * node.level) + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not re.match(r"(torch|numpy|leanserve\.(engine|model|tokenizer|llm)|\.\.(engine|model|"
                                    r"tokenizer|llm))", name), f"{path.name} imports {name}"
