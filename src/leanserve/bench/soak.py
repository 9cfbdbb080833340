"""``leanserve bench soak``: a reliability soak of a leanserve server under a mixed workload.

``--num-requests`` requests at ``--concurrency``, each of a kind the seeded RNG draws from
``--mix``: chat and completions, streaming or not, n 1-4, stop strings, logprobs, echo with
prompt logprobs, invalid requests (which must get a 4xx) and client aborts (a stream closed
after a random number of chunks; a non-streaming request given up after a short random
timeout). The requests we abort ask for ``--abort-max-tokens`` with EOS ignored, so one the
server fails to abort is still running when the soak ends. Afterwards it waits for the server to
settle and checks that nothing leaked.

Goals; the exit status is 1 when one is missed:

* lost: valid requests without a complete response (a stream without ``[DONE]`` that we did not
  close ourselves, a choice without a finish reason, a connection error, a body that does not
  parse): 0
* valid requests answered with a 5xx (status or in-band error event): 0; with another non-200: 0
* invalid requests answered with anything but a 4xx: 0
* hung requests (no complete answer within ``--request-timeout``; counted apart from lost): 0
* once settled: requests running and waiting in the engine, KV blocks in use: 0
* RSS of the API and engine processes, growth from after the first 10 % of requests to the end:
  within 5 %
* ``/health`` answers 200 at the end

``--serve-args`` starts the server itself (on loopback, a free port) and stops it with SIGTERM
at the end, so one command produces the result; otherwise ``--base-url`` (loopback only) names
a running server and ``--server-pid`` its API process for the RSS figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
import numpy as np

from ..engine.endpoints import free_ports
from ..engine.messages import STATS_PERIOD_S
from .serve import LOOPBACK, percentile_ms, read_stats

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# Per-request results. The first three are what a request may end in without a failure.
OK, ABORTED, INVALID_4XX = "ok", "aborted", "invalid_4xx"
LOST, SERVER_ERROR, REJECTED, INVALID_NOT_4XX, HUNG = "lost", "5xx", "rejected", "invalid_not_4xx", "hung"
RESULTS = (OK, ABORTED, INVALID_4XX, LOST, SERVER_ERROR, REJECTED, INVALID_NOT_4XX, HUNG)

# Kinds and their default weights (``--mix kind=weight,...`` changes some; weight 0 leaves a kind out).
DEFAULT_MIX = {
    "chat": 10, "chat_stream": 10, "completion": 10, "completion_stream": 10,
    "chat_logprobs": 8, "completion_logprobs": 8, "echo_logprobs": 8,
    "invalid": 12, "abort_stream": 12, "abort_timeout": 12,
}
INVALID_VARIANTS = ("temperature", "max_tokens", "model", "n", "logprobs", "malformed_json", "lone_surrogate")

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above old stone "
         "bridges and quiet rivers near the city of light . , ! ?").split()
STOPS = (".", ",", "\n", " the", " and", "!")
GAUGES = ("num_running", "num_waiting", "kv_blocks_used")
RSS_GROWTH_GOAL = 0.05
SERVER_STARTUP_S = 300.0


@dataclass
class Plan:
    """One request to send: a JSON body, or raw bytes for one ``json=`` would not send as is
    (malformed JSON, an escaped lone surrogate)."""

    path: str
    body: dict | bytes
    choices: int = 0  # choices a complete response carries; 0 marks an invalid request
    abort_after_chunks: int | None = None  # close the stream after this many events
    give_up_after_s: float | None = None  # stop waiting for a non-streaming answer after this long

    @property
    def valid(self) -> bool:
        return self.choices > 0

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


@dataclass
class Outcome:
    result: str
    latency_s: float
    detail: str = ""


# ---------------------------------------------------------------------------------- the workload


def _text(rng, lo: int = 1, hi: int = 48) -> str:
    return " ".join(str(w) for w in rng.choice(WORDS, int(rng.integers(lo, hi + 1))))


def _sampling(rng, a, model: str) -> dict:
    body = {"model": model, "max_tokens": int(rng.integers(1, a.max_tokens + 1)),
            "temperature": float(rng.choice([0.0, 0.7, 1.0])), "n": int(rng.integers(1, 5))}
    if rng.random() < 0.4:
        body["stop"] = [str(s) for s in rng.choice(STOPS, int(rng.integers(1, 3)), replace=False)]
    if rng.random() < 0.5:
        body["seed"] = int(rng.integers(0, 2**31))
    return body


def _stream_fields(rng, stream: bool) -> dict:
    # stream_options only with stream: the server rightly rejects it otherwise.
    return {"stream": True, "stream_options": {"include_usage": bool(rng.random() < 0.5)}} if stream else {}


def _chat(rng, a, model: str, stream: bool, **extra) -> Plan:
    messages = [{"role": "user", "content": _text(rng)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": _text(rng, 1, 12)})
    body = _sampling(rng, a, model) | _stream_fields(rng, stream) | extra | {"messages": messages}
    return Plan(CHAT, body, choices=body["n"])


def _completion(rng, a, model: str, stream: bool, **extra) -> Plan:
    shape = rng.random()
    if shape < 0.15:  # two prompts in one request: n choices for each
        prompt, prompts = [_text(rng), _text(rng)], 2
    elif shape < 0.3:  # token ids; below 1000, inside any real vocabulary
        prompt, prompts = rng.integers(100, 1000, int(rng.integers(1, 33))).tolist(), 1
    else:
        prompt, prompts = _text(rng), 1
    body = _sampling(rng, a, model) | _stream_fields(rng, stream) | extra | {"prompt": prompt}
    return Plan(COMPLETIONS, body, choices=body["n"] * prompts)


def _either(rng, a, model: str, stream: bool) -> Plan:
    return (_chat if rng.random() < 0.5 else _completion)(rng, a, model, stream)


def _long(rng, a, model: str, stream: bool) -> Plan:
    """A request we abort: long, EOS ignored and no stop strings, so the abort lands mid-generation
    and a request the server fails to abort is still running when the soak ends."""
    plan = _either(rng, a, model, stream)
    plan.body.pop("stop", None)
    plan.body |= {"max_tokens": a.abort_max_tokens, "ignore_eos": True}
    return plan


def _abort_stream(rng, a, model: str) -> Plan:
    plan = _long(rng, a, model, stream=True)
    plan.abort_after_chunks = int(rng.integers(0, 9))
    return plan


def _abort_timeout(rng, a, model: str) -> Plan:
    plan = _long(rng, a, model, stream=False)
    plan.give_up_after_s = float(rng.uniform(0.05, 1.0))
    return plan


def _invalid(rng, a, model: str) -> Plan:
    chat = rng.random() < 0.5
    body = {"model": model, **({"stream": True} if rng.random() < 0.5 else {})}
    body |= {"messages": [{"role": "user", "content": _text(rng)}]} if chat else {"prompt": _text(rng)}
    variant = str(rng.choice(INVALID_VARIANTS))
    path = CHAT if chat else COMPLETIONS
    if variant == "malformed_json":
        return Plan(path, json.dumps(body).encode()[:-1])  # the closing brace cut off
    if variant == "lone_surrogate":  # valid JSON ("\\ud800" escaped), but no valid Unicode text
        text = {"messages": [{"role": "user", "content": "a \ud800 b"}]} if chat else {"prompt": "a \ud800 b"}
        return Plan(path, json.dumps(body | text).encode())
    bad = {"temperature": {"temperature": -1.0}, "max_tokens": {"max_tokens": 0}, "model": {"model": "no-such-model"},
           "n": {"n": 0}, "logprobs": {"logprobs": True, "top_logprobs": 1000} if chat else {"logprobs": 1000}}
    return Plan(path, body | bad[variant])


BUILDERS = {
    "chat": lambda rng, a, m: _chat(rng, a, m, stream=False),
    "chat_stream": lambda rng, a, m: _chat(rng, a, m, stream=True),
    "completion": lambda rng, a, m: _completion(rng, a, m, stream=False),
    "completion_stream": lambda rng, a, m: _completion(rng, a, m, stream=True),
    "chat_logprobs": lambda rng, a, m: _chat(rng, a, m, stream=bool(rng.random() < 0.5), logprobs=True,
                                             top_logprobs=int(rng.integers(0, 4))),
    "completion_logprobs": lambda rng, a, m: _completion(rng, a, m, stream=bool(rng.random() < 0.5),
                                                         logprobs=int(rng.integers(0, 4))),
    "echo_logprobs": lambda rng, a, m: _completion(rng, a, m, stream=bool(rng.random() < 0.5), echo=True,
                                                   logprobs=int(rng.integers(0, 4))),
    "invalid": _invalid,
    "abort_stream": _abort_stream,
    "abort_timeout": _abort_timeout,
}


def plan_requests(a, model: str) -> list[tuple[str, Plan]]:
    """(kind, plan) per request, all drawn up front from ``--seed``: the same workload every run,
    whatever order the requests complete in."""
    rng = np.random.default_rng(a.seed)
    kinds = [k for k, w in a.mix.items() if w > 0]
    weights = np.array([a.mix[k] for k in kinds], dtype=float)
    drawn = [str(k) for k in rng.choice(kinds, a.num_requests, p=weights / weights.sum())]
    return [(kind, BUILDERS[kind](rng, a, model)) for kind in drawn]


# ---------------------------------------------------------------------------------- one request


def _status_result(plan: Plan, status: int) -> str:
    if not plan.valid:
        return INVALID_4XX if 400 <= status < 500 else INVALID_NOT_4XX
    return SERVER_ERROR if status >= 500 else REJECTED


def _post(c: httpx.AsyncClient, plan: Plan):
    if isinstance(plan.body, bytes):
        return c.post(plan.path, content=plan.body, headers={"content-type": "application/json"})
    return c.post(plan.path, json=plan.body)


def _check_choices(plan: Plan, body) -> tuple[str, str]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != plan.choices:
        got = len(choices) if isinstance(choices, list) else "none"
        return LOST, f"expected {plan.choices} choices, got {got}"
    if not all(isinstance(ch, dict) and ch.get("finish_reason") for ch in choices):
        return LOST, "a choice without finish_reason"
    return OK, ""


async def _plain(c: httpx.AsyncClient, plan: Plan) -> tuple[str, str]:
    if plan.give_up_after_s is None:
        resp = await _post(c, plan)
    else:
        try:  # the client gives up: the server sees the connection close while it generates
            resp = await asyncio.wait_for(_post(c, plan), plan.give_up_after_s)
        except asyncio.TimeoutError:
            return ABORTED, ""
    if resp.status_code != 200:
        return _status_result(plan, resp.status_code), f"HTTP {resp.status_code}: {resp.text[:200]}"
    if not plan.valid:
        return INVALID_NOT_4XX, "HTTP 200"
    try:
        body = resp.json()
    except ValueError:
        return LOST, f"body does not parse: {resp.text[:200]!r}"
    return _check_choices(plan, body)


async def _read_events(resp: httpx.Response, plan: Plan) -> tuple[str, str]:
    """Reads SSE events to ``[DONE]``: complete when every choice got a finish reason."""
    if plan.abort_after_chunks == 0:
        return ABORTED, ""  # closed right after the headers
    finished, events = set(), 0
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue  # the blank line between events
        if line == "data: [DONE]":
            break
        try:
            event = json.loads(line[6:])
        except ValueError:
            event = None
        if not isinstance(event, dict):
            return LOST, f"event does not parse: {line[:200]!r}"
        if "error" in event:  # a failure after the 200, reported in-band
            code = event["error"].get("code") if isinstance(event["error"], dict) else None
            return (SERVER_ERROR if isinstance(code, int) and code >= 500 else LOST), f"error event: {line[:200]}"
        finished |= {ch.get("index") for ch in event.get("choices") or []
                     if isinstance(ch, dict) and ch.get("finish_reason")}
        events += 1
        if events == plan.abort_after_chunks:
            return ABORTED, ""  # leaving the stream's context closes the connection
    else:
        return LOST, f"stream ended without [DONE] after {events} events"
    if len(finished) != plan.choices:
        return LOST, f"[DONE] with {len(finished)} of {plan.choices} choices finished"
    return OK, ""


async def _streamed(c: httpx.AsyncClient, plan: Plan) -> tuple[str, str]:
    async with c.stream("POST", plan.path, json=plan.body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread())[:200]
            return _status_result(plan, resp.status_code), f"HTTP {resp.status_code}: {text!r}"
        return await _read_events(resp, plan)


async def _send(c: httpx.AsyncClient, plan: Plan) -> tuple[str, str]:
    try:
        # Invalid requests are sent whole and judged by status, whatever they asked for.
        return await (_streamed(c, plan) if plan.valid and plan.stream else _plain(c, plan))
    except httpx.HTTPError as e:
        return (LOST if plan.valid else INVALID_NOT_4XX), repr(e)


async def run_one(c: httpx.AsyncClient, plan: Plan, timeout: float) -> Outcome:
    start = time.perf_counter()
    try:
        result, detail = await asyncio.wait_for(_send(c, plan), timeout)
    except asyncio.TimeoutError:
        result, detail = HUNG, f"no complete answer in {timeout:g} s"
    return Outcome(result, time.perf_counter() - start, detail)


# ---------------------------------------------------------------------------------- the server's side


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None  # gone, or a zombie (which has no VmRSS line)


def engine_pid(api_pid: int) -> int | None:
    """The engine-core child of the API process: the child whose command line runs
    multiprocessing's ``spawn_main`` (the resource tracker is a child too)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
            if ppid != api_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return int(entry)
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return None


