"""``leanserve bench host``: where the executor's host time goes.

A tiny random model (one layer, 512-token vocabulary) makes the forward cheap, so what remains
is the host path. Three parts:

* phases  - decode iterations at batch 1..256: mean and p99 microseconds of each phase
            (fetch, schedule, prepare, forward, sample, output) and host overhead
            (host step time minus forward time);
* enqueue - cost of ``add_request`` per prompt length (16 .. 65,536 tokens), with the cost of
            ``copy.deepcopy`` of the same ids as a list beside it (the TensorRT-LLM bug);
* burst   - 64 requests decoding (2k-token contexts), then 160 requests with 32k-token prompts
            enqueued from another thread: host step time p50/p95/p99 of decode iterations before,
            during and after.
            ``--copy-bug`` re-runs it with a deep copy in the enqueue path, to show the
            measurement catches exactly that class of bug.

``--tensor-parallel-size 1,2`` runs only the phases, once per size, with the same tiny model
written to a checkpoint that every rank loads its share of (``engine/distributed``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import tempfile
import threading
import time

import numpy as np
import torch

from ..engine.config import EngineConfig
from ..engine.core import EngineCore
from ..engine.params import SamplingParams
from ..engine.stats import FIELDS, PHASES
from ..model.config import ModelConfig
from ..model.transformer import Transformer

COLUMNS = (*PHASES, "host_step_ms")
# The tiny model's Hugging Face config (one layer, 512-token vocabulary).
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, eos_token_id=0)


def tiny_model(max_len: int = 40_000, seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig.from_hf(dict(TINY, max_position_embeddings=max_len)), torch.float32)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data.normal_(0, 0.05, generator=g)
    return model


def save_tiny_checkpoint(path: str, max_len: int = 40_000, seed: int = 0) -> str:
    """The tiny model as a Hugging Face directory (config.json, model.safetensors) at ``path``."""
    from safetensors.torch import save_file

    h, inter, kv = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_key_value_heads"] * TINY["head_dim"]
    shapes = {"model.embed_tokens.weight": (TINY["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(TINY["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({f"{pre}input_layernorm.weight": (h,), f"{pre}post_attention_layernorm.weight": (h,),
                       f"{pre}self_attn.q_proj.weight": (h, h), f"{pre}self_attn.k_proj.weight": (kv, h),
                       f"{pre}self_attn.v_proj.weight": (kv, h), f"{pre}self_attn.o_proj.weight": (h, h),
                       f"{pre}mlp.gate_proj.weight": (inter, h), f"{pre}mlp.up_proj.weight": (inter, h),
                       f"{pre}mlp.down_proj.weight": (h, inter)})
    g = torch.Generator().manual_seed(seed)
    save_file({k: torch.empty(v).normal_(0, 0.05, generator=g) for k, v in shapes.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(TINY, max_position_embeddings=max_len), f)
    return path


def _core(batch: int, max_len: int = 2048, checkpoint: str | None = None, **kw) -> EngineCore:
    """An engine on the tiny model: built in memory, or loaded from ``checkpoint`` (needed for
    ``tensor_parallel_size`` > 1: each rank loads its share)."""
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=max_len, max_num_batched_tokens=max(2048, 16 * batch),
                       kv_cache_memory=kw.pop("kv_cache_memory", 256 << 20), **kw)
    if checkpoint is None:
        return EngineCore(cfg, model=tiny_model(max_len))
    cfg.model, cfg.dtype = checkpoint, "float32"
    return EngineCore.from_config(cfg.resolve())


def phases(batch_sizes=(1, 16, 64, 256), iterations: int = 200, checkpoint: str | None = None,
           keep_rows: bool = False, **kw) -> list[dict]:
    """``checkpoint`` and ``kw`` (e.g. ``tensor_parallel_size``): see :func:`_core`; ``keep_rows``:
    each result also holds its iterations' stats rows (``rows``, FIELDS columns)."""
    rows = []
    for b in batch_sizes:
        core = _core(b, checkpoint=checkpoint, **kw)
        params = SamplingParams(temperature=0.0, max_tokens=iterations + 20, ignore_eos=True)
        rng = np.random.default_rng(0)
        for i in range(b):
            core.add_request(i, rng.integers(1, 512, 16).astype(np.int32), params)
        while core.stats.count < 10 or core.scheduler.waiting:  # prefill and warm-up
            core.step()
        start = core.stats.count
        for _ in range(iterations):
            core.step()
        data = core.stats.since(start)
        data = data[data[:, FIELDS.index("num_generation_requests")] == b]
        row = {"batch": b, "iterations": len(data)}
        for name in COLUMNS:
            col = data[:, FIELDS.index(name)] * 1e3
            row[name] = (float(col.mean()), float(np.percentile(col, 99)))
        overhead = (data[:, FIELDS.index("host_step_ms")] - data[:, FIELDS.index("forward_ms")]) * 1e3
        row["overhead_us"] = (float(overhead.mean()), float(np.percentile(overhead, 99)))
        if keep_rows:
            row["rows"] = data
        rows.append(row)
        core.close()
    return rows


