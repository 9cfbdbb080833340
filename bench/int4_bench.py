"""int4 weights (``--quantization gguf``) against the other formats, at the default model's shapes.

Linear layers: bf16 ``F.linear``, int4 (group 32, as GGUF Q4 weights are kept), Q8_0 as two int4
planes, the int8 weight-only kernel (``--quantization int8``) and float32, at 1-512 rows. The
variants are interleaved in one process (the machine is shared and noisy); each figure is the
median, or the minimum, over ``--repeats`` rounds. ``--model``: forward time of the default
model's engine steps, ``none`` vs ``gguf``. Results: ``bench/results/int4.md``.

    python bench/int4_bench.py --json bench/results/int4.json
    python bench/int4_bench.py --model --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from leanserve.model.int4 import Int4Linear
from leanserve.model.quant import Int8Linear

# SmolLM2-135M: (name, in, out); q/k/v and gate/up are fused as the model holds them.
SHAPES = (("qkv", 576, 960), ("gate_up", 576, 3072), ("down", 1536, 576), ("o_proj", 576, 576),
          ("head", 576, 49152))
ROWS = (1, 4, 16, 64, 256, 512)


def variants(k: int, n: int) -> dict:
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    codes = torch.randint(0, 16, (n, 2 * k), dtype=torch.uint8)
    scale = torch.rand(n, 2 * k // 32) * 0.01
    one = (codes[:, :k], scale[:, : k // 32], 0 * scale[:, : k // 32])
    # An 8-bit block as two 4-bit planes side by side along the input (q + 128 = 16 h + l:
    # w = 16 d (h - 8) + d (l - 8) + 8 d), one int4 GEMM over the input repeated twice: what
    # computing on a Q8_0 weight (the default model's head) exactly with this kernel would cost.
    planes = Int4Linear(codes, scale, 0 * scale, torch.bfloat16)
    return {"bf16": (lin, torch.bfloat16), "int4": (Int4Linear(*one, torch.bfloat16), torch.bfloat16),
            "int8": (Int8Linear(lin), torch.bfloat16),
            "q8 as 2x int4": (lambda x: planes(x.repeat(1, 2)), torch.bfloat16),
            "fp32": (torch.nn.Linear(k, n, bias=False), torch.float32),
            "int4 fp32-act": (Int4Linear(*one, torch.float32), torch.float32)}


# int4 with float32 activations is 14-28x slower than with bf16 at one row: timed at few rows only.
SKIP = {"int4 fp32-act": 4}


@torch.inference_mode()
def bench(repeats: int, min_s: float = 0.005) -> list[dict]:
    """Per cell: median and min over ``repeats`` interleaved rounds of >= ``min_s`` each."""
    out = []
    for name, k, n in SHAPES:
        all_mods = variants(k, n)
        for m in ROWS:
            mods = {v: mod for v, mod in all_mods.items() if m <= SKIP.get(v, m)}
            xs = {v: torch.randn(m, k, dtype=dt) for v, (_, dt) in mods.items()}
            calls = {}
            for v, (mod, _) in mods.items():  # warm up; calls per timing so one lasts >= min_s
                once = []
                for _ in range(5):  # the fastest of several: a first call (a kernel's JIT) is slow
                    t = time.perf_counter()
                    mod(xs[v])
                    once.append(time.perf_counter() - t)
                calls[v] = max(1, int(min_s / max(min(once), 1e-6)))
            times = {v: [] for v in mods}
            for _ in range(repeats):
                for v, (mod, _) in mods.items():
                    t = time.perf_counter()
                    for _ in range(calls[v]):
                        mod(xs[v])
                    times[v].append((time.perf_counter() - t) / calls[v] * 1e3)
            out.append({"shape": name, "in": k, "out": n, "rows": m,
                        "median": {v: statistics.median(ts) for v, ts in times.items()},
                        "min": {v: min(ts) for v, ts in times.items()}})
    return out


def markdown(rows: list[dict], stat: str) -> str:
    names = list(rows[0][stat])
    lines = [f"| shape | rows | {' | '.join(names)} | int4/bf16 |", "|---" * (len(names) + 3) + "|"]
    for r in rows:
        cells = " | ".join(f"{r[stat][v]:.3f}" if v in r[stat] else "" for v in names)
        ratio = r[stat]["int4"] / r[stat]["bf16"]
        lines.append(f"| {r['shape']} {r['in']}->{r['out']} | {r['rows']} | {cells} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def engine_forward_ms(llm, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    """Median forward time of the steps of one ``generate`` call that are ``batch`` decode rows
    and nothing else (``new_tokens`` == 1: of its prefill steps)."""
    import numpy as np

    from leanserve import SamplingParams
    from leanserve.engine.stats import FIELDS

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 40000, prompt_len).astype(np.int32) for _ in range(batch)]
    before = len(llm.engine.stats.window())
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    rows = llm.engine.stats.window()[before:]
    col = FIELDS.index
    if new_tokens == 1:
        rows = rows[rows[:, col("num_context_tokens")] > 0]
    else:
        rows = rows[(rows[:, col("num_generation_requests")] == batch) & (rows[:, col("num_context_tokens")] == 0)]
    return float(np.median(rows[:, col("forward_ms")]))


def bench_model(repeats: int, configs: dict) -> list[dict]:
    """The default model served through the offline API, the variants taking turns, one engine
    alive at a time (each engine steps on its own thread, with its own OpenMP pool: two alive at
    once made both ~1.6x slower here): forward time of decode steps at 1-64 sequences (96-token
    prompts, 32 new tokens: contexts ~128) and of one 512-token prefill step."""
    from leanserve import LLM

    cases = [("decode", b) for b in (1, 4, 16, 64)] + [("prefill 512", 1)]
    times = {(c, v): [] for c in cases for v in configs}
    for r in range(repeats):
        for v, kw in configs.items():
            with LLM(None, kv_cache_memory=512 << 20, max_num_seqs=64, **kw) as llm:
                for kind, batch in cases:
                    args = (batch, 96, 32) if kind == "decode" else (1, 512, 1)
                    times[((kind, batch), v)].append(engine_forward_ms(llm, *args, seed=r))
    return [{"case": f"decode x{b}" if kind == "decode" else kind,
             "median": {v: statistics.median(times[((kind, b), v)]) for v in configs},
             "min": {v: min(times[((kind, b), v)]) for v in configs}} for kind, b in cases]


def model_markdown(rows: list[dict]) -> str:
    names = list(rows[0]["median"])
    out = [f"| step | {' | '.join(names)} ms, median (min) |", "|---" * (len(names) + 1) + "|"]
    for r in rows:
        cells = " | ".join(f"{r['median'][v]:.1f} ({r['min'][v]:.1f})" for v in names)
        out.append(f"| {r['case']} | {cells} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json")
    ap.add_argument("--model", action="store_true")
    a = ap.parse_args()
    if a.model:
        rows = bench_model(a.repeats, {q: {"dtype": "bfloat16", "quantization": q} for q in ("none", "gguf")})
        print(f"torch {torch.__version__}; forward ms of engine steps, {a.repeats} rounds\n\n{model_markdown(rows)}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = bench(a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call\n")
    for stat in ("median", "min"):
        print(f"{stat} of {a.repeats} rounds:\n\n{markdown(rows, stat)}")


if __name__ == "__main__":
    main()
