"""Scale-out benchmarks (issue 14): data-parallel engines and several API processes.

``costs``: the per-message price of several API processes, in isolation (median of
``--repeat`` runs):
  * broadcast: an engine sends every StepOutput to every API process: the engine's extra
    ``send`` per API process, and in an API process the decode + filter of a step none of whose
    rows it holds, next to the demux of a step that is all its own (work it does anyway);
  * metrics: a request-latency observation in prometheus-client's multiprocess mode (an mmap
    write) vs in memory, and the engine histograms filled per snapshot with numpy
    (``BucketCounts``) vs one ``Histogram.observe`` per iteration row.

``frontend``: the frontend's ceiling. A tiny random model (2 layers, hidden 64, the default
model's tokenizer) makes the engine cheap, so requests/s and streamed tokens/s are bounded by
the API side: a short workload (4 output tokens: requests/s) and long ones (128: streamed
tokens/s) at 1 and 2 API processes; the engine runs on one thread (OMP_NUM_THREADS=1).

``dp``: ``-dp 1`` (one engine, 2 threads) vs ``-dp 2`` (two engines, 1 thread each) on the
default model at concurrency 16 and 64: one wave of that many requests, 128-token prompts, 64
output tokens.

Every server run starts ``leanserve serve``, waits for /health, sends a warm-up load, then the
measured load with ``leanserve bench serve`` while the CPU time of each process is counted (API
processes, engines, the load generator: they all share this machine's cores). Configurations
alternate, ``--repeat`` times each; medians are reported.

    .venv/bin/python bench/scale_out_bench.py costs
    .venv/bin/python bench/scale_out_bench.py frontend --json bench/results/scale_out_frontend.json
    .venv/bin/python bench/scale_out_bench.py dp --json bench/results/scale_out_dp.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

ROWS = 64  # a decode step of 64 running requests


def _median_us(fn, n: int, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return float(np.median(runs))


def _step(client: int, rows: int = ROWS):
    from leanserve.engine.messages import RequestIds, Step, StepOutput

    base = RequestIds(0, client).take(rows)
    ids = np.arange(base, base + rows, dtype=np.int64)
    return Step(StepOutput(ids.tobytes(), np.arange(rows, dtype=np.int32).tobytes(), np.zeros(rows, np.int8).tobytes(),
                           np.zeros(rows, np.int32).tobytes()))


def costs(repeat: int) -> dict:
    import msgspec
    import zmq

    from leanserve.engine.messages import FromEngine, RequestIds, demux

    out = {}
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromEngine)
    buf = bytearray()
    encoder.encode_into(_step(0), buf)
    out["step_bytes"] = len(buf)

    # Engine side: one more PUSH per API process, over ipc. Unbounded queues, drained after the
    # clock stops: the time is the send call alone, what the engine's output thread pays.
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as d:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        for sock in (push, pull):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        pull.bind(f"ipc://{d}/s")
        push.connect(f"ipc://{d}/s")
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(2000):
                push.send(buf, copy=True)
            runs.append((time.perf_counter() - t0) / 2000 * 1e6)
            for _ in range(2000):
                pull.recv(copy=False)
        out["engine_send_us"] = float(np.median(runs))
        push.close(0)
        pull.close(0)
    ctx.term()

    mine, theirs = RequestIds(0, 0), RequestIds(0, 1)
    foreign = bytes(buf)  # a step of API process 0's rows, read by API process 1
    out["api_decode_filter_foreign_step_us"] = _median_us(
        lambda: list(demux(decoder.decode(foreign).out, theirs)), 20000, repeat)
    out["api_decode_demux_own_step_us"] = _median_us(lambda: list(demux(decoder.decode(foreign).out, mine)), 2000,
                                                     repeat)
    out["api_decode_demux_own_step_unfiltered_us"] = _median_us(
        lambda: list(demux(decoder.decode(foreign).out)), 2000, repeat)
    out.update(_metric_costs(repeat))
    return out


def _metric_costs(repeat: int) -> dict:
    """Runs in a child process: prometheus-client picks its value class when imported."""
    code = f"""
import json, os, sys, tempfile, time
import numpy as np
d = tempfile.TemporaryDirectory()
if sys.argv[1] == "mp":
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = d.name
from prometheus_client import CollectorRegistry, Histogram
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from scale_out_bench import _median_us
from leanserve.server.metrics import _STEP_BUCKETS, BucketCounts
h = Histogram("h", "h", buckets=_STEP_BUCKETS, registry=CollectorRegistry())
out = {{"observe_us": _median_us(lambda: h.observe(0.003), 20000, {repeat})}}
rows = np.random.default_rng(0).uniform(0, 0.05, 40)  # one snapshot: ~40 iterations in 0.5 s
out["snapshot_40_rows_observe_each_us"] = _median_us(lambda: [h.observe(v) for v in rows.tolist()], 500, {repeat})
b = BucketCounts(_STEP_BUCKETS)
out["snapshot_40_rows_bucket_counts_us"] = _median_us(lambda: b.observe(rows), 2000, {repeat})
print(json.dumps(out))
"""
    res = {}
    for mode in ("memory", "mp"):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        for k, v in json.loads(r.stdout).items():
            res[f"{mode}_{k}"] = v
    return res


def tiny_model(path: str) -> str:
    """A tiny random llama with the default model's tokenizer (as the tests make theirs)."""
    import torch
    import transformers

    from leanserve.model import default_model_path
    from leanserve.tokenizer import Tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    Tokenizer.from_pretrained(default_model_path()).backend.save(os.path.join(path, "tokenizer.json"))
    return path