def enqueue_cost(lengths=(16, 256, 4096, 32768, 65536), repeats: int = 200) -> list[dict]:
    core = _core(4, max_len=70_000, kv_cache_memory=32 << 20)  # one 70k-token context must fit the pool
    params = SamplingParams(max_tokens=1)
    out = []
    for n in lengths:
        prompt = np.random.default_rng(n).integers(1, 512, n).astype(np.int32)
        times = []
        for i in range(repeats):
            t = time.perf_counter()
            core.add_request(i, prompt, params)
            times.append(time.perf_counter() - t)
        as_list = prompt.tolist()
        t = time.perf_counter()
        for _ in range(5):
            copy.deepcopy(as_list)
        deep = (time.perf_counter() - t) / 5
        out.append({"prompt_tokens": n, "enqueue_us_p50": float(np.median(times) * 1e6),
                    "enqueue_us_p99": float(np.percentile(times, 99) * 1e6), "deepcopy_list_us": deep * 1e6})
    return out


def burst(copy_bug: bool = False, decoders: int = 64, newcomers: int = 160, prompt_len: int = 32_768,
          window: int = 100, decoder_prompt_len: int = 2048) -> dict:
    """Host step time of decode iterations before / during / after a burst of long prompts."""
    core = _core(decoders, max_len=prompt_len + 64, kv_cache_memory=64 << 20)
    rng = np.random.default_rng(1)
    # Decoders outlive all three windows, so every measured iteration is a full decode batch
    # while the newcomers wait (max_num_seqs = decoders). Their 2k-token prompts keep the
    # context growth across the windows small (~15%), so the forward's own slow-down with
    # context does not masquerade as burst interference.
    decode = SamplingParams(temperature=0.0, max_tokens=4 * window, ignore_eos=True)
    for i in range(decoders):
        core.add_request(i, rng.integers(1, 512, decoder_prompt_len).astype(np.int32), decode)
    prompts = [rng.integers(1, 512, prompt_len).astype(np.int32) for _ in range(newcomers)]
    long_params = SamplingParams(temperature=0.0, max_tokens=4)
    while core.scheduler.waiting or core.stats.count < 5:
        core.step()
    gc.collect()
    gc.freeze()  # as the engine process does after start-up

    def enqueue_all():
        for k, p in enumerate(prompts):
            if copy_bug:
                p = np.asarray(copy.deepcopy(p.tolist()), np.int32)  # what TensorRT-LLM's enqueue did
            core.add_request(10_000 + k, p, long_params)

    marks = {"before": core.stats.count}
    for _ in range(window):
        core.step()
    marks["during"] = core.stats.count
    t = threading.Thread(target=enqueue_all)
    t.start()
    while t.is_alive() or core.stats.count - marks["during"] < window:
        core.step()
    t.join()
    marks["after"] = core.stats.count
    for _ in range(window):
        core.step()
    marks["end"] = core.stats.count
    gc.unfreeze()
    rows = core.stats.window()
    counts = np.arange(core.stats.count - len(rows), core.stats.count)
    result = {"copy_bug": copy_bug, "prompt_len": prompt_len, "newcomers": newcomers}
    for name, (a, b) in {"before": (marks["before"], marks["during"]), "during": (marks["during"], marks["after"]),
                         "after": (marks["after"], marks["end"])}.items():
        sel = rows[(counts >= a) & (counts < b)]
        sel = sel[sel[:, FIELDS.index("num_context_tokens")] == 0]  # decode iterations only
        col = sel[:, FIELDS.index("host_step_ms")]
        over = col - sel[:, FIELDS.index("forward_ms")]
        result[name] = {"iterations": len(col), **{f"p{q}": float(np.percentile(col, q)) for q in (50, 95, 99)},
                        "overhead_p99": float(np.percentile(over, 99))}
    result["p99_during_over_before"] = result["during"]["p99"] / result["before"]["p99"]
    return result