def sample_rss(pids: dict[str, int | None] | None) -> dict[str, int | None] | None:
    return None if pids is None else {name: rss_kib(pid) if pid else None for name, pid in pids.items()}


def settle(base_url: str, timeout: float) -> tuple[dict | None, float]:
    """Polls /stats until nothing runs or waits and no KV block is in use, or ``timeout`` passes.
    Returns the last gauges (None without /stats) and the seconds waited."""
    start = time.monotonic()
    time.sleep(STATS_PERIOD_S + 0.1)  # a snapshot taken after the last request, not one from mid-run
    while True:
        stats = read_stats(base_url)
        gauges = {g: stats.get(g) for g in GAUGES} if stats else None
        waited = time.monotonic() - start
        if (gauges and all(v == 0 for v in gauges.values())) or waited >= timeout:
            return gauges, waited
        time.sleep(0.25)


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def launched_server(serve_args: str):
    """``leanserve serve <serve_args>`` on a free loopback port: yields (base URL, pid), then SIGTERM."""
    (port,) = free_ports("127.0.0.1", 1)
    cmd = [sys.executable, "-m", "leanserve.cli", "serve", *shlex.split(serve_args), "--host", "127.0.0.1",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=2)  # the server's output to our stderr: stdout is the report's
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_STARTUP_S
        while not healthy(url):
            if proc.poll() is not None:
                sys.exit(f"leanserve bench soak: the server exited during start-up with code {proc.returncode}")
            if time.monotonic() > deadline:
                sys.exit(f"leanserve bench soak: the server was not healthy after {SERVER_STARTUP_S:g} s")
            time.sleep(0.25)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------- the run


