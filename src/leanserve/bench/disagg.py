"""``leanserve bench disagg``: issue 13's scenario. A decode worker decodes at concurrency 64
while requests with long prompts keep arriving through a prefill worker; does receiving their
KV cost the decode loop anything?

Processes, all started here on loopback, serving a tiny random Llama (2 layers, the default
model's 49,152-token vocabulary, 32k+ context) written to a temporary directory:

* prefill worker (``--kv-transfer-config`` kv_producer), decode worker (kv_consumer), and
  ``leanserve router --prefill --decode`` in front of them;
* later, for the latency comparison, one aggregated server (no KV transfer).

Each engine computes with one torch thread. The decode worker's loop thread (its engine
process's main thread, which runs the forward) is pinned alone to the first core; every other
thread, the decode engine's own (input, output, KV transfer, ZeroMQ I/O) and all of the prefill
worker's, the API processes', the router's and this client's, to the last (on a 2-core machine:
core 0 for the decode loop, core 1 for the rest). A deployment gives the decode loop a core
that nothing else of the serving system competes for; here other load on the machine is not
controlled.

Measured:

* host step time p50/p95/p99 of the decode worker's iterations that are exactly the 64 decode
  rows, quiet (the decoders alone) and during a stream of long-prompt requests (goal: p99 during /
  quiet <= 1.2); and in control, the same stream prefill-only (``max_tokens`` 1: the router never
  calls the decode worker), so the other core is as busy and no KV arrives. The decoders'
  contexts grow through the run, and the step with them, so the three alternate in rounds
  (quiet, control and stream, their order swapped every other round; a last quiet window).
  Each stream's p99 is divided by the quiet windows' p99 interpolated to where it ran, and the
  ratio quoted is the median of the rounds; the percentiles given per kind pool the rounds.
  During is split by whether transfers were in flight and by
  whether the next iteration took a newly arrived request (the one beside its enqueue).
  Iterations that also run a received request's rows are left out: attending its 32k-token
  context is the forward's cost, not the host path's (decode attention gives it a group of its
  own, so the 64 short rows are not padded to its length: that made such a step 20x slower and
  the next two slower still, their working set evicted from the caches);
* the loop's own work in every decode iteration, those included: fetch + schedule + prepare +
  output, the phases outside the model runner (schedule is where transfers land);
* the transfers: count, MB/s and latency (pull sent -> blocks written);
* TTFT and TPOT of the same requests through the router and against an aggregated server, and
  the router's own added latency (its histogram);
* ``--copy-bug``: the same run with the seed's bug put into the decode worker (``install_copy_bug``,
  loaded into its processes by a ``sitecustomize`` this benchmark writes; the engine has no such
  switch): its enqueue deep-copies each received request's prompt ids as Python objects, O(prompt)
  work that competes with the loop thread for the GIL, to show the measurement catches that
  class of bug.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import numpy as np
import torch

from ..engine.endpoints import free_ports
from ..engine.stats import FIELDS
from ..model.config import ModelConfig
from ..model.loader import checkpoint_tensors, default_model_path
from ..model.transformer import Transformer
from .serve import one_request, summarize

VOCAB = 49152  # the default model's tokenizer serves the random model
COPY_BUG_INSTALLED = "leanserve bench disagg: copy bug installed"
STARTUP_S = 300.0


# ---------------------------------------------------------------------------------- the model


def write_tiny_model(path: str, max_len: int, seed: int = 0) -> str:
    """A random Llama as a Hugging Face directory: config.json, safetensors, the default tokenizer."""
    from safetensors.torch import save_file

    from ..tokenizer import Tokenizer

    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=max_len, tie_word_embeddings=True, eos_token_ids=(2,))
    model = Transformer(cfg, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data.normal_(0, 0.3, generator=g)
    os.makedirs(path, exist_ok=True)
    save_file(checkpoint_tensors(model), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": max_len,
                   "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}, f)
    Tokenizer.from_pretrained(default_model_path()).backend.save(os.path.join(path, "tokenizer.json"))
    return path


# ---------------------------------------------------------------------------------- processes


def _pin(pid: int, cpus: set[int], main_cpus: set[int] | None = None) -> None:
    """Every thread of a process onto ``cpus``; its main thread onto ``main_cpus`` if given."""
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            os.sched_setaffinity(tid, main_cpus if main_cpus and tid == pid else cpus)
        except ProcessLookupError:
            pass


def install_copy_bug() -> None:
    """The bug class this benchmark must catch, as the seed met it on a generation worker: its
    enqueue deep-copied each request's prompt ids as Python objects, O(prompt) work competing
    with the loop thread for the GIL. Here: every request that arrives with a remote prefill
    (the decode worker's) has its ids turned into a list, deep-copied and turned back, on the
    engine's input thread. Says so on stderr, which ``run`` checks for in the worker's log."""
    from ..engine.core import EngineCore

    print(COPY_BUG_INSTALLED, file=sys.stderr, flush=True)

    enqueue = EngineCore.enqueue

    def copying_enqueue(self, add, prompt):
        if add.remote_prefill is not None:
            prompt = np.asarray(copy.deepcopy(prompt.tolist()), np.int32)
        enqueue(self, add, prompt)

    EngineCore.enqueue = copying_enqueue


def _copy_bug_env(directory: str) -> dict[str, str]:
    """The environment that loads ``install_copy_bug`` into every Python process started with it
    (the decode worker's API process and, spawned from it, its engine process)."""
    site = os.path.join(directory, "copy-bug-site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("from leanserve.bench.disagg import install_copy_bug\ninstall_copy_bug()\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}


class Process:
    """A ``leanserve`` process on a free loopback port, ready once /health answers 200."""

    def __init__(self, args: list[str], cpus: set[int] | None, log_path: str, env: dict[str, str] | None = None):
        (self.port,) = free_ports("127.0.0.1", 1)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # one torch thread per engine
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "leanserve.cli", *args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"leanserve bench disagg: {args[0]} exited during start-up (log: {log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                sys.exit(f"leanserve bench disagg: {args[0]} not healthy after {STARTUP_S:g} s (log: {log_path})")
            time.sleep(0.25)

    def engine_pid(self) -> int:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        for pid in map(int, out.stdout.split()):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        raise RuntimeError("no engine process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _serve_args(model: str, a, kv: dict | None, max_num_seqs: int) -> list[str]:
    args = ["serve", model, "--dtype", "float32", "--max-model-len", str(a.max_model_len), "--max-num-seqs",
            str(max_num_seqs), "--kv-cache-memory", "1G", "--max-waiting-requests", "4096",
            "--watchdog-timeout", "600"]
    return args + (["--kv-transfer-config", json.dumps(kv)] if kv else [])


# ---------------------------------------------------------------------------------- measuring


def stats(url: str, since: int | None = None) -> dict:
    params = {"since": since, "rows": "true"} if since is not None else {}
    return httpx.get(url + "/stats", params=params, timeout=30).json()


def _pcts(xs) -> dict:
    xs = np.asarray(xs, np.float64)
    if not len(xs):
        return {"n": 0}
    return {"n": int(len(xs)), **{f"p{q}": float(np.percentile(xs, q)) for q in (50, 95, 99)},
            "max": float(xs.max())}


_F = {name: i for i, name in enumerate(FIELDS)}
LOOP_PHASES = ("fetch_ms", "schedule_ms", "prepare_ms", "output_ms")
QUIET, CONTROL, DURING = "quiet", "control", "during"


@dataclass(frozen=True)
class Segment:
    """A stretch of the run, [start, end) in seconds since the epoch (the engine stamps each
    iteration row with its start on the same clock): the decoders alone (quiet), beside the
    long-prompt stream run prefill-only (control), or receiving the stream's KV (during)."""

    kind: str
    round: int
    start: float
    end: float


def _began_in(rows: np.ndarray, segments: list[Segment]) -> np.ndarray:
    """Which rows are iterations begun in any of ``segments``."""
    began = rows[:, _F["start_time_s"]]
    inside = np.zeros(len(rows), bool)
    for s in segments:
        inside |= (began >= s.start) & (began < s.end)
    return inside


def _in_window(rows: np.ndarray, segments: list[Segment], decoders: int, exactly: bool = True) -> np.ndarray:
    """Which rows are decode iterations (no prefill chunk) begun in any of ``segments`` with
    exactly the decoders' rows, or (``exactly`` False) at least those."""
    gen = rows[:, _F["num_generation_requests"]]
    return (_began_in(rows, segments) & ((gen == decoders) if exactly else (gen >= decoders))
            & (rows[:, _F["num_context_tokens"]] == 0))


def _window(rows: np.ndarray, segments: list[Segment], decoders: int, exactly: bool = True) -> np.ndarray:
    return rows[_in_window(rows, segments, decoders, exactly)]


def _host_step(sel: np.ndarray) -> dict:
    return _pcts(sel[:, _F["host_step_ms"]])


def _loop_work(sel: np.ndarray) -> dict:
    return _pcts(sel[:, [_F[p] for p in LOOP_PHASES]].sum(axis=1))


def _p99(rows: np.ndarray, seg: Segment, decoders: int, metric: str) -> float:
    if metric == "host_step_ms":
        return _host_step(_window(rows, [seg], decoders)).get("p99", np.nan)
    return _loop_work(_window(rows, [seg], decoders, exactly=False)).get("p99", np.nan)


def _position(rows: np.ndarray, seg: Segment) -> float:
    """Where a segment sits in the run, in iterations: the mean index of the rows begun in it.
    The decoders' contexts, and the step with them, grow by the iteration, not by the second."""
    inside = np.flatnonzero(_began_in(rows, [seg]))
    return float(inside.mean()) if len(inside) else np.nan


def summarize_segments(rows: np.ndarray, segments: list[Segment], decoders: int) -> dict:
    """The decode worker's iteration rows (consecutive, oldest first) over the measurement's
    segments: each kind's iterations pooled over the rounds, and the goal's ratio of p99s,
    stream by stream, against the quiet level where it ran.

    The decoders' contexts grow through the run, and the step with them (11 to 26 ms p50 over
    one run of the default workload): a window before the stream and one during it differ by
    that growth as much as by the stream. So quiet windows and streams alternate (quiet,
    control and during, control and during swapped every other round, a last quiet window),
    and each stream's p99 is divided by the quiet windows' p99 interpolated to its position.
    Pooled p99s would not do: under drift the tail of a pool is its latest stretch."""
    by_kind = {k: [s for s in segments if s.kind == k] for k in (QUIET, CONTROL, DURING)}
    out: dict = {"host_step_ms": {}, "loop_work_ms": {}}
    for kind, segs in by_kind.items():
        out["host_step_ms"][kind] = _host_step(_window(rows, segs, decoders))
        out["loop_work_ms"][kind] = _loop_work(_window(rows, segs, decoders, exactly=False))
    in_during = _in_window(rows, by_kind[DURING], decoders)
    during = rows[in_during]
    pending = during[:, _F["num_waiting_for_kv"]] > 0
    splits = out["host_step_ms"]
    splits["during, transfers pending"] = _host_step(during[pending])
    splits["during, none pending"] = _host_step(during[~pending])
    # A request's enqueue (the API process hands it to the engine's input thread) runs beside
    # the iteration before the one whose fetch takes it: O(prompt) work there competing for the
    # GIL (the copy bug) lengthens that iteration, by at most its own duration, once per arrival.
    before_arrival = np.zeros(len(rows), bool)
    before_arrival[:-1] = rows[1:, _F["num_new_requests"]] > 0
    splits["during, before an arrival"] = _host_step(rows[in_during & before_arrival])
    splits["during, the others"] = _host_step(rows[in_during & ~before_arrival])
    # Left out of the rest: the iterations that also decode a received request (its long context
    # is the forward's cost, not the host path's). Their own time, for the record:
    received = _in_window(rows, by_kind[DURING], decoders, exactly=False) & \
        (rows[:, _F["num_generation_requests"]] > decoders)
    splits["during, with received rows"] = _host_step(rows[received])

    ratios: dict = {}
    for metric in ("host_step_ms", "loop_work_ms"):
        # The quiet windows' p99 by where they ran: each stream's quiet level is interpolated from them.
        quiet = [(_position(rows, seg), _p99(rows, seg, decoders, metric)) for seg in by_kind[QUIET]]
        at, level = np.asarray([q for q in quiet if not np.isnan(q).any()]).reshape(-1, 2).T
        during = _over_quiet(rows, by_kind[DURING], decoders, metric, at, level)
        control = _over_quiet(rows, by_kind[CONTROL], decoders, metric, at, level)
        by_round = {"p99 during / quiet": during, "p99 control / quiet": control,
                    "p99 during / control": [d / c for d, c in zip(during, control)]}
        ratios[metric] = {name: _median_of(v) for name, v in by_round.items()}
    # Interleaved in time, so drift (contexts grow) and other load on the machine touch both alike.
    ratios["host_step_ms"]["p99 pending / none pending"] = _ratio(splits["during, transfers pending"],
                                                                  splits["during, none pending"], "p99")
    # Arrivals are few (one per 32k-token prompt), so their median, not their tail.
    ratios["host_step_ms"]["p50 before an arrival / the others"] = _ratio(splits["during, before an arrival"],
                                                                          splits["during, the others"], "p50")
    out["ratios"] = ratios
    return out


def _over_quiet(rows: np.ndarray, streams: list[Segment], decoders: int, metric: str, at: np.ndarray,
                level: np.ndarray) -> list[float]:
    """Each stream's p99 over the quiet p99 ``level`` (known at positions ``at``) where it ran."""
    return [_p99(rows, seg, decoders, metric) / np.interp(_position(rows, seg), at, level) for seg in streams]


def _ratio(a: dict, b: dict, pct: str) -> float | None:
    return a[pct] / b[pct] if a["n"] and b["n"] else None


def _median_of(values: list[float]) -> dict:
    """The rounds' values and their median; a round whose window had no iterations is None."""
    known = [float(v) for v in values if v == v]
    return {"median": float(np.median(known)) if known else None, "by_round": [v if v == v else None for v in values]}


async def _iterations(url: str) -> int:
    """The decode worker's iteration count, as of its last snapshot (they come every 0.5 s)."""
    return (await asyncio.to_thread(stats, url))["iterations_total"]


async def _wait_iterations(url: str, n: int, decoders: list[asyncio.Task]) -> None:
    """Until the decode worker has begun ``n`` iterations of exactly the decoders' rows from now on."""
    from_now = [Segment(QUIET, 0, time.time(), np.inf)]
    since = await _iterations(url)
    while True:
        await asyncio.sleep(0.5)
        if ended := [t for t in decoders if t.done()]:
            error = None if ended[0].cancelled() else ended[0].exception()
            raise RuntimeError(f"leanserve bench disagg: a decoder ended before the measurement did "
                               f"({error!r} if it failed; if it finished, raise --decoder-max-tokens)")
        s = await asyncio.to_thread(stats, url, since)
        rows = np.asarray(s.get("rows") or np.zeros((0, len(FIELDS))))
        if len(_window(rows, from_now, len(decoders))) >= n:
            return


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(100, VOCAB - 100, n).tolist()


async def _decoders(c: httpx.AsyncClient, a, rng) -> list[asyncio.Task]:
    """``a.decoders`` long generations through the router, as tasks."""
    body = {"max_tokens": a.decoder_max_tokens, "ignore_eos": True, "temperature": 0.0}
    return [asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": _ids(rng, a.decoder_prompt_len)}))
            for _ in range(a.decoders)]


async def _long_stream(c: httpx.AsyncClient, a, prefix: list[int], rng, count: int, max_tokens: int = 2) -> list[float]:
    """``count`` long-prompt requests (a shared prefix, so the prefill worker's cache serves most
    of each: they arrive fast, and each still moves its whole prompt's KV), ``a.long_concurrency``
    at a time. With ``max_tokens`` 1 the prefill worker finishes them and the router never calls
    the decode worker: the same stream, without KV for the decode worker. Returns their latencies."""
    todo = iter(range(count))
    latencies = []

    async def worker():
        for _ in todo:
            t = time.perf_counter()
            r = await c.post("/v1/completions", json={"prompt": prefix + _ids(rng, 64), "max_tokens": max_tokens,
                                                      "ignore_eos": True, "temperature": 0.0})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(a.long_concurrency)))
    return latencies


async def _host_step_run(router: str, decode: str, a) -> dict:
    rng = np.random.default_rng(a.seed)
    prefix = _ids(rng, a.long_prompt_len - 64)
    per_round = [len(part) for part in np.array_split(np.arange(a.long_prompts), a.rounds)]
    limits = httpx.Limits(max_connections=a.decoders + a.long_concurrency + 4)
    segments, latencies = [], []
    async with httpx.AsyncClient(base_url=router, timeout=None, limits=limits) as c:
        # Warm-up: the long prefix into the prefill worker's cache (its one slow prefill), one
        # transfer of its KV, and the decoders running.
        await _long_stream(c, SimpleNamespace(long_concurrency=1), prefix, rng, 1)
        await asyncio.sleep(0.7)  # the warm-up's iterations into the worker's snapshot
        first = await _iterations(decode)
        decoders = await _decoders(c, a, rng)
        await _wait_iterations(decode, 20, decoders)
        kv0 = (await asyncio.to_thread(stats, decode))["kv_transfer"]

        async def quiet(r: int) -> None:
            t = time.time()
            await _wait_iterations(decode, a.window, decoders)
            segments.append(Segment(QUIET, r, t, time.time()))

        async def stream(kind: str, r: int) -> None:
            t = time.time()
            took = await _long_stream(c, a, prefix, rng, per_round[r], 1 if kind == CONTROL else 2)
            segments.append(Segment(kind, r, t, time.time()))
            if kind == DURING:
                latencies.extend(took)

        for r in range(a.rounds):
            await quiet(r)
            # Control and during swap places from round to round, so neither is always the later.
            for kind in (CONTROL, DURING) if r % 2 == 0 else (DURING, CONTROL):
                await stream(kind, r)
        await quiet(a.rounds)
        for t in decoders:
            t.cancel()  # the client leaves: the router and the workers abort them
        await asyncio.gather(*decoders, return_exceptions=True)
    await asyncio.sleep(0.7)  # the last iteration rows arrive with the engine's next snapshot
    s = await asyncio.to_thread(stats, decode, first)
    out = summarize_segments(np.asarray(s["rows"]), segments, a.decoders)
    out["segments"] = [vars(seg) for seg in segments]
    stream_s = sum(seg.end - seg.start for seg in segments if seg.kind == DURING)
    kv1 = s["kv_transfer"]
    n = kv1["transfers_completed"] - kv0["transfers_completed"]
    times = np.asarray(s["kv_transfer_times_s"][-n:]) if n else np.zeros(0)
    mb = (kv1["received_bytes"] - kv0["received_bytes"]) / 1e6 / max(n, 1)
    out["transfers"] = {"count": n, "failed": kv1["transfers_failed"] - kv0["transfers_failed"], "mb_each": mb,
                        "latency_ms": _pcts(times * 1e3), "mb_per_s": _pcts(mb / times) if n else {"n": 0},
                        "stream_s": stream_s, "long_request_latency_ms": _pcts(np.asarray(latencies) * 1e3)}
    return out


async def _latency_run(url: str, a, model: str) -> dict:
    """TTFT / TPOT: ``a.latency_requests`` streaming requests of ``a.latency_prompt_len`` random
    token ids and ``a.latency_output_len`` tokens, ``a.latency_concurrency`` at a time."""
    rng = np.random.default_rng(a.seed + 7)
    prompts = [_ids(rng, a.latency_prompt_len) for _ in range(a.latency_requests)]
    opts = SimpleNamespace(backend="openai", ignore_eos=True, extra_body={})
    sem = asyncio.Semaphore(a.latency_concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        async def one(p):
            async with sem:
                return await one_request(c, opts, model, p, len(p), a.latency_output_len, None)

        t = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - t
    s = summarize(results, duration)
    return {k: s[k] for k in ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                              "p99_tpot_ms", "output_throughput", "errors")}


def _router_added_ms(url: str) -> dict | None:
    """The router's own time per request (its histogram): the mean, and the bucket holding the median."""
    buckets, total, count = [], 0.0, 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("leanserve:router_added_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.split()[-1])))
        elif line.startswith("leanserve:router_added_latency_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("leanserve:router_added_latency_seconds_count"):
            count += float(line.split()[-1])
    if not count:
        return None
    median_le = min(le for le, n in buckets if n >= count / 2)
    return {"mean": total / count * 1e3, "p50_at_most": median_le * 1e3, "requests": int(count)}


def run(a, model: str, logs: str, copy_bug: bool, with_latency: bool) -> dict:
    loop_cpus, other_cpus = {min(a.cpus)}, {max(a.cpus)}
    kv = {"kv_connector": "ZmqConnector", "kv_transfer_timeout_s": 60}
    prefill_kv_port, decode_kv_port = free_ports("127.0.0.1", 2)
    with ExitStack() as stack:
        prefill = Process(_serve_args(model, a, kv | {"kv_role": "kv_producer", "kv_port": prefill_kv_port}, 8),
                          other_cpus, f"{logs}/prefill.log")
        stack.callback(prefill.stop)
        decode = Process(_serve_args(model, a, kv | {"kv_role": "kv_consumer", "kv_port": decode_kv_port},
                                     a.decoders + 2 * a.long_concurrency), other_cpus, f"{logs}/decode.log",
                         _copy_bug_env(logs) if copy_bug else None)
        stack.callback(decode.stop)
        _pin(decode.engine_pid(), other_cpus, main_cpus=loop_cpus)
        if copy_bug and open(f"{logs}/decode.log").read().count(COPY_BUG_INSTALLED) < 2:
            sys.exit(f"leanserve bench disagg: the copy bug did not load into the decode worker's API and engine "
                     f"processes (log: {logs}/decode.log)")
        router = Process(["router", "--prefill", prefill.url, "--decode", decode.url], other_cpus, f"{logs}/router.log")
        stack.callback(router.stop)
        out = asyncio.run(_host_step_run(router.url, decode.url, a))
        out["copy_bug"] = copy_bug
        if with_latency:
            name = httpx.get(router.url + "/v1/models").json()["data"][0]["id"]
            out["latency_through_router"] = asyncio.run(_latency_run(router.url, a, name))
            out["router_added_ms"] = _router_added_ms(router.url)
    if with_latency:
        with ExitStack() as stack:
            single = Process(_serve_args(model, a, None, a.decoders), other_cpus, f"{logs}/aggregated.log")
            stack.callback(single.stop)
            _pin(single.engine_pid(), other_cpus, main_cpus=loop_cpus)
            name = httpx.get(single.url + "/v1/models").json()["data"][0]["id"]
            out["latency_aggregated"] = asyncio.run(_latency_run(single.url, a, name))
    return out


# ---------------------------------------------------------------------------------- report


def _fmt_run(r: dict) -> str:
    label = "copy bug: the decode worker's enqueue deep-copies received prompts" if r["copy_bug"] else "leanserve"
    rounds = max(seg["round"] for seg in r["segments"])
    lines = [f"{label} ({rounds} rounds)"]
    titles = {"host_step_ms": "host step time, iterations of exactly the decoders' rows",
              "loop_work_ms": "loop work (fetch + schedule + prepare + output), every decode iteration"}
    for metric, title in titles.items():
        lines.append(f"  {title}, ms: p50 / p95 / p99 (max)  [iterations]")
        for name, s in r[metric].items():
            if s["n"]:
                lines.append(f"    {name:<26} {s['p50']:8.2f} / {s['p95']:8.2f} / {s['p99']:8.2f} ({s['max']:.2f})"
                             f"  [{s['n']}]")
        for name, v in r["ratios"][metric].items():
            if isinstance(v, dict):
                lines.append(f"    {name} = {_num(v['median'])}, median of the rounds' "
                             f"{', '.join(map(_num, v['by_round']))}")
            else:
                lines.append(f"    {name} = {_num(v)}")
    t = r["transfers"]
    if t["count"]:
        lat, rate = t["latency_ms"], t["mb_per_s"]
        lines.append(f"  transfers: {t['count']} ({t['failed']} failed) of {t['mb_each']:.1f} MB, pull to blocks "
                     f"written: p50 / p99 {lat['p50']:.1f} / {lat['p99']:.1f} ms, {rate['p50']:.0f} MB/s p50; "
                     f"{t['count'] / t['stream_s']:.1f} arrivals / s while streaming")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.2f}"


def _fmt_latency(r: dict) -> str:
    lines = ["TTFT / TPOT, ms (p50 / p99)"]
    for name in ("latency_aggregated", "latency_through_router"):
        s = r[name]
        lines.append(f"  {name[8:]:<15} TTFT {s['median_ttft_ms']:7.1f} / {s['p99_ttft_ms']:7.1f}   TPOT "
                     f"{s['median_tpot_ms']:6.2f} / {s['p99_tpot_ms']:6.2f}   ({s['completed']} ok, "
                     f"{s['failed']} failed)")
    if (added := r.get("router_added_ms")) is not None:
        lines.append(f"  the router's own time per request (its histogram, {added['requests']} requests): p50 <= "
                     f"{added['p50_at_most']:g} ms, mean {added['mean']:.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="leanserve bench disagg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoders", type=int, default=64, help="requests decoding on the decode worker throughout")
    ap.add_argument("--decoder-prompt-len", type=int, default=1024,
                    help="their prompts; their contexts, and the step with them, grow through the run (hence rounds)")
    ap.add_argument("--decoder-max-tokens", type=int, default=8000, help="enough to outlast the measurement")
    ap.add_argument("--long-prompt-len", type=int, default=32_000)
    ap.add_argument("--long-prompts", type=int, default=384,
                    help="long-prompt requests in the stream, over all rounds (and as many again prefill-only)")
    ap.add_argument("--long-concurrency", type=int, default=4, help="long-prompt requests in flight at once")
    ap.add_argument("--rounds", type=int, default=4,
                    help="quiet window, control stream and stream, round after round, and a last quiet window")
    ap.add_argument("--window", type=int, default=100, help="decode iterations in each quiet window")
    ap.add_argument("--latency-requests", type=int, default=16)
    ap.add_argument("--latency-prompt-len", type=int, default=1024)
    ap.add_argument("--latency-output-len", type=int, default=64)
    ap.add_argument("--latency-concurrency", type=int, default=4)
    ap.add_argument("--copy-bug", action="store_true", help="also run with the copy bug on the decode worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write all results to this file")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.long_prompts < a.rounds:
        ap.error("--rounds must be at least 1 and --long-prompts at least --rounds (each round streams some)")
    a.max_model_len = a.long_prompt_len + 256
    a.cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(a.cpus)})  # this client beside the prefill worker, off the decode loop's core
    tmp = tempfile.mkdtemp(prefix="leanserve-disagg-")
    try:
        model = write_tiny_model(os.path.join(tmp, "model"), a.max_model_len + 64)
        runs = [run(a, model, tmp, copy_bug=False, with_latency=True)]
        print(_fmt_run(runs[0]), flush=True)
        print(_fmt_latency(runs[0]), flush=True)
        if a.copy_bug:
            runs.append(run(a, model, tmp, copy_bug=True, with_latency=False))
            print(_fmt_run(runs[1]), flush=True)
        load = os.getloadavg()
        print(f"load average at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} CPUs")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": {**vars(a), "cpus": sorted(a.cpus)}, "runs": runs, "loadavg": load}, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
