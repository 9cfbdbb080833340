"""The chunk budget (``--max-num-batched-tokens``) measured: what a prefill chunk costs the decode
rows that share its step, and what each budget gives a served load at concurrency 64.

    PYTHONPATH=src .venv/bin/python bench/chunk_budget.py               # both parts, 1-3 h on 2 busy cores
    PYTHONPATH=src .venv/bin/python bench/chunk_budget.py --part steps  # the engine part only, ~10 min

steps  One engine in this process (default model and flags, torch on one thread). 64 requests
       decode at a context of 128 or 1,024 tokens; for each budget, in turn and over --rounds,
       the CPU time of steps that only decode and of steps that carry a full chunk beside the 64
       decode rows (new prompts of the same length with max_tokens=1, so the batch stays at 64).
serve  `leanserve serve --max-num-batched-tokens B` (otherwise default flags), driven by
       `leanserve bench serve` at concurrency 64 with random prompts of --input-lens tokens, 128
       output tokens, EOS ignored; budgets interleaved over --rounds, one server per run.

Writes bench/results/chunk_budget.{json,md} after every run, with the commands, the machine and
its load average (1-minute) before and after each run: this VM is shared, so compare budgets
within a round and read medians across rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from compare import RESULTS, Engine, free_port, machine, start, stop  # this script's neighbour in bench/

DECODE_ROWS = 64


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def loadavg() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------------------- steps
def step_probe(a) -> list[dict]:
    """Per step, the CPU time of the engine's thread with torch on one thread: on this shared VM
    wall times of one step vary 2-4x with the neighbours' load, CPU time of one thread does not,
    and the ratio of a step with a chunk to one without is about the same on more threads (both
    are GEMMs that split across cores)."""
    import torch

    from leanserve.engine.config import EngineConfig
    from leanserve.engine.core import EngineCore
    from leanserve.engine.params import SamplingParams
    from leanserve.engine.stats import FIELDS
    from leanserve.model import load_model

    torch.set_num_threads(1)
    config = EngineConfig(max_num_seqs=DECODE_ROWS + max(a.budgets) // min(a.input_lens) + 2,
                          kv_cache_memory=3 << 30, max_model_len=max(a.input_lens) + 2048)
    model = load_model(config.resolve().model)
    ctx, gen = FIELDS.index("num_context_tokens"), FIELDS.index("num_generation_requests")
    rng = np.random.default_rng(0)
    out = []
    for context in a.input_lens:
        core = EngineCore(config, model)

        def step() -> tuple[float, int, int]:
            """CPU ms of one step, its prefill tokens and its decode rows."""
            t = time.thread_time()
            core.step()
            row = core.stats.window(1)[0]
            return (time.thread_time() - t) * 1e3, int(row[ctx]), int(row[gen])

        def prompt() -> np.ndarray:
            return rng.integers(100, 40000, context).astype(np.int32)

        for i in range(DECODE_ROWS):
            core.add_request(i, prompt(), SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True))
        # reach the steady state quickly (steps where nothing decodes yet take the prefill budget)
        core.scheduler.max_num_batched_tokens = core.scheduler.max_prefill_tokens = 8192
        while step()[1] or core.scheduler.waiting:  # until every prompt is in and a step only decodes
            pass
        next_id = DECODE_ROWS
        runs = {b: {"decode_ms": [], "mixed_ms": []} for b in a.budgets}
        for r in range(a.rounds):
            for budget in (a.budgets if r % 2 == 0 else a.budgets[::-1]):
                core.scheduler.max_num_batched_tokens = budget
                chunk = budget - DECODE_ROWS
                runs[budget]["decode_ms"] += [step()[0] for _ in range(3)]
                # Two full chunks: new prompts that end once their prefill samples a token, so
                # the decode batch stays at 64.
                for _ in range(-(-2 * chunk // context)):
                    core.add_request(next_id, prompt(), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                    next_id += 1
                while core.num_queued or core.scheduler.waiting or len(core.scheduler.running) > DECODE_ROWS:
                    ms, tokens, rows = step()
                    if tokens == chunk and rows == DECODE_ROWS:
                        runs[budget]["mixed_ms"].append(ms)
                print(f"steps context {context} budget {budget} round {r}: decode "
                      f"{statistics.median(runs[budget]['decode_ms']):.0f} ms, with chunk "
                      f"{statistics.median(runs[budget]['mixed_ms']):.0f} ms (CPU), load {loadavg():.1f}", flush=True)
        core.close()
        for budget, t in runs.items():
            d, m = statistics.median(t["decode_ms"]), statistics.median(t["mixed_ms"])
            out.append({"context": context, "budget": budget, "decode_ms": d, "mixed_ms": m, "ratio": m / d,
                        "prefill_tok_s": (budget - DECODE_ROWS) / (m - d) * 1e3, "samples": t})
    return out


# ---------------------------------------------------------------------------------------- serve
def serve_command(port: int, budget: int) -> list[str]:
    return [sys.executable, "-m", "leanserve.cli", "serve", "--port", str(port),
            "--max-num-batched-tokens", str(budget)]


def bench_args(base_url: str, input_len: int | str, prompts: int | str) -> list[str]:
    return ["--base-url", base_url, "--random-input-len", str(input_len),
            "--random-output-len", "128", "--num-prompts", str(prompts), "--max-concurrency", str(DECODE_ROWS),
            "--ignore-eos", "--seed", "0", "--no-progress"]


def serve_one(budget: int, input_len: int, prompts: int, log: Path) -> dict:
    from leanserve.bench import serve

    port = free_port()
    engine = Engine("leanserve", serve_command(port, budget), {}, f"--max-num-batched-tokens {budget}",
                    start_timeout=300)
    proc, _ = start(engine, port, log)
    try:
        before = loadavg()
        out = serve.main(bench_args(f"http://127.0.0.1:{port}", input_len, prompts))
        return out["summary"] | {"engine": out["engine"], "load_before": before, "load_after": loadavg()}
    finally:
        stop(proc)


KEYS = ("median_itl_ms", "p99_itl_ms", "median_tpot_ms", "output_throughput", "median_ttft_ms", "p99_ttft_ms")


def serve_table(runs: list[dict]) -> list[dict]:
    rows = []
    for input_len in sorted({r["input_len"] for r in runs}):
        for budget in sorted({r["budget"] for r in runs}, reverse=True):
            mine = [r for r in runs if r["input_len"] == input_len and r["budget"] == budget]
            if not mine:
                continue
            row = {"input_len": input_len, "budget": budget, "runs": len(mine),
                   "failed": sum(r["failed"] for r in mine)}
            row |= {k: statistics.median(r[k] for r in mine) for k in KEYS}
            row["itl_p99_over_p50"] = statistics.median(r["p99_itl_ms"] / r["median_itl_ms"] for r in mine)
            # The engine's own side of it: its iterations' p99 over p50, the client and API process left out.
            row["step_p99_over_p50"] = statistics.median(r["engine"]["host_step_ms"]["p99"]
                                                         / r["engine"]["host_step_ms"]["p50"] for r in mine)
            row["load"] = statistics.median((r["load_before"] + r["load_after"]) / 2 for r in mine)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- report
def write(results: Path, result: dict) -> None:
    (results / "chunk_budget.json").write_text(json.dumps(result, indent=1))
    m = result["machine"]
    lines = ["# Chunk budget (`--max-num-batched-tokens`) at concurrency 64", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['isa'])}), torch {m['torch']}; shared with "
             "other test suites, so each part gives the 1-minute load average it ran under.", ""]
    if "steps" in result:
        steps = result["steps"]
        lines += ["## Engine steps: 64 decode rows, alone and beside a full chunk", "",
                  f"`{steps['command']}`", "",
                  f"CPU time of a step on one torch thread, median over {steps['rounds']} interleaved rounds (load "
                  f"{steps['load']}); the last column is the chunk's own rate: (budget - 64) tokens over the "
                  "difference between the two steps.", "",
                  "| context | budget | decode step ms | step with chunk ms | ratio | chunk's prefill tok/s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {s['context']} | {s['budget']} | {s['decode_ms']:.0f} | {s['mixed_ms']:.0f} | "
                  f"{s['ratio']:.2f} | {s['prefill_tok_s']:.0f} |" for s in steps["rows"]]
        lines.append("")
    if "serve" in result:
        runs = result["serve"]["runs"]
        prompts = {r["input_len"]: r["prompts"] for r in runs}
        lines += ["## Served: concurrency 64, 128 output tokens, EOS ignored", "",
                  f"`{result['serve']['command']}`: one server per run, `leanserve serve --max-num-batched-tokens B` "
                  "(other flags default), then `leanserve bench serve " + " ".join(bench_args("URL", "N", "P")[2:])
                  + "`. Medians over runs; a ratio column is the median of the runs' ratios; engine step: the "
                  "server's own iterations (`/stats`), without the API process and the client.", "",
                  "| input | prompts | budget | runs | ITL p50 ms | ITL p99 ms | ITL p99 / p50 | engine step p99 / p50 "
                  "| TPOT p50 ms | output tok/s | TTFT p50 s | TTFT p99 s | load |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in serve_table(runs):
            lines.append(f"| {t['input_len']} | {prompts[t['input_len']]} | {t['budget']} | {t['runs']} | "
                         f"{t['median_itl_ms']:.0f} | {t['p99_itl_ms']:.0f} | {t['itl_p99_over_p50']:.2f} | "
                         f"{t['step_p99_over_p50']:.2f} | {t['median_tpot_ms']:.0f} | {t['output_throughput']:.1f} | "
                         f"{t['median_ttft_ms'] / 1e3:.1f} | {t['p99_ttft_ms'] / 1e3:.1f} | {t['load']:.1f} |")
        lines += ["", "Runs in order:", "",
                  "| round | input | budget | ITL p50 / p99 ms | engine step p50 / p99 ms | output tok/s "
                  "| load before, after |", "|---|---|---|---|---|---|---|"]
        for r in runs:
            step = r["engine"]["host_step_ms"]
            lines.append(f"| {r['round']} | {r['input_len']} | {r['budget']} | {r['median_itl_ms']:.0f} / "
                         f"{r['p99_itl_ms']:.0f} | {step['p50']:.0f} / {step['p99']:.0f} | "
                         f"{r['output_throughput']:.1f} | {r['load_before']:.1f}, {r['load_after']:.1f} |")
    (results / "chunk_budget.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["steps", "serve", "both"], default="both")
    ap.add_argument("--budgets", type=ints, default=[2048, 1024, 512, 320, 256, 192])
    ap.add_argument("--input-lens", type=ints, default=[128, 1024])
    ap.add_argument("--prompts", type=ints, default=[128, 64], help="requests per served run, per input length")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args()
    a.results.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=src .venv/bin/python bench/chunk_budget.py " + " ".join(sys.argv[1:])
    # A part run alone keeps the other part's results.
    path = a.results / "chunk_budget.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    import torch

    result["machine"] = machine() | {"torch": torch.__version__}
    if a.part in ("steps", "both"):
        before = loadavg()
        rows = step_probe(a)
        result["steps"] = {"command": command, "rounds": a.rounds, "load": f"{before:.1f} -> {loadavg():.1f}",
                           "rows": rows}
        write(a.results, result)
    if a.part in ("serve", "both"):
        result["serve"] = {"command": command, "runs": []}
        for r in range(a.rounds):
            for budget in (a.budgets if r % 2 == 0 else a.budgets[::-1]):
                for input_len, prompts in zip(a.input_lens, a.prompts):
                    print(f"== serve round {r} budget {budget} input {input_len} (load {loadavg():.1f})", flush=True)
                    run = serve_one(budget, input_len, prompts, Path(tempfile.gettempdir()) / "chunk_budget_server.log")
                    result["serve"]["runs"].append(run | {"round": r, "budget": budget, "input_len": input_len,
                                                          "prompts": prompts})
                    write(a.results, result)
    print((a.results / "chunk_budget.md").read_text())


if __name__ == "__main__":
    main()