async def run_soak(a, base_url: str, plans: list[tuple[str, Plan]], pids) -> tuple[list[Outcome], float, dict | None]:
    """Sends every plan, ``a.concurrency`` at a time. Returns the outcomes (in plan order), the
    duration, and RSS sampled when the first 10 % of requests had finished."""
    from tqdm import tqdm

    outcomes: list[Outcome | None] = [None] * len(plans)
    early_at, rss_early, done = max(1, len(plans) // 10), None, 0
    bar = tqdm(total=len(plans), desc="bench soak", disable=a.no_progress)
    todo = iter(enumerate(plans))
    # No client timeout: the per-request deadline is run_one's, so a slow answer is "hung".
    limits = httpx.Limits(max_connections=a.concurrency, max_keepalive_connections=a.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as c:
        async def worker():
            nonlocal done, rss_early
            for i, (_, plan) in todo:  # one shared iterator: each worker takes the next plan
                outcomes[i] = await run_one(c, plan, a.request_timeout)
                bar.update(1)
                done += 1
                if done == early_at:
                    rss_early = sample_rss(pids)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
        duration = time.perf_counter() - start
    bar.close()
    return outcomes, duration, rss_early


def _rss_report(early: dict | None, end: dict | None) -> dict | None:
    if early is None or end is None:
        return None
    out = {}
    for name in early:
        e, f = early[name], end[name]
        out[name] = {"early_kib": e, "end_kib": f, "growth": (f / e - 1) if e and f else None}
    return out


def _goals(counts: Counter, gauges: dict | None, rss: dict | None, is_healthy: bool) -> list[dict]:
    """Each goal: its value, the goal in words, and met (None where not measured)."""
    goals = [{"name": name, "value": counts[result], "goal": "0", "met": counts[result] == 0}
             for name, result in (("lost", LOST), ("5xx for valid requests", SERVER_ERROR),
                                  ("other non-200 for valid requests", REJECTED),
                                  ("non-4xx for invalid requests", INVALID_NOT_4XX), ("hung", HUNG))]
    for g in GAUGES:
        value = gauges.get(g) if gauges else None
        goals.append({"name": f"{g} after settling", "value": value, "goal": "0", "met": value == 0})
    for name, r in (rss or {"api": None, "engine": None}).items():
        growth = r["growth"] if r else None
        goals.append({"name": f"RSS growth, {name} process", "value": growth, "goal": f"<= {RSS_GROWTH_GOAL:.0%}",
                      "met": None if growth is None else growth <= RSS_GROWTH_GOAL})
    goals.append({"name": "/health 200 at the end", "value": is_healthy, "goal": "true", "met": is_healthy})
    return goals


def _describe(plan: Plan) -> str:
    """The request without its text, for a failure's line in the report."""
    if isinstance(plan.body, bytes):
        return f"{plan.path} raw body {plan.body[:100]!r}"
    shown = {k: v for k, v in plan.body.items() if k not in ("model", "prompt", "messages")}
    prompt = plan.body.get("prompt")
    if isinstance(prompt, list):  # its shape: several prompts, or token ids
        shown["prompt"] = f"{len(prompt)} {'prompts' if isinstance(prompt[0], str) else 'token ids'}"
    return f"{plan.path} {json.dumps(shown)}"


def build_report(a, model: str, plans, outcomes: list[Outcome], duration: float, gauges: dict | None,
                 settle_s: float, rss_early: dict | None, rss_end: dict | None, is_healthy: bool,
                 rss_note: str | None) -> dict:
    counts = Counter(o.result for o in outcomes)
    per_kind: dict[str, Counter] = {}
    examples: dict[str, list[str]] = {}
    for (kind, plan), o in zip(plans, outcomes):
        per_kind.setdefault(kind, Counter())[o.result] += 1
        if o.result not in (OK, ABORTED, INVALID_4XX) and len(examples.setdefault(o.result, [])) < 5:
            examples[o.result].append(f"{kind} {_describe(plan)}: {o.detail}")
    latencies = [o.latency_s for o in outcomes if o.result == OK]
    rss = _rss_report(rss_early, rss_end)
    goals = _goals(counts, gauges, rss, is_healthy)
    return {
        "args": dict(vars(a)), "model": model, "duration_s": duration,
        "sent": {"total": len(plans), "per_kind": dict(sorted(Counter(k for k, _ in plans).items()))},
        "results": {r: counts[r] for r in RESULTS},
        "results_per_kind": {k: dict(v) for k, v in sorted(per_kind.items())},
        "lost": counts[LOST], "server_errors": counts[SERVER_ERROR], "rejected_valid": counts[REJECTED],
        "invalid_not_4xx": counts[INVALID_NOT_4XX], "hung": counts[HUNG],
        "latency_ms": {"count": len(latencies), "p50": percentile_ms(latencies, 50),
                       "p99": percentile_ms(latencies, 99)},
        "gauges_after_settling": gauges, "settle_s": settle_s,
        "rss": rss, "rss_note": rss_note, "healthy_at_end": is_healthy,
        "goals": goals, "passed": all(g["met"] is not False for g in goals),
        "failure_examples": examples,
    }


def print_report(r: dict) -> None:
    w = 60
    print("{s:{c}^{n}}".format(s=" Soak Result ", n=w, c="="))
    print(f"{'Requests sent:':<44}{r['sent']['total']}")
    for kind, n in r["sent"]["per_kind"].items():
        print(f"  {kind + ':':<42}{n}")
    print(f"{'Duration (s):':<44}{r['duration_s']:.1f}")
    print("{s:{c}^{n}}".format(s="Results", n=w, c="-"))
    for result, n in r["results"].items():
        print(f"  {result + ':':<42}{n}")
    lat = r["latency_ms"]
    print(f"{'Latency of valid completed p50/p99 (ms):':<44}{lat['p50']:.0f} / {lat['p99']:.0f} ({lat['count']})")
    if r["rss"]:
        for name, x in r["rss"].items():
            growth = "n/a" if x["growth"] is None else f"{x['growth']:+.1%}"
            print(f"{f'RSS {name} after 10 % / end (MiB):':<44}{(x['early_kib'] or 0) / 1024:.0f} / "
                  f"{(x['end_kib'] or 0) / 1024:.0f} ({growth})")
    else:
        print(f"{'RSS:':<44}not measured ({r['rss_note']})")
    print("{s:{c}^{n}}".format(s="Goals", n=w, c="-"))
    for g in r["goals"]:
        mark = {True: "ok", False: "MISSED", None: "n/a"}[g["met"]]
        value = f"{g['value']:+.1%}" if isinstance(g["value"], float) else g["value"]
        print(f"  {g['name'] + ':':<42}{value!s:<10}(goal {g['goal']}) {mark}")
    for result, lines in r["failure_examples"].items():
        print(f"First {result} requests:")
        for line in lines:
            print(f"  {line}")
    print("=" * w)
    print("all goals met" if r["passed"] else
          "goals missed: " + ", ".join(g["name"] for g in r["goals"] if g["met"] is False))


def _soak_and_report(a, base_url: str, server_pid: int | None) -> dict:
    model = a.model or httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    plans = plan_requests(a, model)
    pids, note = None, "no --server-pid or --serve-args"
    if server_pid is not None:
        pids, note = {"api": server_pid, "engine": engine_pid(server_pid)}, None
        if pids["engine"] is None:
            note = f"no engine child process of pid {server_pid} found"
    outcomes, duration, rss_early = asyncio.run(run_soak(a, base_url, plans, pids))
    gauges, settle_s = settle(base_url, a.settle_timeout)
    report = build_report(a, model, plans, outcomes, duration, gauges, settle_s, rss_early, sample_rss(pids),
                          healthy(base_url), note)
    report["server"] = {"base_url": base_url, "pids": pids}
    print_report(report)
    if a.save_result:
        with open(a.save_result, "w") as f:
            json.dump(report, f, indent=1)
    return report


def parse_mix(text: str) -> dict[str, float]:
    mix = dict(DEFAULT_MIX)
    for item in filter(None, text.split(",")):
        kind, _, weight = item.partition("=")
        if kind.strip() not in DEFAULT_MIX:
            raise argparse.ArgumentTypeError(f"unknown kind {kind.strip()!r}; kinds: {', '.join(DEFAULT_MIX)}")
        try:
            mix[kind.strip()] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected kind=weight") from None
    if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("weights must be >= 0, and not all 0")
    return mix


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="leanserve bench soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="kinds and default weights: " + ", ".join(f"{k}={w}" for k, w in
                                                                                  DEFAULT_MIX.items()))
    ap.add_argument("--base-url", default=None, help="a running server (default http://127.0.0.1:8000)")
    ap.add_argument("--server-pid", type=int, default=None, help="its API process, for RSS (and its engine child)")
    ap.add_argument("--serve-args", default=None,
                    help='start `leanserve serve <these args>` on a free loopback port, soak it, then stop it; '
                         'e.g. "--dtype auto"')
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds; a request past it is hung")
    ap.add_argument("--max-tokens", type=int, default=32, help="most output tokens per choice of a valid request")
    ap.add_argument("--abort-max-tokens", type=int, default=1024,
                    help="output tokens the requests we abort ask for (EOS ignored), so one the server fails to "
                         "abort is still running at the end; prompt + this must fit the server's max model length")
    ap.add_argument("--mix", type=parse_mix, default=dict(DEFAULT_MIX),
                    help="kind=weight,... overriding the default weights; 0 leaves a kind out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle-timeout", type=float, default=10.0, help="seconds to wait for the gauges to reach 0")
    ap.add_argument("--save-result", default=None, help="write the report JSON here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.serve_args is not None and (a.base_url or a.server_pid):
        ap.error("--serve-args: the soak starts and measures its own server; not with --base-url or --server-pid")
    if a.serve_args is None:
        a.base_url = a.base_url or "http://127.0.0.1:8000"
    if a.base_url and urlparse(a.base_url).hostname not in LOOPBACK:
        ap.error("--base-url: load is only sent to loopback addresses (127.0.0.1, localhost, ::1)")
    if not 1 <= a.num_requests <= 100_000:
        ap.error("--num-requests: must be in [1, 100000]")
    if min(a.concurrency, a.max_tokens, a.abort_max_tokens) < 1 or a.request_timeout <= 0:
        ap.error("--concurrency, --max-tokens, --abort-max-tokens and --request-timeout must be positive")
    return a


def run(argv=None) -> dict:
    """The soak, printed and returned as a report (``report["passed"]``: every goal met)."""
    a = parse_args(argv)
    if a.serve_args is None:
        return _soak_and_report(a, a.base_url, a.server_pid)
    with launched_server(a.serve_args) as (url, pid):
        return _soak_and_report(a, url, pid)


def main(argv=None) -> None:
    if not run(argv)["passed"]:
        sys.exit(1)
