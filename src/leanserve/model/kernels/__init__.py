"""Kernels leanserve compiles on the machine it runs on, for what PyTorch does not ship.

One today: decode attention over the paged KV cache on the CPU (``paged_decode_attention.cpp``;
why, in its header). It is built the first time a process asks for it, with the machine's C++
compiler (``$CXX``, else ``c++``) against the installed torch, for this CPU's instruction set
(``-march=native``), and kept in a cache directory (``$LEANSERVE_KERNEL_CACHE``, else
``~/.cache/leanserve/kernels``) under a name that hashes everything the build depends on, so a
second start loads it in milliseconds and a torch upgrade or another CPU builds anew (~7 s on 2
cores). Without a compiler, or if the build fails, :func:`paged_decode_attention` says so in one
log line and returns None: the model runner then attends decode rows with gathered keys and
SDPA, the path every other device takes.

The .so links the libgomp torch loaded (``-fopenmp``, torch's lib directory as its rpath), so
its OpenMP threads are torch's own pool, not a second one competing for the cores.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
# -f flags: let the compiler reorder float sums (vectorised reductions) without assuming finite
# values: the kernel's running max starts at -inf.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-fno-math-errno",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags, where Linux says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(next((ln for ln in lines if ln.startswith(key)), "") for key in ("model name", "flags"))


def _compile(compiler: str, target: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    include = torch_dir / "include"
    cmd = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{include}", f"-I{include / 'torch/csrc/api/include'}", str(SOURCE), "-o", str(target),
           f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")


def _build(compiler: str) -> Path:
    """The kernel's shared library, compiled unless the cache has this exact build."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), *FLAGS, torch.__version__, version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LEANSERVE_KERNEL_CACHE") or Path.home() / ".cache/leanserve/kernels")
    target = cache / f"paged_decode_attention-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: processes starting together (data-
        # parallel engines, tensor-parallel ranks) each build, and none loads a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            _compile(compiler, Path(tmp))
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


@functools.cache  # a process loads the library once: torch's operator registry is per process
def paged_decode_attention() -> Callable | None:
    """``torch.ops.leanserve.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens,
    scale)`` (CPU, float32 or bfloat16), or None where it cannot be built here."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s) found: decode attention runs as gathered keys + SDPA, "
                    "slower on the CPU (set CXX to a compiler to build leanserve's kernel)", compiler)
        return None
    try:
        torch.ops.load_library(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("leanserve's CPU decode attention kernel did not build (%s); decode attention "
                    "runs as gathered keys + SDPA", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    return torch.ops.leanserve.paged_decode_attention
