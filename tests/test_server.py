"""The server against real clients: the official openai client, raw SSE via httpx, concurrency,
bad input, disconnects, overload, auth, engine death and shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from leanserve import LLM, SamplingParams
from leanserve.engine.config import CPU_BLOCK_SIZE

from .server_util import LiveServer


@pytest.fixture(scope="module")
def server(default_model):
    s = LiveServer(None, "--kv-cache-memory", "256M", "--max-model-len", "2048", "--max-num-seqs", "64")
    yield s
    assert s.stop() == 0  # SIGTERM: clean exit


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(default_model):
    with LLM(default_model, dtype="float32", kv_cache_memory=128 << 20, max_model_len=2048) as llm:
        yield llm


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def offline_text(offline, prompt, max_tokens):
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]


# ------------------------------------------------------------------------------ the openai client


def test_completion_matches_offline_and_streaming(client, model_name, offline, default_tokenizer):
    prompt = "The three primary colors are"
    ref = offline_text(offline, prompt, 12)
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(default_tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_streamed_equals_non_streamed(client, model_name, offline):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a fruit."}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    r = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_seed_and_usage(client, model_name, default_tokenizer):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert [x.index for x in a.choices] == [0, 1]
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    assert a.usage.completion_tokens == 20
    assert a.usage.prompt_tokens == len(default_tokenizer.encode("Once upon a time"))


def test_stop_strings(client, model_name, offline):
    prompt = "Count: 1, 2, 3,"
    full = offline_text(offline, prompt, 16).text
    stop = full.strip().split(",")[1]  # a piece that occurs mid-generation
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    chunks = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.logprob >= t.top_logprobs[1].logprob for t in content)


def test_echo_with_prompt_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt="Paris is the capital of", max_tokens=2, temperature=0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("Paris is the capital of")
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) > 2


def test_prompt_token_ids_and_cached_tokens(client, model_name, server):
    long_prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog " * 12
    ids = httpx.post(server.url + "/tokenize", json={"prompt": long_prompt}).json()["tokens"]
    first = client.completions.create(model=model_name, prompt=ids, max_tokens=2, temperature=0)
    second = client.completions.create(model=model_name, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == len(ids)
    # A hit matches whole blocks (the server's: the CPU default)
    assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE
    assert first.choices[0].text == second.choices[0].text


# ------------------------------------------------------------------------------ raw SSE


def test_sse_framing(server, model_name):
    body = {"model": model_name, "prompt": "Hi there", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    choice_chunks = [p for p in payloads if p["choices"]]
    assert all(p["choices"][0]["text"] or p["choices"][0]["finish_reason"] for p in choice_chunks)
    assert choice_chunks[0]["choices"][0]["text"]  # no empty chunk before the first real token
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------------------ concurrency


def test_64_concurrent_streams_match_offline(server, model_name, offline):
    prompts = [f"Fact number {i}: the" for i in range(64)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))

    async def one(c: openai.AsyncOpenAI, prompt):
        text = []
        async for chunk in await c.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                                      stream=True):
            text.append(chunk.choices[0].text)
        return "".join(text)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [r.outputs[0].text for r in refs]


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hello " * 3000, "max_tokens": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": [1, 2, 99999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, -4611686018427387904]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [2**70]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_client_disconnect_aborts_and_frees_blocks(server, model_name):
    body = {"model": model_name, "prompt": "Write a long story about dragons.", "max_tokens": 1000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break
    # Blocks are freed within an iteration of the abort; the stats snapshot comes every 0.5 s.
    deadline = time.monotonic() + 10
    stats = {}
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/stats").json()
        if stats.get("kv_blocks_used") == 0 and stats.get("num_running") == 0:
            break
        time.sleep(0.2)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_misc_endpoints(server, model_name):
    assert httpx.get(server.url + "/version").json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat_tok = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["count"] > 5
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/completions" in spec["paths"] and "/v1/chat/completions" in spec["paths"]


def test_metrics(server, client, model_name):
    client.completions.create(model=model_name, prompt="metrics", max_tokens=3, temperature=0)
    time.sleep(0.7)  # one stats snapshot period
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "iteration_host_step_time_seconds_bucket", "iteration_forward_time_seconds_bucket",
                 "request_success_total"):
        assert f"leanserve:{name}" in text, name
    assert f'model_name="{model_name}"' in text


# ------------------------------------------------------------------------------ separate servers


def test_api_key(tiny_chat_model):
    s = LiveServer(tiny_chat_model, "--api-key", "sekret", "--kv-cache-memory", "16M")
    try:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=3,
                                         messages=[{"role": "user", "content": "hi"}]).choices[0].finish_reason
    finally:
        s.stop()


def test_overload_is_503_and_accepted_requests_complete(tiny_chat_model):
    s = LiveServer(tiny_chat_model, "--max-waiting-requests", "4", "--kv-cache-memory", "16M")
    try:
        async def one(c, i):
            try:
                r = await c.post("/v1/completions", json={"prompt": [5, 6, 7 + i], "max_tokens": 200,
                                                          "ignore_eos": True, "temperature": 0})
            except httpx.HTTPError as e:
                return ("error", str(e))
            return (r.status_code, r.json())

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, i) for i in range(16)))

        results = asyncio.run(main())
        codes = [r[0] for r in results]
        assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
        for code, body in results:
            if code == 503:
                assert body["error"]["code"] == 503
            else:
                assert body["usage"]["completion_tokens"] == 200  # accepted ones are not lost
    finally:
        s.stop()


def test_engine_death_fails_fast_and_health_says_so(tiny_chat_model):
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M")
    try:
        os.kill(s.engine_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(s.url + "/health").status_code == 503
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert time.monotonic() - t0 < 5
    finally:
        s.stop()


def test_sigterm_stops_both_processes(tiny_chat_model):
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M")
    engine = s.engine_pid()
    assert s.stop(signal.SIGTERM) == 0
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{engine}") and time.monotonic() < deadline:
        time.sleep(0.1)
    with open(f"/proc/{engine}/stat") if os.path.exists(f"/proc/{engine}") else open(os.devnull) as f:
        state = f.read().split(") ")[-1][:1] if f.name != os.devnull else ""
    assert state in ("", "Z")  # gone (or a zombie awaiting its reaper)


def test_schemathesis_finds_no_server_error(tiny_chat_model):
    """Property-based fuzzing of every operation in our own /openapi.json: no 5xx, ever."""
    import subprocess
    import sys

    st = os.path.join(os.path.dirname(sys.executable), "st")
    # A short context bounds every generated request (CI time), while every field is still fuzzed.
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M", "--max-model-len", "48")
    try:
        r = subprocess.run(
            [st, "run", s.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "30",
             "--phases", "examples,fuzzing", "--seed", "42", "--request-timeout", "60", "--no-color"],
            capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0, r.stdout[-4000:]
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_bench_serve_smoke(server, tmp_path):
    from leanserve.bench import serve as bench_serve

    out = tmp_path / "result.json"
    res = bench_serve.main(["--base-url", server.url, "--num-prompts", "4", "--max-concurrency", "2",
                            "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
                            "--no-progress", "--save-result", str(out)])
    s = res["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 16
    assert s["median_ttft_ms"] > 0 and s["output_speed_p50"] > 0
    assert res["engine"]["iterations"] > 0 and 0 <= res["engine"]["host_overhead_share"] < 1
    assert json.loads(out.read_text())["summary"]["completed"] == 4
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--base-url", "http://10.0.0.1:8000"])  # loopback only
    # --extra-body is merged into every request (how compare.py adapts to a peer's API).
    res = bench_serve.main(["--base-url", server.url, "--num-prompts", "2", "--random-input-len", "16",
                            "--random-output-len", "4", "--ignore-eos", "--no-progress",
                            "--extra-body", '{"max_tokens": 2}'])
    assert res["summary"]["total_output_tokens"] == 4
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--extra-body", "[1]"])
