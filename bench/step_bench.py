"""One forward step of the default model, as the engine's runner takes it on the CPU: decode rows
and a prefill chunk over the paged KV cache, in leanserve's kernels. What a served step at
concurrency 64 with long prompts is made of, without a server: 64 decode rows of 1,024 tokens
beside a 320-token chunk of a prompt whose first 512 tokens are in the cache is
``--decode-rows 64 --context 1024 --chunk 320 --chunk-start 512``.

Prints the step's median and best time over ``--reps`` forwards, and with ``--profile`` the ops'
self CPU time per step under torch.profiler (which adds a few microseconds to each). To compare
two commits, run it in each checkout in turn, a few rounds interleaved: the machine is shared.

    PYTHONPATH=src .venv/bin/python bench/step_bench.py --decode-rows 64 --context 1024 --chunk 320 --chunk-start 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from leanserve.engine.config import default_block_size
from leanserve.model import ModelSpec, kernels, load_model
from leanserve.model.attention import AttentionMetadata, PagedDecode
from leanserve.model.layer_ops import use_cpu_kernels
from leanserve.model.prepack import prepack_linears


def step_args(model, decode_rows: int, context: int, chunk: int, chunk_start: int):
    """The forward's arguments: each decode row's own blocks, then the chunk's sequence's, in order
    (random keys and values: the kernels' time does not depend on them)."""
    cfg, bs = model.config, default_block_size("cpu")
    per_seq = -(-max(context, chunk_start + chunk) // bs) + 1
    tables = torch.arange(1, (decode_rows + 1) * per_seq + 1).view(decode_rows + 1, per_seq)
    kv = torch.randn(cfg.num_layers, 2, tables.numel() + 1, cfg.num_kv_heads, bs, cfg.head_dim).to(model.norm.weight.dtype)
    pos = torch.full((decode_rows,), context - 1)
    slots = [tables[:decode_rows, (context - 1) // bs] * bs + (context - 1) % bs]
    chunk_pos = torch.arange(chunk_start, chunk_start + chunk)
    slots.append(tables[decode_rows, chunk_pos // bs] * bs + chunk_pos % bs)
    decode = PagedDecode(kernels.paged_decode_attention(), tables[:decode_rows], pos + 1) if decode_rows else None
    prefills = [(decode_rows, chunk, chunk_start + chunk, tables[decode_rows])] if chunk else []
    meta = AttentionMetadata.build(torch.cat(slots), None, context, prefills, paged_decode=decode,
                                   prefill_kernel=kernels.paged_prefill_attention(), write_kv=kernels.write_kv())
    rows = decode_rows + chunk
    logits_rows = list(range(decode_rows)) + ([rows - 1] if chunk else [])
    return torch.randint(0, cfg.vocab_size, (rows,)), torch.cat([pos, chunk_pos]), kv, meta, torch.tensor(logits_rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="tokens of each decode row's context")
    p.add_argument("--chunk", type=int, default=320, help="prefill tokens in the step (0: none)")
    p.add_argument("--chunk-start", type=int, default=0, help="the chunk's prompt tokens already in the cache")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    if args.decode_rows + args.chunk == 0:
        p.error("--decode-rows and --chunk: a step needs rows")
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(ModelSpec.resolve(None, args.dtype, quantization="none"))
    prepack_linears(model, torch.device("cpu"))  # as the engine's runner does
    use_cpu_kernels(model.ops, torch.device("cpu"), model.norm.weight.dtype)
    fwd = step_args(model, args.decode_rows, args.context, args.chunk, args.chunk_start)
    with torch.inference_mode():
        for _ in range(2):
            model(*fwd)
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            model(*fwd)
            times.append(time.perf_counter() - t)
        print(f"{args.decode_rows} decode rows of {args.context} tokens + a {args.chunk}-token chunk from "
              f"{args.chunk_start}: step {statistics.median(times) * 1e3:.1f} ms (best {min(times) * 1e3:.1f})")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.reps):
                    model(*fwd)
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]:
                print(f"  {e.key:40s} {e.count / args.reps:6.0f} calls {e.self_cpu_time_total / args.reps / 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
