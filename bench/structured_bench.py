"""Structured outputs: what a grammar costs, measured.

    .venv/bin/python bench/structured_bench.py            # ~10 min on 2 idle cores
    .venv/bin/python bench/structured_bench.py --quick    # a smoke run

1. Micro (the default model's tokenizer, no model): building the grammar library's vocabulary
   view, validating and compiling a JSON schema (the sizes that decided what crosses to the
   engine process), and one step's grammar work at 1-64 constrained rows: the batched bitmask
   fill, applying it to 49,152-wide logits, and advancing the matchers.
2. Served (`leanserve serve` on the default model, `leanserve bench serve` as the client, chat,
   128-token random prompts, --output-len tokens, greedy, EOS ignored; a constrained request
   also ends when its JSON is complete): unconstrained vs a JSON schema (8 people, each a
   name, an age and a city) at concurrency 1 (4 requests) and 64 (64 requests): output tok/s,
   TPOT, and the engine's grammar phase per iteration (mean, p99, share of step time).
3. Compilation beside running requests: unconstrained requests at concurrency 16 while another
   client sends constrained requests one after another, first all with one schema (compiled
   once, then cache hits), then each with a schema never seen (every one compiled): the
   unconstrained requests' TPOT, the same load but for the compiling.

Results: bench/results/structured.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PEOPLE = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                       "city": {"type": "string", "maxLength": 24}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}


def big_schema(seed: int, fields: int = 60) -> dict:
    """A schema of ``fields`` typed properties, different for every seed: never a cache hit."""
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer"}, {"type": "boolean"},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
    props = {f"f{seed}_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def ms(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def micro(repeat: int) -> dict:
    import torch

    from leanserve.engine.params import StructuredOutputsParams as Spec
    from leanserve.engine.structured import GrammarBitmask, backend
    from leanserve.model import default_model_path
    from leanserve.tokenizer import Tokenizer

    torch.set_num_threads(2)
    tok = Tokenizer.from_pretrained(default_model_path())
    t0 = time.perf_counter()
    vocab = backend.load_tokenizer(tok.backend.to_str(), tok.vocab_size, list(tok.eos_token_ids))
    out = {"load_tokenizer_ms": (time.perf_counter() - t0) * 1e3}
    for name, schema in (("people", PEOPLE), ("60 fields", big_schema(0))):
        spec = Spec(json=schema)
        text = backend.grammar_text(spec)
        compiled = backend.compile_matcher(vocab, text)
        out[f"schema {name}"] = {
            "spec_bytes": len(json.dumps(schema)), "grammar_text_bytes": len(text),
            "validate_ms": ms(lambda: backend.grammar_error(spec), repeat),
            "compile_ms": ms(lambda: backend.compile_matcher(vocab, text), repeat),
            "fork_ms": ms(lambda: backend.fork(compiled), repeat)}
    # One step's grammar work: matchers spread over a valid document, as in a running batch.
    template = backend.compile_matcher(vocab, backend.grammar_text(Spec(json=PEOPLE)))
    doc = json.dumps({"people": [{"name": f"Person {i}", "age": 20 + i, "city": "Paris"} for i in range(8)]})
    ids = tok.encode(doc, add_special_tokens=False).tolist()
    bitmask = GrammarBitmask(64, tok.vocab_size, 2)
    steps = {}
    for rows in (1, 8, 64):
        fill, apply, advance = [], [], []
        for start in range(0, len(ids) - rows // 8 * 8 - 1, max(1, len(ids) // 12)):
            matchers = [backend.fork(template) for _ in range(rows)]
            pos = [(start + 7 * r) % (len(ids) - 1) for r in range(rows)]
            for m, p in zip(matchers, pos):
                m.consume_tokens(ids[:p])
            logits = torch.randn(rows, tok.vocab_size)
            t0 = time.perf_counter()
            mask = bitmask.fill(matchers)
            t1 = time.perf_counter()
            bitmask.apply(logits, np.arange(rows), mask)
            t2 = time.perf_counter()
            for m, p in zip(matchers, pos):
                backend.accept(m, ids[p])
                backend.is_terminated(m)
            t3 = time.perf_counter()
            fill.append(t1 - t0), apply.append(t2 - t1), advance.append(t3 - t2)
        steps[rows] = {k: float(np.median(v) * 1e3) for k, v in (("fill_ms", fill), ("apply_ms", apply),
                                                                  ("advance_ms", advance))}
    out["step"] = steps
    return out


class Server:
    def __init__(self, port: int, threads: int | None, *args: str):
        self.url = f"http://127.0.0.1:{port}"
        env = os.environ | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
        self.proc = subprocess.Popen([sys.executable, "-m", "leanserve.cli", "serve", "--port", str(port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


def bench_serve(url: str, concurrency: int, prompts: int, output_len: int, extra_body: dict) -> dict:
    from leanserve.bench import serve

    args = ["--base-url", url, "--backend", "openai-chat", "--random-input-len", "128", "--random-output-len",
            str(output_len), "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--no-progress", "--extra-body", json.dumps(extra_body)]
    out = serve.main(args)
    return {"summary": {k: v for k, v in out["summary"].items() if k != "errors"} | {"errors": out["summary"]["errors"]},
            "engine": out["engine"]}


def compile_interference(url: str, prompts: int, output_len: int = 32) -> dict:
    """Unconstrained load at concurrency 16 beside a client sending constrained requests one at a
    time: with one schema throughout (cache hits), then with a new schema each time."""
    out = {}
    for name, schema_of in (("cached_schema", lambda i: big_schema(0)), ("new_schemas", lambda i: big_schema(1000 + i))):
        done, sent = threading.Event(), []

        def side_load():
            with httpx.Client(base_url=url, timeout=600) as c:
                while not done.is_set():
                    r = c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 4,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "s", "schema": schema_of(len(sent))}}})
                    sent.append(r.status_code)

        t = threading.Thread(target=side_load)
        t.start()
        try:
            out[name] = bench_serve(url, 16, prompts, output_len, {})
        finally:
            done.set()
            t.join()
        out[name]["side_requests"], out[name]["side_ok"] = len(sent), sent.count(200)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--threads", type=int, default=None,
                    help="the server's torch threads (OMP_NUM_THREADS); on a CPU shared with other busy "
                         "processes 1 avoids OpenMP barriers waiting on a descheduled thread")
    ap.add_argument("--output-len", type=int, default=64)
    a = ap.parse_args()
    quick = a.quick
    result = {"command": " ".join(["bench/structured_bench.py", *sys.argv[1:]]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"load average {os.getloadavg()[0]:.1f} at the start",
              "micro": micro(3 if quick else 20)}
    print(json.dumps(result["micro"], indent=1))
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}}
    server = Server(a.port, a.threads, "--dtype", "auto", "--max-num-seqs", "64", "--kv-cache-memory", "1G")
    try:
        served = {}
        for conc, n in ((1, 2 if quick else 4), (64, 8 if quick else 64)):
            for name, body in (("unconstrained", {}), ("json_schema", fmt)):
                served[f"{name} c{conc}"] = bench_serve(server.url, conc, n, 16 if quick else a.output_len, body)
        result["served"] = served
        result["compile_interference"] = compile_interference(server.url, 16 if quick else 32)
    finally:
        server.stop()
    RESULTS.mkdir(exist_ok=True)
    name = "structured-quick" if quick else "structured"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote bench/results/{name}.json")


if __name__ == "__main__":
    main()
