"""Engine configuration (names follow ``vllm serve``'s flags)."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from ..model.config import ModelConfig
from ..model.loader import ModelSpec, read_model_config
from ..model.parallel import check_tensor_parallel
from ..model.prepack import has_amx
from .batch_state import blocks_needed
from .kv_cache import KVCache
from .kv_transfer.config import KVTransferConfig

log = logging.getLogger("leanserve.engine")

BACKENDS = ("mp", "ray")
# How attention runs (engine/model_runner.attention_kernels): auto, leanserve's CPU kernels for
# decode rows and prefill chunks, reading blocks in place, where each applies and builds, else
# SDPA (over gathered keys); or either for everything.
ATTENTION_BACKENDS = ("auto", "cpu-paged", "sdpa")
BACKEND_FLAG = "distributed_executor_backend (--distributed-executor-backend)"

# The prefill chunk a CPU step carries beside its decode rows when --max-num-batched-tokens is not
# given. A CPU step's time grows with its tokens, so a chunk holds every decode row beside it for
# as long as it takes, while a chunk's own rate stops growing at some size, which depends on the
# GEMMs: the largest chunk is chosen that keeps a 64-row decode step's inter-token latency p99
# within 3x its p50 served at concurrency 64 (128 prompts of 128 and of 1,024 tokens) with a
# margin, and buys output tok/s.
# - Without AMX (the 2-core AMD EPYC, AVX512-BF16: chunk_budget_epyc.md) a chunk's rate is level
#   from 192 tokens (a 128-token chunk ~9 % below), and 128 keeps the ratio at 2.34 at 128-token
#   prompts, 2.12 at 1,024 (a 256-token chunk gave 3.78 and 2.15, 192 gave 2.94), for output tok/s
#   within the runs' noise and a first token later at p50 (1.6 -> 2.2 s, 49 -> 53 s).
# - Where bf16 linear layers run in AMX's tiles (the 2-core Xeon: xeon/chunk_budget.md), GEMMs
#   at 192 rows run at ~1.45 TFLOP/s and at 512 at ~1.7 (the weights' read from memory, ~5 ms a
#   step, is spread over more rows), and a larger chunk pays served (2 interleaved rounds): a
#   320-token chunk 1.08-1.12x output tok/s of a 128-token one (128-token prompts 775 -> 791-837,
#   1,024-token 194-198 -> 215-221) at a ratio of 2.50 and 1.48; a 448-token chunk buys no more
#   (828, 223) at 2.85 at 128-token prompts, a 704-token one 3.8. The decode rows pay for it at
#   1,024-token prompts (ITL p50 100 -> 176 ms), the prompts gain (TTFT p50 27.5 -> 13.1 s).
CPU_PREFILL_CHUNK = 128
AMX_PREFILL_CHUNK = 320
# The tokens of a step with no decode row in it (--max-prefill-tokens, SGLang's name): the chunk
# budget above protects running requests' inter-token latency, and a step where nothing decodes
# has none to protect, so there a prompt is computed in fewer, larger chunks, which a CPU computes
# faster per token (a 1,024-token chunk 0.24 ms a token on the 2-core Xeon with AMX, in three
# steps of 316-354 tokens 0.30). What arrives during such a step waits for it (~0.55 s there).
# Served (bench/results/xeon/prefill_budget.md): a lone 1,024-token prompt's first token 0.36 ->
# 0.32 s at p50, output tok/s 1.03x; 1.07x at 64 x 128, where a wave's first step admits 16
# prompts instead of 3. 2,048: vLLM's CPU step budget.
CPU_PREFILL_TOKENS = 2048
# A GPU step costs about the same up to thousands of tokens: vLLM's API-server default there.
ACCELERATOR_BATCHED_TOKENS = 2048


# A CPU step's decode attention walks each row's blocks, a run of each KV head's rows a block: 32
# tokens make the runs 4 KB (the default model in bf16) and halve the walk's block boundaries and
# prefetches. Served against 16 (3 interleaved rounds a machine, output tok/s): on the 2-core AMD
# EPYC 1.07x at 64 x 1,024, 1.04x at 64 x 128, 1.02x at 16 x 1,024, level at one request
# (bench/results/kv_layout.md); on the 2-core Xeon with AMX 1.04x at one 128-token request, level
# (1.00x, 0.997x) at 64 x 128 and 64 x 1,024 (kv_write_serve.md). 64 and 128 were no faster a
# layer. What it costs: a prefix cache hit matches whole blocks (up to 31 tokens recomputed
# instead of 15), a request's last block wastes up to 31 slots, and where decode rows go to SDPA
# instead (--attention-backend sdpa, float16) each is padded to whole blocks, up to 31 keys
# (not measured with 32). A GPU keeps vLLM's 16 there (measured on neither). A prefill and a
# decode worker must agree on it: a CPU and a GPU worker pass the same --block-size.
CPU_BLOCK_SIZE = 32
ACCELERATOR_BLOCK_SIZE = 16


def default_block_size(device: str) -> int:
    """Tokens a KV block holds unless set: 32 on a CPU, 16 elsewhere."""
    return CPU_BLOCK_SIZE if device.startswith("cpu") else ACCELERATOR_BLOCK_SIZE


def default_max_num_batched_tokens(device: str, max_num_seqs: int, amx_linear_layers: bool = False) -> int:
    """The token budget of a step unless set: on a CPU every running request's decode row plus
    one chunk (CPU_PREFILL_CHUNK, or AMX_PREFILL_CHUNK where the linear layers run in AMX's
    tiles: 192 or 384 at the default 64 sequences), so neither starves the other; elsewhere 2048,
    or ``max_num_seqs`` where that is more."""
    if device.startswith("cpu"):
        return max_num_seqs + (AMX_PREFILL_CHUNK if amx_linear_layers else CPU_PREFILL_CHUNK)
    return max(ACCELERATOR_BATCHED_TOKENS, max_num_seqs)


def default_max_prefill_tokens(device: str, max_num_batched_tokens: int) -> int:
    """The tokens of a step with no decode row unless set: CPU_PREFILL_TOKENS on a CPU (or the
    step budget where that is more), elsewhere the step budget."""
    return max(CPU_PREFILL_TOKENS, max_num_batched_tokens) if device.startswith("cpu") else max_num_batched_tokens


def runs_linear_layers_on_amx(device: str, dtype: str, quantization: str) -> bool:
    """Whether a step's linear layers will run in AMX's tiles: bf16 weights (int8 and int4 have
    kernels of their own, without AMX) on a CPU whose AMX torch's oneDNN may use."""
    bf16 = dtype in ("auto", "bfloat16", "bf16", torch.bfloat16)  # auto is bf16 on every CPU with AMX
    return device.startswith("cpu") and quantization == "none" and bf16 and has_amx()


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or HF directory; None = the default SmolLM2 package
    dtype: str = "auto"  # bfloat16 where the hardware has it, else float32
    device: str = "cpu"
    quantization: str = "none"  # "int8": int8 linear weights (model/quant.py)
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: default_max_num_batched_tokens(device, max_num_seqs)
    # Tokens of a step in which no request decodes; None: max_num_batched_tokens where that is
    # given, else default_max_prefill_tokens(device, ...)
    max_prefill_tokens: int | None = None
    block_size: int | None = None  # None: default_block_size(device)
    kv_cache_memory: int | None = None  # bytes; None: kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.1
    enable_prefix_caching: bool = True
    # New requests taken from the inbox per iteration: bounds the loop's work under a burst.
    max_new_requests_per_step: int = 64
    max_logprobs: int = 20
    seed: int | None = None
    stats_capacity: int = 4096
    threads: int | None = None  # torch intra-op threads; None: torch's default
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    kv_transfer: KVTransferConfig | None = None  # disaggregated serving; None: this engine moves no KV
    # Ranks that hold one model between them (engine/distributed): processes of this machine
    # ("mp") or Ray actors placed on the Ray cluster this machine belongs to ("ray").
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self):
        if self.block_size is None:
            self.block_size = default_block_size(self.device)
        budget_given = self.max_num_batched_tokens is not None
        if not budget_given:
            self.max_num_batched_tokens = default_max_num_batched_tokens(
                self.device, self.max_num_seqs, runs_linear_layers_on_amx(self.device, self.dtype, self.quantization))
        if self.max_prefill_tokens is None:
            # A step budget given alone bounds every step, as it did before this one existed.
            self.max_prefill_tokens = self.max_num_batched_tokens if budget_given else \
                default_max_prefill_tokens(self.device, self.max_num_batched_tokens)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_new_requests_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens < self.max_num_batched_tokens:
            raise ValueError(f"max_prefill_tokens (--max-prefill-tokens): must be >= max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}), got {self.max_prefill_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend (--attention-backend): {self.attention_backend!r}; choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.attention_backend == "cpu-paged" and not self.device.startswith("cpu"):
            raise ValueError(f"attention_backend (--attention-backend): cpu-paged runs on the CPU, not {self.device}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be >= 0, got {self.max_logprobs}")
        if not 0 < self.kv_cache_fraction <= 0.9:
            raise ValueError(f"kv_cache_fraction: must be in (0, 0.9], got {self.kv_cache_fraction}")
        if self.kv_transfer is not None:
            self.kv_transfer.validate()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size (--tensor-parallel-size): must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.distributed_executor_backend not in BACKENDS:
            raise ValueError(f"{BACKEND_FLAG}: {self.distributed_executor_backend!r}; choose one of "
                             f"{', '.join(BACKENDS)}")
        if self.tensor_parallel_size > 1:
            self.check_ray_placement()
        if self.kv_transfer is not None and self.tensor_parallel_size > 1:
            # Each rank holds its KV heads' slice of every block; the connector moves rank 0's.
            raise ValueError("kv_transfer (--kv-transfer-config): not supported with --tensor-parallel-size > 1 "
                             "yet (each rank holds a slice of the KV cache; only one rank's would move)")

    def check_ray_placement(self) -> None:
        """Ray is to place something (tensor-parallel ranks, data-parallel engines) if the backend
        is ray: it must be installed, and the devices CPUs."""
        if self.distributed_executor_backend != "ray":
            return
        if not self.device.startswith("cpu"):
            raise ValueError(f"{BACKEND_FLAG}: ray places CPU ranks and engines only so far (a GPU is not tied "
                             f"to its Ray bundle yet); use mp on one {self.device} machine")
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"{BACKEND_FLAG}: ray is not installed: pip install 'leanserve[ray]'")

    def resolve(self) -> ResolvedConfig:
        """Checks every flag and resolves the model's, once; raises ValueError naming the flag."""
        self.validate()
        spec = ModelSpec.resolve(self.model, self.dtype, self.device, self.quantization)
        if self.tensor_parallel_size > 1:
            check_tensor_parallel(read_model_config(spec), self.tensor_parallel_size)
        return ResolvedConfig(self, spec)


