"""``leanserve bench serve``: a load generator for any OpenAI-compatible server.

Metric definitions follow ``vllm bench serve``: TTFT is the time to the first chunk carrying
text; TPOT = (E2E - TTFT) / (output tokens - 1); ITL are the gaps between chunks; output token
counts come from the server's usage chunk (``stream_options.include_usage``). Per-request output
speed (tokens/s after the first token) is reported as TensorRT-LLM does, p25/p50.

Against leanserve it also reads ``/stats`` before and after the run and reports the engine's
host step time p50/p95/p99, forward time p50 and host overhead as a share of step time over
exactly the run's iterations.

Load is bounded (``--num-prompts``, ``--timeout``) and goes to loopback addresses only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""  # generated text, to count tokens where a server sends no usage chunk
    error: str = ""


def build_prompts(a, tokenizer) -> list[tuple[str, int, int]]:
    """(prompt text, prompt tokens, max output tokens) per request."""
    rng = np.random.default_rng(a.seed)
    if a.dataset_name == "jsonl":
        out = []
        with open(a.dataset_path) as f:
            for line in f:
                row = json.loads(line)
                text = row.get("prompt") or row.get("text")
                out.append((text, len(tokenizer.encode(text)), int(row.get("max_tokens", a.random_output_len))))
                if len(out) == a.num_prompts:
                    break
        return out

    def lengths(mean):
        lo, hi = int(mean * (1 - a.random_range_ratio)), int(mean * (1 + a.random_range_ratio))
        return rng.integers(max(1, lo), hi + 1, a.num_prompts)

    # Random token ids decoded to text (the prompt the server sees); a shared prefix optional.
    vocab = tokenizer.vocab_size
    prefix = rng.integers(100, vocab - 100, a.random_prefix_len)
    out = []
    for n_in, n_out in zip(lengths(a.random_input_len), lengths(a.random_output_len)):
        ids = np.concatenate([prefix, rng.integers(100, vocab - 100, n_in)])
        text = tokenizer.decode(ids.tolist())
        out.append((text, len(tokenizer.encode(text, add_special_tokens=False)), int(n_out)))
    return out


async def one_request(c: httpx.AsyncClient, a, model: str, prompt: str, prompt_len: int, max_tokens: int,
                      bar) -> RequestResult:
    r = RequestResult(prompt_len=prompt_len)
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, "ignore_eos": a.ignore_eos} | a.extra_body
    if a.backend == "openai-chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    start = last = time.perf_counter()
    try:
        async with c.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = str(chunk["error"])
                    return r
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices:
                    delta = choices[0].get("text") if a.backend == "openai" else (choices[0].get("delta") or {}).get(
                        "content")
                    if delta:
                        r.text += delta
                        if r.ttft == 0.0:
                            r.ttft = now - start
                        else:
                            r.itl.append(now - last)
                        last = now
        r.e2e = time.perf_counter() - start
        r.ok = r.ttft > 0
    except httpx.HTTPError as e:
        r.error = repr(e)
    finally:
        if bar is not None:
            bar.update(1)
    return r


async def run_load(a, model: str, prompts, tokenizer) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=a.max_concurrency or len(prompts))
    sem = asyncio.Semaphore(a.max_concurrency or len(prompts))
    rng = np.random.default_rng(a.seed + 1)
    from tqdm import tqdm

    bar = tqdm(total=len(prompts), desc="bench serve", disable=a.no_progress)

    async with httpx.AsyncClient(base_url=a.base_url, timeout=a.timeout, limits=limits) as c:
        async def limited(p):
            async with sem:
                return await one_request(c, a, model, *p, bar)

        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if a.request_rate != float("inf"):
                # Gamma-distributed gaps: burstiness 1 is Poisson; < 1 burstier, > 1 more regular.
                theta = 1.0 / (a.request_rate * a.burstiness)
                await asyncio.sleep(rng.gamma(a.burstiness, theta))
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=a.timeout)
        duration = time.perf_counter() - start
    bar.close()
    for r in results:
        if r.ok and not r.output_tokens:  # no usage chunk from this server: count as vLLM's bench does
            r.output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))
    return results, duration


def percentile_ms(xs, q: float) -> float:
    """The q-th percentile of durations in seconds, in milliseconds (nan without samples)."""
    return float(np.percentile(xs, q) * 1e3) if len(xs) else float("nan")


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    mean = lambda xs: float(np.mean(xs) * 1e3) if len(xs) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    speed = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in ok if r.output_tokens > 1 and r.e2e > r.ttft]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration,
         "errors": sorted({r.error for r in results if not r.ok})[:5]}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        s[f"mean_{name}_ms"], s[f"median_{name}_ms"] = mean(xs), percentile_ms(xs, 50)
        s[f"p99_{name}_ms"] = percentile_ms(xs, 99)
    s["output_speed_p25"] = float(np.percentile(speed, 25)) if speed else float("nan")
    s["output_speed_p50"] = float(np.percentile(speed, 50)) if speed else float("nan")
    return s


def print_block(s: dict, engine: dict | None) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el")):
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            name = f"{label} {key.upper()} (ms):"
            print(f"{name:<40}{s[stat + '_' + key + '_ms']:<10.2f}")
    print("{s:{c}^{n}}".format(s="Per-request output speed (tok/s)", n=w, c="-"))
    print(f"{'P25:':<40}{s['output_speed_p25']:<10.2f}\n{'P50:':<40}{s['output_speed_p50']:<10.2f}")
    if engine:
        print("{s:{c}^{n}}".format(s="leanserve engine (this run)", n=w, c="-"))
        print(f"{'Iterations:':<40}{engine['iterations']:<10}")
        print(f"{'Host step time p50/p95/p99 (ms):':<40}{engine['host_step_ms']['p50']:.2f} / "
              f"{engine['host_step_ms']['p95']:.2f} / {engine['host_step_ms']['p99']:.2f}")
        print(f"{'Forward time p50 (ms):':<40}{engine['forward_ms']['p50']:<10.2f}")
        print(f"{'Host overhead (share of step time):':<40}{engine['host_overhead_share']:<10.3f}")
        if "grammar_ms" in engine:
            g = engine["grammar_ms"]
            print(f"{'Grammar phase mean/p99 (ms):':<40}{g['mean']:.2f} / {g['p99']:.2f}")
            print(f"{'Grammar phase (share of step time):':<40}{engine['grammar_share']:<10.4f}")
    print("=" * w)


def engine_window(base_url: str, since: int | None) -> dict | None:
    if since is None:
        return None
    time.sleep(0.6)  # the engine sends its iteration rows every 0.5 s: wait for the last ones
    w = httpx.get(base_url + "/stats", params={"since": since}, timeout=10).json().get("window", {})
    if not w.get("host_step_ms"):
        return None
    host, fwd, grammar = w["host_step_ms"], w["forward_ms"], w.get("grammar_ms")
    out = {"iterations": int(w["iterations"]["count"]), "host_step_ms": host, "forward_ms": fwd,
           "host_overhead_share": (host["mean"] - fwd["mean"]) / host["mean"] if host["mean"] else float("nan")}
    if grammar is not None:  # structured outputs: token bitmasks and matchers
        out["grammar_ms"] = grammar
        out["grammar_share"] = grammar["mean"] / host["mean"] if host["mean"] else float("nan")
    return out


def read_stats(base_url: str) -> dict | None:
    """leanserve's ``/stats`` (engine gauges and counters); None from a server without it."""
    try:
        r = httpx.get(base_url + "/stats", timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def leanserve_iterations(base_url: str) -> int | None:
    return (read_stats(base_url) or {}).get("iterations_total")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="leanserve bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    ap.add_argument("--dataset-name", choices=["random", "jsonl"], default="random")
    ap.add_argument("--dataset-path", default=None, help="JSONL with a 'prompt' (and optional 'max_tokens')")
    ap.add_argument("--tokenizer", default=None, help="model path for the tokenizer (default: the default model)")
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-prefix-len", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--extra-body", type=json.loads, default={},
                    help='JSON merged into every request body, e.g. \'{"logit_bias": {"2": -100}}\'')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--save-result", default=None, help="write the result JSON here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if urlparse(a.base_url).hostname not in LOOPBACK:
        ap.error("--base-url: load is only sent to loopback addresses (127.0.0.1, localhost, ::1)")
    if a.dataset_name == "jsonl" and not a.dataset_path:
        ap.error("--dataset-path: required with --dataset-name jsonl")
    if not isinstance(a.extra_body, dict):
        ap.error("--extra-body: must be a JSON object")
    if a.num_prompts < 1 or a.num_prompts > 100_000:
        ap.error("--num-prompts: must be in [1, 100000]")
    return a


def main(argv=None) -> dict:
    from ..tokenizer import Tokenizer
    from ..model.loader import resolve_model_path

    a = parse_args(argv)
    tokenizer = Tokenizer.from_pretrained(resolve_model_path(a.tokenizer))
    model = a.model or httpx.get(a.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = build_prompts(a, tokenizer)
    before = leanserve_iterations(a.base_url)
    results, duration = asyncio.run(run_load(a, model, prompts, tokenizer))
    summary = summarize(results, duration)
    engine = engine_window(a.base_url, before)
    print_block(summary, engine)
    out = {"args": {k: v for k, v in vars(a).items() if k != "request_rate"}, "request_rate": str(a.request_rate),
           "model": model, "summary": summary, "engine": engine,
           "requests": [asdict(r) | {"itl": None, "text": None} for r in results]}
    if a.save_result:
        with open(a.save_result, "w") as f:
            json.dump(out, f, indent=1)
    return out