class Server:
    """``leanserve serve`` on a free loopback port, its log in a temporary file."""

    def __init__(self, model: str | None, args: list[str], env: dict[str, str] | None = None):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="scale-out-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "leanserve.cli", "serve", *([model] if model else []),
                                      "--port", str(self.port), *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=os.environ | (env or {}))
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"server did not start:\n{self.log.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # With several API processes /health answers as soon as one is up: wait for the others.
        while len(re.findall(r"serving .* on http", self._log())) < self._api_count():
            time.sleep(0.2)

    def _log(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def _api_count(self) -> int:
        return max(1, len(self.pids("API server processes")))

    def pids(self, what: str) -> list[int]:
        m = re.search(rf"{what}: pid ([\d, ]+)\n", self._log())
        return [int(p) for p in m.group(1).split(", ")] if m else []

    def processes(self) -> dict[str, list[int]]:
        api = self.pids("API server processes") or [self.proc.pid]  # one API process: the launcher
        return {"api": api, "engine": self.pids("engine-core processes")}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def load(server: Server, load_args: list[str]) -> dict:
    """One ``leanserve bench serve`` run; its summary and each process group's CPU use in cores."""
    procs = server.processes()
    before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in procs.items()}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        t0 = time.monotonic()
        client = subprocess.Popen([sys.executable, "-m", "leanserve.cli", "bench", "serve", "--base-url", server.url,
                                   "--no-progress", "--ignore-eos", "--save-result", out.name, *load_args],
                                  stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(client.pid, 0)
        wall = time.monotonic() - t0
        client.returncode = os.waitstatus_to_exitcode(status)
        if client.returncode != 0:
            raise RuntimeError(f"bench serve failed with {client.returncode}")
        summary = json.load(open(out.name))["summary"]
    cpu = {k: sum(cpu_seconds(p) for p in pids) - before[k] for k, pids in procs.items()}
    cpu["client"] = usage.ru_utime + usage.ru_stime
    keep = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "p99_itl_ms")
    return {k: summary[k] for k in keep} | {f"cores_{k}": v / wall for k, v in cpu.items()} | {
        # CPU time per unit of work: what contention on a shared machine disturbs least.
        "api_cpu_ms_per_request": cpu["api"] * 1e3 / summary["completed"],
        "api_cpu_us_per_output_token": cpu["api"] * 1e6 / summary["total_output_tokens"],
        "engine_cpu_us_per_output_token": cpu["engine"] * 1e6 / summary["total_output_tokens"]}


def sweep(configs: dict[str, tuple[str | None, list[str]]], loads: dict[str, list[str]], repeat: int,
          warmup: list[str], env: dict[str, str] | None = None) -> dict:
    """Every (config, load) ``repeat`` times, configurations alternating; runs and medians."""
    runs: dict[str, list[dict]] = {}
    for r in range(repeat):
        for name, (model, args) in configs.items():
            server = Server(model, args, env)
            try:
                load(server, warmup)
                for load_name, load_args in loads.items():
                    row = load(server, load_args)
                    runs.setdefault(f"{name} / {load_name}", []).append(row)
                    print(f"[{r + 1}/{repeat}] {name} / {load_name}: " + ", ".join(
                        f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float)), flush=True)
            finally:
                server.stop()
    medians = {key: {k: float(np.median([row[k] for row in rows])) for k in rows[0]} for key, rows in runs.items()}
    return {"runs": runs, "medians": medians}


def frontend(repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        model = tiny_model(d)
        common = ["--dtype", "float32", "--max-num-seqs", "256", "--kv-cache-memory", "256M"]
        configs = {f"{n} API process{'es' if n > 1 else ''}": (model, common + ["--api-server-count", str(n)])
                   for n in (1, 2)}
        loads = {f"{out} tokens, concurrency {c}": ["--num-prompts", str(n), "--max-concurrency", str(c),
                                                    "--random-input-len", "32", "--random-output-len", str(out)]
                 for out, c, n in ((4, 64, 800), (128, 64, 192), (128, 256, 256))}
        warmup = ["--num-prompts", "64", "--max-concurrency", "64", "--random-input-len", "32",
                  "--random-output-len", "16"]
        # The engine on one thread: on two shared cores its two OpenMP threads spent most of their
        # CPU waiting at barriers for each other (1.2 ms of engine CPU per streamed token).
        return sweep(configs, loads, repeat, warmup, env={"OMP_NUM_THREADS": "1"})


def data_parallel(repeat: int) -> dict:
    configs = {"-dp 1 (2 threads)": (None, ["--data-parallel-size", "1"]),
               "-dp 2 (1 thread each)": (None, ["--data-parallel-size", "2"])}
    # One wave of requests per point: on this shared machine a decode step of 16 took ~1 s.
    loads = {f"concurrency {c}": ["--num-prompts", str(c), "--max-concurrency", str(c), "--random-input-len",
                                  "128", "--random-output-len", "64"] for c in (16, 64)}
    warmup = ["--num-prompts", "8", "--max-concurrency", "8", "--random-input-len", "128", "--random-output-len", "8"]
    return sweep(configs, loads, repeat, warmup)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["costs", "frontend", "dp"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server under test on the way out
    result = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    result |= {"costs": costs, "frontend": frontend, "dp": data_parallel}[a.what](a.repeat)
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result.get("medians", result), indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
