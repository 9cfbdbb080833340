"""Kernels leanserve compiles on the machine it runs on, for what PyTorch does not ship.

Four libraries today, each with its reasons in its header: attention over the paged KV cache
on the CPU, for decode rows (``paged_decode_attention.cpp``, which also writes a step's keys and
values into the cache: the layout's writer beside its reader) and for prefill chunks
(``paged_prefill_attention.cpp``), the elementwise work between a decoder layer's GEMMs
(``layer_ops.cpp``: RMS norm with the residual add, the rotary embedding, SiLU-and-multiply),
and, on CPUs with AVX512-BF16, the bf16 linear layers themselves (``brgemm_linear.cpp``).
Each is built the first time a process asks for it, with the machine's C++ compiler (``$CXX``,
else ``c++``) against the installed torch, for this CPU's instruction set (``-march=native``),
and kept in a cache directory (``$LEANSERVE_KERNEL_CACHE``, else ``~/.cache/leanserve/kernels``)
under a name that hashes everything the build depends on, so a second start loads it in
milliseconds and a torch upgrade or another CPU builds anew (~7-10 s each on 2 cores; the model
runner builds the ones it needs side by side, :func:`build_together`). Without a compiler (one
log line for all), or if a build fails (one for that library), its loader returns None: the
model then runs those parts as PyTorch ops (SDPA for attention), the path every other device
takes.

The .so files link the libgomp torch loaded (``-fopenmp``, torch's lib directory as their rpath),
so their OpenMP threads are torch's own pool, not a second one competing for the cores.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
DTYPES = (torch.float32, torch.bfloat16)  # what every kernel here takes (common.h's for_dtype)
HEADERS = ("common.h", "amx.h")  # included by the sources: part of every build's hash
# -f flags: let the compiler reorder float sums (vectorised reductions) without assuming finite
# values: attention's running max starts at -inf. Reordering also folds exp_nonpositive's
# two-part ln 2 into one constant (common.h says what that costs).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-fno-math-errno",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
# Each library's own flags on top (part of its build's hash): the layer ops round every product
# as torch's ops do, not fused into an FMA with the sum after it (see layer_ops.cpp), and on x86
# their loops, which GCC vectorises itself, take AVX-512's 16 lanes where the CPU has them (GCC
# prefers 8 on every CPU it tunes for today): on the 2-core Xeon SiLU-and-multiply at 64 / 192
# rows 59 / 181 -> 40 / 112 us, the norm with the residual 17 / 48 -> 12 / 28, rotary 45 / 120 ->
# 36 / 102; served 1.04-1.06x (bench/results/kv_write_serve.md). The prefill kernel's sums keep
# the source's order, which its chunking invariance rests on.
_X86 = platform.machine().lower() in ("x86_64", "amd64")
LIBRARY_FLAGS = {"paged_decode_attention": (), "paged_prefill_attention": ("-fno-associative-math",),
                 "layer_ops": ("-ffp-contract=off",) + (("-mprefer-vector-width=512",) if _X86 else ()),
                 "brgemm_linear": ()}


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags, where Linux says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(next((ln for ln in lines if ln.startswith(key)), "") for key in ("model name", "flags"))


def _compile(compiler: str, name: str, target: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    include = torch_dir / "include"
    cmd = [compiler, *FLAGS, *LIBRARY_FLAGS[name], f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{include}", f"-I{include / 'torch/csrc/api/include'}", str(HERE / f"{name}.cpp"), "-o", str(target),
           f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        log.debug("%s failed:\n%s", " ".join(cmd), result.stderr)
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        raise RuntimeError(errors[0] if errors else f"{compiler} exited with status {result.returncode}")


def _build(compiler: str, name: str) -> Path:
    """``name``.cpp's shared library, compiled unless the cache has this exact build."""
    source = HERE / f"{name}.cpp"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text(), *((HERE / h).read_text() for h in HEADERS)]
    key = hashlib.sha256("\n".join([*texts, *FLAGS, *LIBRARY_FLAGS[name], torch.__version__, version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LEANSERVE_KERNEL_CACHE") or Path.home() / ".cache/leanserve/kernels")
    target = cache / f"{name}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: processes starting together (data-
        # parallel engines, tensor-parallel ranks) each build, and none loads a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            _compile(compiler, name, Path(tmp))
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


@functools.cache  # one log line per process, not one per library
def _compiler(name: str) -> str | None:
    if shutil.which(name) is None:
        log.warning("no C++ compiler (%s) found: leanserve's CPU kernels (attention; norms, rotary and "
                    "SiLU) are not built and PyTorch ops run instead, slower on the CPU (set CXX to a "
                    "compiler to build them)", name)
        return None
    return name


def _load(name: str, what: str, instead: str) -> bool:
    """Builds (or finds in the cache) and loads ``name``.cpp into torch's operator registry;
    False where it cannot: no compiler (said once for all libraries) or a failed build (said
    once for this one, with what runs ``instead``)."""
    compiler = _compiler(os.environ.get("CXX") or "c++")
    if compiler is None:
        return False
    try:
        torch.ops.load_library(str(_build(compiler, name)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if e.__cause__ is not None:  # torch's "Could not load this library" wraps the loader's own reason
            why += f": {e.__cause__}"
        log.warning("leanserve's CPU kernels for %s did not build (%s); %s instead", what, why, instead)
        return False
    return True


# Cached: a process loads each library once (torch's operator registry is per process).
@functools.cache
def paged_decode_attention() -> Callable | None:
    """``torch.ops.leanserve.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens,
    scale)`` (CPU, float32 or bfloat16), or None where it cannot be built here."""
    if not _load("paged_decode_attention", "decode attention", "gathered keys + SDPA"):
        return None
    return torch.ops.leanserve.paged_decode_attention


def write_kv() -> Callable | None:
    """``torch.ops.leanserve.write_kv(k, v, k_cache, v_cache, slots)``: a step's new keys and
    values into their cache slots, both in one call (CPU, float32 or bfloat16; it lives beside
    decode attention, the reader of the layout it writes), or None where it cannot be built here."""
    return None if paged_decode_attention() is None else torch.ops.leanserve.write_kv


@functools.cache
def paged_prefill_attention() -> Callable | None:
    """``torch.ops.leanserve.paged_prefill_attention(q, k_cache, v_cache, block_ids, context_len,
    scale)`` (CPU, float32 or bfloat16), or None where it cannot be built here."""
    if not _load("paged_prefill_attention", "prefill attention", "gathered keys + SDPA"):
        return None
    return torch.ops.leanserve.paged_prefill_attention


@functools.cache
def layer_ops() -> object | None:
    """The ``torch.ops.leanserve`` namespace with ``rms_norm``, ``add_rms_norm``, ``rotary_`` and
    ``silu_and_mul`` (CPU, float32 or bfloat16; see :mod:`leanserve.model.layer_ops`), or None
    where they cannot be built here."""
    if not _load("layer_ops", "norms, rotary and SiLU", "PyTorch ops"):
        return None
    return torch.ops.leanserve


@functools.cache
def brgemm_linear() -> Callable | None:
    """``torch.ops.leanserve.brgemm_linear(x, weight, bias, out_features, codes=None, scales=None)``
    (bf16 linear layers over weights packed for oneDNN's brgemm micro-kernel, one row optionally
    from the GGUF file's Q4 or Q8_0 blocks, :mod:`leanserve.model.prepack`), or None where
    it cannot be built here. Only for CPUs with AVX512-BF16."""
    if not _load("brgemm_linear", "bf16 linear layers", "oneDNN's packed weights"):
        return None
    return torch.ops.leanserve.brgemm_linear


def build_together(names: tuple[str, ...]) -> None:
    """Builds the named libraries (keys of ``LIBRARY_FLAGS``) that are not in the cache yet, each
    compiler its own process, so the loaders then find them built: on a first start the
    attention and layer-op libraries (three) took 14 s here against 25 s one after another (2
    cores). Only the builds run side by side:
    each loader loads its library in the caller's thread (``torch.ops.load_library`` sets the
    process's dlopen flags and puts them back, which threads at once could leave changed). A
    build that fails here is tried again by its loader, which says why."""
    compiler = _compiler(os.environ.get("CXX") or "c++")  # no compiler: said once, here
    if compiler is None or len(names) < 2:
        return

    def build(name: str) -> None:
        try:
            _build(compiler, name)
        except (OSError, RuntimeError, subprocess.CalledProcessError):
            pass

    with ThreadPoolExecutor(len(names)) as pool:
        for _ in pool.map(build, names):
            pass
