"""Tensor parallelism's per-step costs on this machine (``bench/results/tp.md``).

    python bench/tp_bench.py --json bench/results/tp.json

  * broadcast   - handing one step's input from rank 0 to another rank: the shared-memory ring
                  the engine uses vs a ZeroMQ PUB socket over ipc (what the issue asked to weigh),
                  for a batch-64 decode step and a 2,048-token prefill step: the writer's cost
                  (encode + send: rank 0's host time) and the delay until the reader has it;
  * collectives - gloo all-reduce of [rows, hidden] and gather of [rows, vocab / 2] at two
                  ranks, at the tiny model's and SmolLM2's shapes, against the head's own matmul
                  whole or halved (the vocab-parallel vs replicated head question);
  * engine      - ``leanserve bench host`` phases at batch 64 on the tiny model: TP=1 on one
                  thread and on two, TP=2 on one thread per rank, ``--repeats`` fresh engines
                  each, interleaved: host overhead per decode iteration (host step minus
                  forward) and step time, medians; and the same with every phase clocked in
                  CPU time of the loop's thread (``time.thread_time``), which a shared, busy
                  machine does not inflate: time a thread waits for a core is not counted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from leanserve.engine.distributed import step_codec  # noqa: E402
from leanserve.engine.distributed.shm_ring import RingReader, RingWriter  # noqa: E402
from leanserve.engine.model_runner import ModelInput  # noqa: E402

# ---------------------------------------------------------------------------------- broadcast


def step_message(kind: str) -> ModelInput:
    """A decode step of 64 sequences at 256-token contexts (16-token blocks), or one 2,048-token
    prefill chunk with no context, as build_model_input makes them."""
    rng = np.random.default_rng(0)
    ints = lambda n, hi=1000: rng.integers(0, hi, n).astype(np.int64)  # noqa: E731
    if kind == "decode64":
        return ModelInput(ints(64), ints(64), ints(64), ints(64 * 16).reshape(64, 16), ints(64), [], np.arange(64),
                          sampling=None)
    return ModelInput(ints(2048), np.arange(2048), ints(2048), np.zeros((0, 0), np.int64), ints(0),
                      [(0, 2048, 2048, ints(128))], np.array([2047]), sampling=None)


def _shm_reader(name, words, n, out):
    reader = RingReader(name, 0, 1, words)
    out.put("ready")
    lat = []
    for _ in range(n):
        msg = reader.read()
        lat.append(time.perf_counter() - msg[-1] / 1e9)
    out.put(lat)
    reader.close()


def _zmq_reader(addr, n, out):
    import zmq

    sock = zmq.Context().socket(zmq.SUB)
    sock.connect(addr)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.recv()  # a warm-up message: connected and subscribed
    out.put("ready")
    lat = []
    while len(lat) < n:
        msg = np.frombuffer(sock.recv(copy=False).buffer, np.int64)
        if msg[0] >= 0:  # the warm-up messages carry -1
            lat.append(time.perf_counter() - msg[-1] / 1e9)
    out.put(lat)


def broadcast(kind: str, transport: str, n: int = 2000, gap_s: float = 0.002) -> dict:
    """Writer cost and delivery delay, one message every ``gap_s`` (a decode step's pace).
    CLOCK_MONOTONIC (perf_counter) is one clock for every process of the machine."""
    inp = step_message(kind)
    words = sum(p.size for p in step_codec.encode(inp)) + 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stamp = np.zeros(1, np.int64)
    if transport == "shm":
        writer = RingWriter(1, words)
        proc = ctx.Process(target=_shm_reader, args=(writer.name, words, n, out))
        proc.start()
        out.get(timeout=120)

        def send():
            writer.write([*step_codec.encode(inp), stamp])
    else:
        import zmq

        sock = zmq.Context().socket(zmq.PUB)
        addr = f"ipc://{tempfile.mkdtemp()}/steps"
        sock.bind(addr)
        proc = ctx.Process(target=_zmq_reader, args=(addr, n, out))
        proc.start()
        while out.empty():  # a SUB socket drops what is sent before it has subscribed
            sock.send(np.full(4, -1, np.int64))
            time.sleep(0.01)
        out.get()

        def send():
            sock.send(np.concatenate([*(p.ravel() for p in step_codec.encode(inp)), stamp]), copy=False)
    cost = []
    for _ in range(n):
        time.sleep(gap_s)
        t = time.perf_counter()
        stamp[0] = int(t * 1e9)
        send()
        cost.append(time.perf_counter() - t)
    lat = out.get(timeout=60)
    proc.join()
    if transport == "shm":
        writer.close()
    us = lambda xs: {"p50": float(np.percentile(xs, 50) * 1e6), "p99": float(np.percentile(xs, 99) * 1e6)}  # noqa: E731
    return {"message": kind, "transport": transport, "words": words, "send_us": us(cost), "delivery_us": us(lat)}


# ---------------------------------------------------------------------------------- collectives


def _collective_rank(rank, port, shapes, out):
    from torch.distributed import TCPStore

    from leanserve.engine.distributed.group import DistributedGroup

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    group = DistributedGroup(store, rank, 2, torch.device("cpu"), "127.0.0.1")
    rows = []
    for what, shape in shapes:
        x = torch.randn(*shape)
        fn = group.all_reduce if what == "all_reduce" else group.gather_vocab
        for _ in range(20):
            fn(x)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
        rows.append({"op": what, "shape": list(shape), "p50_us": float(np.median(times) * 1e6)})
    if rank == 0:
        out.put(rows)


def collectives() -> dict:
    shapes = [("all_reduce", (1, 64)), ("all_reduce", (64, 64)), ("all_reduce", (1, 576)), ("all_reduce", (64, 576)),
              ("gather", (64, 256)), ("gather", (1, 24576)), ("gather", (64, 24576))]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_collective_rank, args=(r, port, shapes, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get(timeout=300)
    for p in procs:
        p.join()
    torch.set_num_threads(1)
    head = []
    for rows_n in (1, 64):
        x = torch.randn(rows_n, 576)
        for vocab in (49152, 24576):
            w = torch.randn(vocab, 576)
            for _ in range(5):
                torch.nn.functional.linear(x, w)
            t = time.perf_counter()
            for _ in range(30):
                torch.nn.functional.linear(x, w)
            head.append({"rows": rows_n, "vocab": vocab, "ms": (time.perf_counter() - t) / 30 * 1e3})
    return {"collectives": rows, "head_matmul_fp32_1_thread": head}


# ---------------------------------------------------------------------------------- engine


class _ThreadClock:
    perf_counter = staticmethod(time.thread_time)
    monotonic = staticmethod(time.monotonic)


def engine(repeats: int, iterations: int, cpu_time: bool = False) -> dict:
    from leanserve.bench.host import phases, save_tiny_checkpoint
    from leanserve.engine import model_runner, stats
    from leanserve.engine.distributed import runner
    from leanserve.engine.stats import FIELDS

    if cpu_time:  # the phase clock, the forward's and the broadcast's
        for module in (stats, model_runner, runner):
            module.time = _ThreadClock

    configs = {"tp1_1thread": (1, 1), "tp1_2threads": (1, 2), "tp2_1thread_per_rank": (2, 2)}
    runs = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as d:
        save_tiny_checkpoint(d)
        for _ in range(repeats):
            for name, (size, threads) in configs.items():
                (row,) = phases((64,), iterations, checkpoint=d, tensor_parallel_size=size, threads=threads,
                                keep_rows=True)
                runs[name].append(row)
    out = {}
    for name, rows in runs.items():
        data = np.concatenate([r["rows"] for r in rows])
        col = lambda name: data[:, FIELDS.index(name)]  # noqa: E731
        overhead = col("host_step_ms") - col("forward_ms")
        out[name] = {
            "iterations": len(data),
            "overhead_ms_p50_per_run": [float(np.median(r["rows"][:, FIELDS.index("host_step_ms")]
                                                        - r["rows"][:, FIELDS.index("forward_ms")])) for r in rows],
            "overhead_ms": {"p50": float(np.median(overhead)), "p99": float(np.percentile(overhead, 99))},
            "host_step_ms": {"p50": float(np.median(col("host_step_ms"))), "p99": float(np.percentile(col("host_step_ms"), 99))},
            "phases_ms_p50": {p: float(np.median(col(p))) for p in ("fetch_ms", "schedule_ms", "prepare_ms",
                                                                     "broadcast_ms", "forward_ms", "sample_ms",
                                                                     "output_ms")},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--only", default="broadcast,collectives,engine,engine_cpu_time")
    a = ap.parse_args()
    parts = a.only.split(",")
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "load_average_before": os.getloadavg()}
    if "broadcast" in parts:
        result["broadcast"] = [broadcast(kind, t) for kind in ("decode64", "prefill2048") for t in ("shm", "zmq")]
        for r in result["broadcast"]:
            print(f"{r['message']:>12} {r['transport']:>4} {r['words']:>6} words: send p50 {r['send_us']['p50']:6.1f} "
                  f"p99 {r['send_us']['p99']:6.1f} us, delivered p50 {r['delivery_us']['p50']:6.1f} "
                  f"p99 {r['delivery_us']['p99']:7.1f} us")
    if "collectives" in parts:
        result.update(collectives())
        for r in result["collectives"]:
            print(f"{r['op']:>10} {str(r['shape']):>12}: p50 {r['p50_us']:7.0f} us")
        for r in result["head_matmul_fp32_1_thread"]:
            print(f"head matmul rows {r['rows']:>3} vocab {r['vocab']:>6}: {r['ms']:6.2f} ms")
    for part, cpu_time in (("engine", False), ("engine_cpu_time", True)):
        if part in parts:
            result[part] = engine(a.repeats, a.iterations, cpu_time)
            for k, v in result[part].items():
                print(part, k, json.dumps(v))
    result["load_average_after"] = os.getloadavg()
    print("load average before / after:", result["load_average_before"], result["load_average_after"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
