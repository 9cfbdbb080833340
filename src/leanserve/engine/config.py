"""Engine configuration (names follow ``vllm serve``'s flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..model.loader import parse_dtype
from ..model.quant import check_quantization


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or HF directory; None = the default SmolLM2 package
    dtype: str = "auto"  # bfloat16 where the hardware has it, else float32
    device: str = "cpu"
    quantization: str = "none"  # "int8": int8 weight copies for steps of a few rows (model/quant.py)
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.1
    enable_prefix_caching: bool = True
    # New requests taken from the inbox per iteration: bounds the loop's work under a burst.
    max_new_requests_per_step: int = 64
    max_logprobs: int = 20
    seed: int | None = None
    stats_capacity: int = 4096
    threads: int | None = None  # torch intra-op threads; None: torch's default

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_new_requests_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.kv_cache_fraction <= 0.9:
            raise ValueError(f"kv_cache_fraction: must be in (0, 0.9], got {self.kv_cache_fraction}")
        check_quantization(self.quantization, parse_dtype(self.dtype, self.device))


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

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
