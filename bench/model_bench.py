"""Model benchmark on the default model (SmolLM2-135M-Instruct, GGUF Q4_1).

Per variant, float32, bfloat16 (the default), bfloat16 with ``--quantization int8`` and with
``--quantization gguf`` (the file's Q4 blocks as int4), each in a fresh process, so RSS is the
model's own:
  * load time and RSS after load;
  * forward time of one decode step at batch 1, 8, 32, 128 (context 256 per sequence) and of a
    512-token prefill, median of 5, through the same paged-attention path the engine uses;
  * where a batch-1 decode step's time goes, op by op (torch.profiler, self CPU time);
  * a decode step of 64 sequences of 1,024 tokens against the time it takes to read their KV
    cache once at the memory bandwidth measured here (a 1 GiB copy on all cores);
  * the CPU's GEMM rate at one of the model's shapes and the compute ceiling it implies;
  * engine decode throughput at batch 1, 8, 32, 64 (host step time of decode iterations) as a
    fraction of the forward-only rate of the same iterations.

    python bench/model_bench.py                 # all variants, writes bench/results/model.{json,md}
    python bench/model_bench.py --results bench/results/xeon   # ... into another folder (another machine)
    python bench/model_bench.py --dtype float32 # one dtype, JSON to stdout
    python bench/model_bench.py --agreement     # greedy tokens of bf16 vs int4 weights, JSON to stdout
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("float32", "bfloat16", "bfloat16+int8", "bfloat16+gguf")
TOP_OPS = 12  # ops listed by name in the breakdown; the rest are summed


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def gemm_gflops(dtype, quantization: str, m: int, k: int = 576, n: int = 1536, reps: int = 30) -> float:
    """The model's own GEMM: an [out, in] weight as the engine holds it (F.linear, or packed for
    oneDNN where the runner packs it; either differs from a @ b; with int8, Int8Linear's; with
    gguf, Int4Linear's)."""
    from leanserve.model.int4 import GROUP, Int4Linear
    from leanserve.model.prepack import prepack_linears
    from leanserve.model.quant import Int8Linear

    x = torch.randn(m, k, dtype=dtype)
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    if quantization == "int8":
        lin = Int8Linear(lin)
    elif quantization == "gguf":
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        lin = Int4Linear(codes, torch.rand(n, k // GROUP) / 8, torch.zeros(n, k // GROUP), dtype)
    else:
        lin = torch.nn.Sequential(lin)
        prepack_linears(lin, torch.device("cpu"))
    with torch.inference_mode():
        for _ in range(5):
            lin(x)
        t = time.perf_counter()
        for _ in range(reps):
            lin(x)
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def forward_ms(model, batch: int, context: int, prefill: int = 0, reps: int = 5, attention: str = "auto") -> float:
    """``attention``: decode rows and the prefill in leanserve's CPU kernels where they build
    (auto, the engine's default) or in SDPA (sdpa)."""
    from leanserve.engine.config import default_block_size
    from leanserve.model import kernels
    from leanserve.model.attention import AttentionMetadata, DecodeMaskTable, PagedDecode, decode_groups

    cfg, bs = model.config, default_block_size("cpu")  # the engine's
    per_seq = -(-max(context, prefill) // bs) + 1
    nblocks = batch * per_seq + 1
    kv = torch.zeros(cfg.num_layers, 2, nblocks, cfg.num_kv_heads, bs, cfg.head_dim, dtype=model.norm.weight.dtype)
    tables = torch.arange(1, nblocks).view(batch, per_seq)
    write = kernels.write_kv() if attention == "auto" else None  # the cache write, as the engine's runner takes it
    if prefill:
        n = prefill
        kernel = kernels.paged_prefill_attention() if attention == "auto" else None
        meta = AttentionMetadata.build(torch.arange(bs, bs + n), None, 0, [(0, n, n, tables[0])], prefill_kernel=kernel,
                                       write_kv=write)
        args = (torch.randint(0, 40000, (n,)), torch.arange(n), kv, meta, torch.tensor([n - 1]))
    else:
        pos = torch.full((batch,), context - 1)
        slots = tables[:, (context - 1) // bs] * bs + (context - 1) % bs
        kernel = kernels.paged_decode_attention() if attention == "auto" else None
        if kernel is not None:
            meta = AttentionMetadata.build(slots, None, context, [], paged_decode=PagedDecode(kernel, tables, pos + 1),
                                           write_kv=write)
        else:
            groups = decode_groups(tables.numpy(), (pos + 1).numpy(), bs, DecodeMaskTable(kv.device),
                                   torch.as_tensor, mask_lone_row=True)
            meta = AttentionMetadata.build(slots, groups, context, [])
        args = (torch.randint(0, 40000, (batch,)), pos, kv, meta, None)
    model(*args)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def op_breakdown(model, batch: int = 1, context: int = 256, reps: int = 10) -> dict:
    """Self CPU time and calls per decode step by op, under torch.profiler (which adds a few
    microseconds per op: the step's time without it is given beside)."""
    from torch.profiler import ProfilerActivity, profile

    plain_ms = forward_ms(model, batch, context, reps=reps)
    forward_ms(model, batch, context, reps=1)  # shapes warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_ms(model, batch, context, reps=reps - 1)  # + one warm-up call inside: reps calls in all
    ops = sorted(((e.key, e.count / reps, e.self_cpu_time_total / reps / 1e3) for e in prof.key_averages()),
                 key=lambda op: -op[2])
    total = sum(ms for _, _, ms in ops)
    return {"step_ms": plain_ms, "profiled_ms": total, "ops_per_step": sum(n for _, n, _ in ops),
            "ops": [{"op": k, "calls": n, "ms": ms} for k, n, ms in ops]}


def copy_bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes read plus bytes written per second by a large copy on every core: the rate a step
    that streams its KV cache from memory cannot beat."""
    src = torch.ones(int(gib * (1 << 30)) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def long_context(model, batch: int = 64, context: int = 1024) -> dict:
    """A decode step of ``batch`` sequences of ``context`` tokens, against reading their KV once."""
    cfg = model.config
    itemsize = model.norm.weight.element_size()
    kv_bytes = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    gbs = copy_bandwidth_gbs()
    step = forward_ms(model, batch, context, reps=3)
    return {"batch": batch, "context": context, "kv_mb": kv_bytes / 1e6, "bandwidth_gbs": gbs,
            "bound_ms": kv_bytes / gbs / 1e6, "step_ms": step, "step_over_bound": step / (kv_bytes / gbs / 1e6)}


def engine_decode(model, batch: int, tokenizer) -> dict:
    from leanserve.engine.config import EngineConfig
    from leanserve.engine.core import EngineCore
    from leanserve.engine.params import SamplingParams
    from leanserve.engine.stats import FIELDS

    core = EngineCore(EngineConfig(max_num_seqs=batch, kv_cache_memory=512 << 20, max_model_len=1024), model=model,
                      eos_token_ids=tokenizer.eos_token_ids)
    rng = np.random.default_rng(0)
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(batch):
        core.add_request(i, rng.integers(100, 40000, 32).astype(np.int32), p)
    while core.has_work:
        core.step()
    rows = core.stats.window()
    rows = rows[rows[:, FIELDS.index("num_generation_requests")] == batch][3:]  # decode only, past warm-up
    host = rows[:, FIELDS.index("host_step_ms")]
    fwd = rows[:, FIELDS.index("forward_ms")]
    return {"batch": batch, "iterations": len(rows), "host_step_ms_p50": float(np.median(host)),
            "forward_ms_p50": float(np.median(fwd)), "tokens_per_s": float(batch / np.median(host) * 1e3),
            "forward_only_tokens_per_s": float(batch / np.median(fwd) * 1e3),
            "fraction_of_forward_ceiling": float(np.median(fwd) / np.median(host))}


def run_one(variant: str) -> dict:
    """``variant``: a dtype, optionally ``+int8`` or ``+gguf`` (``--quantization``)."""
    from leanserve.model import ModelSpec, default_model_path, load_model
    from leanserve.model.layer_ops import use_cpu_kernels
    from leanserve.model.prepack import prepack_linears
    from leanserve.tokenizer import Tokenizer

    dtype, _, quantization = variant.partition("+")
    quantization = quantization or "none"
    torch.set_num_threads(os.cpu_count() or 1)
    before = rss_mb()
    t = time.perf_counter()
    model = load_model(ModelSpec.resolve(None, dtype, quantization=quantization))
    prepack_linears(model, torch.device("cpu"))  # as the engine's runner does, before its first step
    use_cpu_kernels(model.ops, torch.device("cpu"), model.embed_tokens.weight.dtype)  # likewise
    load_s = time.perf_counter() - t
    res = {"dtype": variant, "load_s": load_s, "rss_mb": rss_mb(), "rss_before_mb": before}
    tdtype = model.norm.weight.dtype
    res["decode_ms"] = {b: forward_ms(model, b, 256) for b in (1, 8, 32, 128)}
    res["prefill_512_ms"] = forward_ms(model, 1, 0, prefill=512)
    res["ops_b1"] = op_breakdown(model)
    res["long_context"] = long_context(model)
    res["gemm_gflops"] = {m: gemm_gflops(tdtype, quantization, m) for m in (1, 8, 32, 128, 512)}
    cfg = model.config
    # FLOPs per token of the weights (all matmuls, the output head included): 2 * parameters.
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    flops = 2 * (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size)
    res["gflop_per_token"] = flops / 1e9
    res["ceiling_tokens_per_s"] = {m: g * 1e9 / flops for m, g in res["gemm_gflops"].items()}
    tok = Tokenizer.from_pretrained(default_model_path())
    res["engine_decode"] = [engine_decode(model, b, tok) for b in (1, 8, 32, 64)]
    return res


def op_table(results: list[dict], variants: tuple[str, ...] = ("bfloat16", "bfloat16+gguf")) -> list[str]:
    """The batch-1 breakdown of the default weights beside the int4 ones, op by op: the ops in
    either variant's ``TOP_OPS`` by time, then the rest summed."""
    by = {r["dtype"]: r["ops_b1"] for r in results if r["dtype"] in variants}
    ops = list(dict.fromkeys(op["op"] for v in variants for op in by[v]["ops"][:TOP_OPS]))
    ms = {v: {op["op"]: op for op in by[v]["ops"]} for v in variants}
    other = {v: sum(op["ms"] for name, op in ms[v].items() if name not in ops) for v in variants}
    out = ["", f"Where a batch-1 decode step's time goes (context 256): self CPU time and calls per step under "
           f"torch.profiler, {by[variants[0]]['ops_per_step']:.0f} ops per step with {variants[0]}, "
           f"{by[variants[1]]['ops_per_step']:.0f} with {variants[1]} (the profiler adds a few microseconds to each: "
           "the step without it is in the last row):", "",
           "| op | " + " | ".join(f"{v} calls | ms" for v in variants) + " |", "|---|" + "---|---|" * len(variants)]
    for name in ops:
        cells = [f"{ms[v][name]['calls']:.0f} | {ms[v][name]['ms']:.2f}" if name in ms[v] else "| " for v in variants]
        out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    out.append("| other ops | " + " | ".join(f" | {other[v]:.2f}" for v in variants) + " |")
    out.append("| all, profiled | " + " | ".join(f"{by[v]['ops_per_step']:.0f} | {by[v]['profiled_ms']:.2f}"
                                                 for v in variants) + " |")
    out.append("| step without the profiler | " + " | ".join(f" | {by[v]['step_ms']:.2f}" for v in variants) + " |")
    return out


PROMPTS = ["The capital of France is", "Write a haiku about the sea.\n", "1, 2, 3, 4,", "In 1492, Columbus",
           "def fibonacci(n):", "The three primary colors are", "Once upon a time, in a small village,",
           "Water boils at", "The quick brown fox", "Question: What is 12 times 7?\nAnswer:",
           "Python is a programming language that", "My favourite food is",
           "The largest planet in the solar system is", "To make a cup of tea, first", "Shakespeare wrote",
           "The speed of light is"]


def greedy_agreement(max_tokens: int = 48) -> dict:
    """Whether two weight formats of the default model give the same greedy tokens: what a step
    that picked the format by its row count would need to keep a request's answer independent of
    its neighbours. bf16 weights (``none``) against int4 (``gguf``), on ``PROMPTS``."""
    from leanserve import LLM, SamplingParams
    from leanserve.model import default_model_path
    from leanserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_path())
    prompts = [np.asarray(tok.encode(t), np.int32) for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for quantization in ("none", "gguf"):
        with LLM(None, dtype="bfloat16", quantization=quantization) as llm:
            out[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(out["none"], out["gguf"])]
    return {"prompts": len(prompts), "max_tokens": max_tokens, "identical": sum(f is None for f in first),
            "first_difference": first}


def markdown(results: list[dict]) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    out = [f"Machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; Python {platform.python_version()}",
           "", "| dtype | load s | RSS MB | decode b1 | b8 | b32 | b128 ms | prefill 512 ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r["decode_ms"]
        out.append(f"| {r['dtype']} | {r['load_s']:.1f} | {r['rss_mb']:.0f} | {d['1']:.0f} | {d['8']:.0f} | "
                   f"{d['32']:.0f} | {d['128']:.0f} | {r['prefill_512_ms']:.0f} |")
    out += op_table(results)
    out += ["", "A decode step of 64 sequences of 1,024 tokens (median of 3) against the time it takes to read "
            "their KV cache once at the memory bandwidth measured in the same process (bytes read plus written per "
            "second by a 1 GiB copy on all cores, best of 5):", "",
            "| dtype | KV MB | bandwidth GB/s | read once ms | step ms | step / read once |",
            "|---|---|---|---|---|---|"]
    for r in results:
        lc = r["long_context"]
        out.append(f"| {r['dtype']} | {lc['kv_mb']:.0f} | {lc['bandwidth_gbs']:.1f} | {lc['bound_ms']:.0f} | "
                   f"{lc['step_ms']:.0f} | {lc['step_over_bound']:.1f} |")
    out += ["", "GEMM rate (M x 576 -> 1536; for +int8 the int8 kernel, for +gguf the int4 kernel, at every M) "
            "and the compute ceiling it implies for the model's weights "
            f"({results[0]['gflop_per_token']:.2f} GFLOP/token):", "",
            "| dtype | M=1 | 8 | 32 | 128 | 512 GFLOP/s | ceiling tok/s at M=128 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        g = r["gemm_gflops"]
        out.append(f"| {r['dtype']} | {g['1']:.0f} | {g['8']:.0f} | {g['32']:.0f} | {g['128']:.0f} | {g['512']:.0f} | "
                   f"{r['ceiling_tokens_per_s']['128']:.0f} |")
    out += ["", "Engine decode (greedy, 32-token prompts, 24 new tokens): tokens/s from the median host step time of "
            "decode iterations, and the share of that step spent in the forward:", "",
            "| dtype | batch | host step ms | forward ms | tok/s | forward-only tok/s | fraction |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        for e in r["engine_decode"]:
            out.append(f"| {r['dtype']} | {e['batch']} | {e['host_step_ms_p50']:.1f} | {e['forward_ms_p50']:.1f} | "
                       f"{e['tokens_per_s']:.0f} | {e['forward_only_tokens_per_s']:.0f} | "
                       f"{e['fraction_of_forward_ceiling']:.3f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=VARIANTS)
    ap.add_argument("--agreement", action="store_true",
                    help="only compare the greedy tokens of bf16 and int4 weights; JSON to stdout")
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="where model.{json,md} go")
    a = ap.parse_args()
    if a.dtype:
        print(json.dumps(run_one(a.dtype)))
        return
    if a.agreement:
        print(json.dumps(greedy_agreement()))
        return
    results = []
    for dtype in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--dtype", dtype], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    os.makedirs(a.results, exist_ok=True)
    with open(os.path.join(a.results, "model.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = markdown(results)
    command = f".venv/bin/python bench/model_bench.py {' '.join(sys.argv[1:])}".rstrip()
    with open(os.path.join(a.results, "model.md"), "w") as f:
        f.write(f"# Model benchmark\n\nCommand: `{command}`\n\n" + md)
    print(md)


if __name__ == "__main__":
    main()