@dataclass(frozen=True)
class ResolvedConfig:
    """What an engine is built from: the flags, checked, and the model they name, resolved
    (:class:`ModelSpec`). Made once where the flags are parsed and sent as is to the engine
    process, which builds model, KV cache, batch and scheduler from it, top to bottom; nothing
    downstream re-reads ``model``, ``dtype`` or ``quantization`` from the flags."""

    engine: EngineConfig
    model: ModelSpec


def plan_kv_cache(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """KV blocks to allocate and the max_model_len they allow: ``kv_cache_memory`` bytes, or a
    fraction of free memory capped at what ``max_num_seqs`` full-length requests can use. A
    request must fit the whole pool, or it would wait for blocks forever: an explicit
    max_model_len that does not is an error, the model's own is lowered with a warning."""
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    bs = config.block_size
    per_block = KVCache.bytes_per_block(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                        bs, dtype)
    if config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // per_block
    else:
        # Tensor-parallel ranks share one machine's memory on the CPU, but each has its own GPU.
        devices = config.tensor_parallel_size if config.device.startswith("cuda") else 1
        budget = int(config.kv_cache_fraction * available_memory_bytes(config.device)) * devices
        num_blocks = min(budget // per_block, config.max_num_seqs * blocks_needed(max_model_len, bs) + 1)
    capacity = (int(num_blocks) - 1) * bs  # block 0 is the null block
    if max_model_len > capacity:
        if config.max_model_len is not None:
            raise ValueError(f"max_model_len: {max_model_len} tokens do not fit in the KV cache, which holds "
                             f"{max(capacity, 0)}; raise kv_cache_memory or lower max_model_len")
        log.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more", max_model_len, capacity)
        max_model_len = capacity
    return int(num_blocks), max_model_len


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