def _fmt_phases(rows, title: str = "Decode iteration phases, microseconds: mean / p99") -> str:
    head = "batch " + "".join(f"{p[:-3]:>16}" for p in COLUMNS) + f"{'overhead':>16}"
    lines = [title, head]
    for r in rows:
        cells = "".join(f"{r[p][0]:>8.0f} /{r[p][1]:>6.0f}" for p in COLUMNS)
        lines.append(f"{r['batch']:>5} {cells}{r['overhead_us'][0]:>8.0f} /{r['overhead_us'][1]:>6.0f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="leanserve bench host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--skip-burst", action="store_true")
    ap.add_argument("--copy-bug", action="store_true", help="also run the burst with a deep copy at enqueue")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write all results to this file")
    ap.add_argument("--tensor-parallel-size", default=None, metavar="SIZES",
                    help="e.g. 1,2: only the phases, per size, the model loaded from a checkpoint by every rank")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    batch_sizes = tuple(int(x) for x in a.batch_sizes.split(","))
    if a.tensor_parallel_size:
        _main_tensor_parallel(batch_sizes, a)
        return
    results = {"phases": phases(batch_sizes, a.iterations)}
    print(_fmt_phases(results["phases"]))
    results["enqueue"] = enqueue_cost()
    print("\nEnqueue cost by prompt length (microseconds)")
    print(f"{'tokens':>8} {'enqueue p50':>12} {'enqueue p99':>12} {'deepcopy(list)':>15}")
    for r in results["enqueue"]:
        print(f"{r['prompt_tokens']:>8} {r['enqueue_us_p50']:>12.1f} {r['enqueue_us_p99']:>12.1f} "
              f"{r['deepcopy_list_us']:>15.0f}")
    if not a.skip_burst:
        runs = [burst(False)] + ([burst(True)] if a.copy_bug else [])
        results["burst"] = runs
        print("\nBurst: 64 decoding, +160 requests of 32k tokens enqueued from another thread")
        print("host step ms (decode iterations): p50 / p95 / p99")
        for r in runs:
            label = "deep-copy enqueue (bug)" if r["copy_bug"] else "leanserve"
            print(f"  {label}")
            for w in ("before", "during", "after"):
                s = r[w]
                print(f"    {w:<7} {s['p50']:7.2f} / {s['p95']:7.2f} / {s['p99']:7.2f}   "
                      f"(host overhead p99 {s['overhead_p99']:.2f}; {s['iterations']} its)")
            print(f"    p99 during / before = {r['p99_during_over_before']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _main_tensor_parallel(batch_sizes: tuple[int, ...], a) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as d:
        save_tiny_checkpoint(d)
        for size in (int(x) for x in a.tensor_parallel_size.split(",")):
            rows = phases(batch_sizes, a.iterations, checkpoint=d, tensor_parallel_size=size, threads=a.threads)
            results[f"tp{size}"] = rows
            print(_fmt_phases(rows, f"Tensor-parallel size {size}: decode iteration phases, microseconds: mean / p99"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
