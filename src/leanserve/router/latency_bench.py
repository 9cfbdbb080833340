"""The router's added latency, end to end: ``python -m leanserve.router.latency_bench``.

A trivial backend (this module with ``--trivial-backend``: a plain ASGI app that answers
completions at once, a fixed JSON body or a short SSE stream) runs in its own process, and
``leanserve router --backend`` in front of it. One client sends the same requests one at a time,
alternating direct and through the router (so drift on a shared machine hits both alike), and
times each to its response head (non-streaming: the whole answer; streaming: the first SSE
event). The added latency is the difference of the two distributions' percentiles; it includes
everything the router's own histogram leaves out (an extra loopback hop, uvicorn's request
parsing, httpx's response parsing). The router's histogram over the same run is reported beside
it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import time

_ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "trivial",
                      "choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode()
_EVENT = b"data: " + _ANSWER + b"\n\n"
_STREAM_EVENTS = 8


async def trivial_backend(scope, receive, send) -> None:
    """Answers POST /v1/completions at once (JSON, or 8 SSE events if the body asks for a
    stream) and GET /health; nothing else."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
    elif b'"stream": true' in body:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(_STREAM_EVENTS):
            await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    else:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_ANSWER)).encode())]})
        await send({"type": "http.response.body", "body": _ANSWER})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], port: int, timeout_s: float = 60.0) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                c.close()
                return proc
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become healthy")


def _timed(conn: http.client.HTTPConnection, body: bytes, stream: bool) -> float:
    """Seconds to the whole answer (non-streaming) or to its first SSE event (the backend writes
    one event per chunk); the rest of a stream is read untimed."""
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    first = r.read1() if stream else r.read()
    t = time.perf_counter() - t0
    r.read()
    if r.status != 200 or not first:
        raise RuntimeError(f"status {r.status}, first bytes {first[:80]!r}")
    return t


def _pct(xs: list[float]) -> dict:
    """p50/p90/p99 in milliseconds (nearest rank)."""
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, len(s) * q // 100)] * 1e3 for q in (50, 90, 99)}


def _router_histogram(port: int) -> tuple[float, float, list[tuple[float, float]]]:
    c = http.client.HTTPConnection("127.0.0.1", port)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    total = float(re.search(r"^leanserve:router_added_latency_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^leanserve:router_added_latency_seconds_count (\S+)", text, re.M).group(1))
    buckets = [(float(le), float(v)) for le, v in
               re.findall(r'^leanserve:router_added_latency_seconds_bucket\{le="([^"]+)"\} (\S+)', text, re.M)]
    return total, count, buckets


def _bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """The upper bound of the bucket holding the q-quantile (Prometheus' bucket resolution)."""
    for le, c in buckets:
        if c >= q * count:
            return le
    return float("inf")


def run(requests: int) -> dict:
    backend_port, router_port = _free_port(), _free_port()
    backend = _start([sys.executable, "-m", "leanserve.router.latency_bench", "--trivial-backend",
                      "--port", str(backend_port)], backend_port)
    router = None
    try:
        router = _start([sys.executable, "-m", "leanserve.cli", "router", "--port", str(router_port),
                         "--backend", f"http://127.0.0.1:{backend_port}"], router_port)
        report = {"requests": requests}
        for stream in (False, True):
            body = json.dumps({"prompt": "hi", "max_tokens": 1, "stream": stream}).encode()
            direct = http.client.HTTPConnection("127.0.0.1", backend_port)
            routed = http.client.HTTPConnection("127.0.0.1", router_port)
            for _ in range(50):  # warm-up: connections, code paths
                _timed(direct, body, stream), _timed(routed, body, stream)
            before = _router_histogram(router_port)
            d, r = [], []
            for _ in range(requests):
                d.append(_timed(direct, body, stream))
                r.append(_timed(routed, body, stream))
            total, count, buckets = _router_histogram(router_port)
            n = count - before[1]
            delta = [(le, c - c0) for (le, c), (_, c0) in zip(buckets, before[2])]
            pd, pr = _pct(d), _pct(r)
            report["stream" if stream else "non_stream"] = {
                "direct_ms": pd, "through_router_ms": pr,
                "added_ms": {k: pr[k] - pd[k] for k in pd},
                "router_histogram": {"mean_ms": (total - before[0]) / n * 1e3,
                                     "p50_bucket_le_ms": _bucket_quantile(delta, n, 0.5) * 1e3,
                                     "p99_bucket_le_ms": _bucket_quantile(delta, n, 0.99) * 1e3},
            }
        return report
    finally:
        for proc in (router, backend):
            if proc is not None:
                proc.terminate()
                proc.wait(10)


def format_report(report: dict) -> str:
    lines = [f"{report['requests']} requests per mode and path, one at a time, alternating direct / through the router",
             f"{'milliseconds':<30}{'p50':>8}{'p90':>8}{'p99':>8}"]
    for mode, title in (("non_stream", "non-streaming, whole answer"), ("stream", "streaming, first SSE event")):
        r = report[mode]
        lines.append(title)
        for key, label in (("direct_ms", "direct"), ("through_router_ms", "through the router"),
                           ("added_ms", "added (difference)")):
            lines.append(f"  {label:<28}" + "".join(f"{r[key][q]:>8.3f}" for q in ("p50", "p90", "p99")))
        h = r["router_histogram"]
        lines.append(f"  router's own histogram: mean {h['mean_ms']:.3f}, p50 <= {h['p50_bucket_le_ms']:g}, "
                     f"p99 <= {h['p99_bucket_le_ms']:g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m leanserve.router.latency_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="per mode and path (direct, through the router)")
    p.add_argument("--trivial-backend", action="store_true", help="run only the trivial backend (used by the bench)")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    if a.trivial_backend:
        import uvicorn

        uvicorn.run(trivial_backend, host="127.0.0.1", port=a.port, log_level="warning", lifespan="off")
        return
    load = os.getloadavg()
    print(format_report(run(a.requests)))
    print(f"load average before / after: {load[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
