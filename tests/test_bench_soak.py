"""``leanserve bench soak``: its verdicts on canned answers, and a small soak of a live server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from leanserve.bench import soak

from .server_util import LiveServer


def verdict(plan: soak.Plan, handler, timeout: float = 5.0) -> str:
    """The soak's result for one request answered by ``handler`` (an httpx mock transport)."""
    async def main():
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as c:
            return await soak.run_one(c, plan, timeout)

    return asyncio.run(main()).result


def sse(*events: str) -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in events)


VALID = soak.Plan(soak.COMPLETIONS, {"prompt": "hi", "n": 2}, choices=2)
STREAM = soak.Plan(soak.COMPLETIONS, {"prompt": "hi", "n": 1, "stream": True}, choices=1)
INVALID = soak.Plan(soak.COMPLETIONS, {"prompt": "hi", "temperature": -1})
FINISHED = json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})


@pytest.mark.parametrize("plan,response,expected", [
    (VALID, httpx.Response(200, json={"choices": [{"finish_reason": "stop"}] * 2}), soak.OK),
    (VALID, httpx.Response(200, json={"choices": [{"finish_reason": "stop"}]}), soak.LOST),  # a choice missing
    (VALID, httpx.Response(200, content=b'{"choices": ['), soak.LOST),  # does not parse
    (VALID, httpx.Response(500, json={}), soak.SERVER_ERROR),
    (VALID, httpx.Response(400, json={}), soak.REJECTED),
    (STREAM, httpx.Response(200, content=sse(FINISHED, "[DONE]")), soak.OK),
    (STREAM, httpx.Response(200, content=sse(FINISHED)), soak.LOST),  # no [DONE]
    (STREAM, httpx.Response(200, content=sse('{"choices": [{"index": 0, "text": "x"}]}', "[DONE]")), soak.LOST),
    (STREAM, httpx.Response(200, content=sse('{"error": {"code": 500}}', "[DONE]")), soak.SERVER_ERROR),
    (INVALID, httpx.Response(400, json={}), soak.INVALID_4XX),
    (INVALID, httpx.Response(200, json={"choices": []}), soak.INVALID_NOT_4XX),
    (INVALID, httpx.Response(500, json={}), soak.INVALID_NOT_4XX),
])
def test_verdicts(plan, response, expected):
    assert verdict(plan, lambda _request: response) == expected


def test_connection_errors_hangs_and_our_own_aborts():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    async def slow(_request):
        await asyncio.sleep(30)

    assert verdict(VALID, refuse) == soak.LOST
    assert verdict(INVALID, refuse) == soak.INVALID_NOT_4XX
    assert verdict(VALID, slow, timeout=0.2) == soak.HUNG
    give_up = soak.Plan(soak.COMPLETIONS, {"prompt": "hi"}, choices=1, give_up_after_s=0.05)
    assert verdict(give_up, slow) == soak.ABORTED
    close_early = soak.Plan(soak.COMPLETIONS, {"stream": True}, choices=1, abort_after_chunks=1)
    endless = httpx.Response(200, content=sse(*['{"choices": [{"index": 0, "text": "x"}]}'] * 3))
    assert verdict(close_early, lambda _request: endless) == soak.ABORTED


def test_workload_is_seeded_and_mix_configurable():
    a = soak.parse_args(["--num-requests", "300", "--seed", "3", "--mix", "echo_logprobs=0,invalid=30"])
    plans = soak.plan_requests(a, "m")
    assert plans == soak.plan_requests(a, "m")
    kinds = {k for k, _ in plans}
    assert "echo_logprobs" not in kinds and kinds == set(soak.DEFAULT_MIX) - {"echo_logprobs"}
    assert all(not p.valid for k, p in plans if k == "invalid") and all(p.valid for k, p in plans if k != "invalid")
    with pytest.raises(SystemExit):
        soak.parse_args(["--mix", "nosuchkind=1"])
    with pytest.raises(SystemExit):
        soak.parse_args(["--base-url", "http://10.0.0.1:8000"])


def test_soak_of_a_live_server(tiny_chat_model, tmp_path):
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M")
    try:
        report = soak.run(["--base-url", s.url, "--server-pid", str(s.proc.pid), "--num-requests", "60",
                           "--concurrency", "8", "--max-tokens", "8", "--request-timeout", "30",
                           "--save-result", str(tmp_path / "soak.json"), "--no-progress"])
    finally:
        s.stop()
    assert json.loads((tmp_path / "soak.json").read_text()).keys() == report.keys()
    assert report["sent"]["total"] == sum(report["sent"]["per_kind"].values()) == sum(report["results"].values()) == 60
    assert set(report["rss"]) == {"api", "engine"} and all(r["end_kib"] > 0 for r in report["rss"].values())
    failures = {k: report[k] for k in ("lost", "server_errors", "rejected_valid", "invalid_not_4xx", "hung")}
    assert failures == dict.fromkeys(failures, 0), report["failure_examples"]
    assert report["gauges_after_settling"] == {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0}
    assert report["healthy_at_end"]


def test_serve_args_starts_measures_and_stops_its_own_server(tiny_chat_model, tmp_path):
    report = soak.run(["--serve-args", f"{tiny_chat_model} --dtype float32 --kv-cache-memory 16M",
                       "--num-requests", "20", "--concurrency", "4", "--max-tokens", "4", "--no-progress"])
    pids = report["server"]["pids"]
    assert report["server"]["base_url"].startswith("http://127.0.0.1:") and pids["engine"] is not None
    assert report["results"][soak.OK] > 0 and all(r["end_kib"] > 0 for r in report["rss"].values())
    deadline = time.monotonic() + 10
    while any(soak.rss_kib(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(soak.rss_kib(pid) for pid in pids.values())  # both stopped at the end
