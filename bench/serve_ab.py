"""Two leanserve checkouts (or two sets of flags) served side by side: rounds interleaved, a fresh
server per variant and round, the same client and workloads, and a table of medians with each
round's output tok/s. The machine is shared and its speed drifts within minutes: compare the
variants within a round, read the medians and the per-round pairs, not one run.

    git worktree add /tmp/base HEAD          # base: the commit before the change
    .venv/bin/python bench/serve_ab.py --base /tmp/base --json /tmp/ab.json

base runs `leanserve serve` from --base's src/ (PYTHONPATH), new from this tree's; --base-args
and --new-args add flags to either (the same checkout twice, --base-args '--block-size 16', compares
a flag). Each --points entry is INPUTxCONCURRENCYxPROMPTS: random prompts of INPUT tokens, 128
output tokens, EOS ignored, PROMPTS requests at most CONCURRENCY at a time (`leanserve bench
serve`). The first round runs base first, the next new first, and so on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from compare import ROOT, Engine, free_port, machine, start, stop  # this script's neighbour in bench/

DEFAULT_POINTS = "1024x64x64,1024x16x16,1024x1x8,128x64x64,128x1x8"


def points(text: str) -> list[tuple[int, int, int]]:
    out = []
    for p in text.split(","):
        parts = p.split("x")
        if len(parts) != 3 or not all(x.isdigit() for x in parts):
            raise argparse.ArgumentTypeError(f"--points: {p!r} is not INPUTxCONCURRENCYxPROMPTS")
        out.append(tuple(int(x) for x in parts))
    return out


def serve_round(src: Path, args: list[str], workloads: list[tuple[int, int, int]], seed: int, log: Path) -> list[dict]:
    """One fresh server from ``src`` with ``args``, every workload in turn; the server's output goes to
    ``log``, the client's reports beside it."""
    from leanserve.bench import serve

    port = free_port()
    command = ["env", f"PYTHONPATH={src}", sys.executable, "-m", "leanserve.cli", "serve", "--port", str(port), *args]
    proc, _ = start(Engine("leanserve", command, {}, " ".join(args), start_timeout=300), port, log)
    runs = []
    try:
        for input_len, concurrency, prompts in workloads:
            with log.with_suffix(".client.txt").open("a") as report, contextlib.redirect_stdout(report):
                out = serve.main(["--base-url", f"http://127.0.0.1:{port}", "--random-input-len", str(input_len),
                                  "--random-output-len", "128", "--num-prompts", str(prompts), "--max-concurrency",
                                  str(concurrency), "--ignore-eos", "--seed", str(seed), "--no-progress"])
            runs.append({"input_len": input_len, "concurrency": concurrency, "prompts": prompts} | out["summary"]
                        | {"engine": out["engine"]})
    finally:
        stop(proc)
    return runs


def table(runs: list[dict]) -> str:
    lines = ["| prompt | concurrency | variant | rounds | output tok/s | TPOT p50 ms | ITL p50 ms | ITL p99 ms | "
             "ITL p99 / p50 | TTFT p50 / p99 s | forward p50 ms | failed | per round tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for key in sorted({(r["input_len"], r["concurrency"]) for r in runs}, key=lambda k: (-k[0], -k[1])):
        medians = {}
        for variant in ("base", "new"):
            mine = sorted((r for r in runs if (r["input_len"], r["concurrency"]) == key and r["variant"] == variant),
                          key=lambda r: r["round"])
            if not mine:
                continue
            m = lambda k: statistics.median(r[k] for r in mine)  # noqa: E731
            medians[variant] = m("output_throughput")
            forward = statistics.median(r["engine"]["forward_ms"]["p50"] for r in mine) if mine[0]["engine"] else 0
            lines.append(f"| {key[0]} | {key[1]} | {variant} | {len(mine)} | {m('output_throughput'):.1f} | "
                         f"{m('median_tpot_ms'):.1f} | {m('median_itl_ms'):.1f} | {m('p99_itl_ms'):.1f} | "
                         f"{m('p99_itl_ms') / m('median_itl_ms'):.2f} | {m('median_ttft_ms') / 1e3:.2f} / "
                         f"{m('p99_ttft_ms') / 1e3:.2f} | {forward:.1f} | {sum(r['failed'] for r in mine)} | "
                         + ", ".join(f"{r['output_throughput']:.1f}" for r in mine) + " |")
        if len(medians) == 2:
            ratios.append(f"{key[0]} x {key[1]}: new / base {medians['new'] / medians['base']:.3f}")
    return "\n".join(lines + [""] + ratios)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the base checkout (its src/ is served)")
    p.add_argument("--base-args", default="", help="flags for base's `leanserve serve`")
    p.add_argument("--new-args", default="", help="flags for new's `leanserve serve`")
    p.add_argument("--points", type=points, default=points(DEFAULT_POINTS), help=f"default {DEFAULT_POINTS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="every run, with the command and the machine")
    a = p.parse_args()
    variants = {"base": (a.base.resolve() / "src", shlex.split(a.base_args)),
                "new": (ROOT / "src", shlex.split(a.new_args))}
    result = {"command": "bench/serve_ab.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
              "machine": machine(), "runs": []}
    logs = Path(tempfile.mkdtemp(prefix="serve_ab_"))
    for rnd in range(a.rounds):
        for variant in ("base", "new") if rnd % 2 == 0 else ("new", "base"):
            src, args = variants[variant]
            started = time.strftime("%H:%M:%S")
            runs = serve_round(src, args, a.points, rnd, logs / f"{variant}_{rnd}.log")
            result["runs"] += [r | {"variant": variant, "round": rnd, "started": started} for r in runs]
            print(f"round {rnd} {variant} ({started}): "
                  + ", ".join(f"{r['input_len']}x{r['concurrency']} {r['output_throughput']:.1f}" for r in runs),
                  flush=True)
            if a.json:
                a.json.write_text(json.dumps(result, indent=1))
    print(table(result["runs"]))


if __name__ == "__main__":
    main()
