"""Token bitmasks: filled for all constrained rows of a step in one call, applied to the logits
in one vectorised op.

A bitmask row is ceil(vocab / 32) int32 words, bit t set = token t allowed (llguidance's
layout). Applying it is branch-free: each mask byte indexes a [256, 8] table of 0 / -inf and
the gathered bias is added to the constrained rows. Measured for 64 rows of 49,152 here
(``bench/results/structured.md``): a masked_fill with the unpacked bits took 20-35 ms (random
bit patterns defeat branch prediction), the table 1.7 ms. Its buffers are kept between steps:
allocating the 12 MB bias afresh each step cost ~10 ms more in page faults on this VM.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from . import backend


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry [b, j] is 0 if bit j of byte b is set, else -inf."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(device=device, dtype=dtype)


class GrammarBitmask:
    """The step's bitmask buffer (a row per batch slot at most), the call that fills it and the
    op that applies it.

    With ``overlap`` the fill runs on its own thread while the forward does (``start_fill``
    before the model call, ``result()`` before sampling): the next token's mask depends only on
    tokens already sampled. That pays where the forward leaves a core free (an accelerator, or
    fewer torch threads than cores: 64 rows' masks took ~5 ms here); where torch's threads hold
    every core, the fill would only contend with them, so it runs after the forward.
    """

    def __init__(self, max_rows: int, vocab_size: int, threads: int, overlap: bool = False):
        self.mask = np.full((max_rows, bitmask_width(vocab_size)), -1, np.int32)
        self._filler = backend.BitmaskFiller(threads)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="leanserve-bitmask") if overlap else None
        # On the logits' device, in their dtype; grown to the most constrained rows seen.
        self._table: torch.Tensor | None = None
        self._bias = torch.empty(0)

    @classmethod
    def for_device(cls, device, max_rows: int, vocab_size: int, cores: int | None = None) -> GrammarBitmask:
        """Overlapped where the forward leaves cores free, with as many fill threads as it leaves
        (all of them when the forward runs on an accelerator). ``cores``: the engine's share
        (``--data-parallel-size`` splits them); default all of the machine's."""
        cores, torch_threads = cores or os.cpu_count() or 1, torch.get_num_threads()
        if torch.device(device).type != "cpu":
            return cls(max_rows, vocab_size, cores, overlap=True)
        free = cores - torch_threads
        return cls(max_rows, vocab_size, free if free > 0 else torch_threads, overlap=free > 0)

    def fill(self, matchers: list) -> np.ndarray:
        """Row i: what matcher i allows next. A view of the buffer, valid until the next call."""
        out = self.mask[: len(matchers)]
        self._filler.fill(matchers, out)
        return out

    def start_fill(self, matchers: list) -> Callable[[], np.ndarray]:
        """Starts ``fill`` on the overlap thread (without one, it runs when asked); returns what
        gives its result."""
        if self._worker is None:
            return lambda: self.fill(matchers)
        return self._worker.submit(self.fill, matchers).result

    def apply(self, logits: torch.Tensor, rows: np.ndarray, mask: np.ndarray) -> None:
        """In place: the tokens ``mask[i]`` disallows become -inf in ``logits[rows[i]]``."""
        bias = self._bias_buffer(mask.shape[0] * mask.shape[1] * 32, logits)
        # numpy on the CPU: single-threaded, 1.7 ms for 64 rows; torch's two-thread kernels took
        # 13-23 ms while other processes held the cores (each op waits for its slowest thread).
        (apply_numpy if logits.device.type == "cpu" else apply_torch)(logits, rows, mask, self._table, bias)

    def _bias_buffer(self, size: int, logits: torch.Tensor) -> torch.Tensor:
        if self._table is None or self._table.dtype != logits.dtype or self._table.device != logits.device:
            self._table = bias_table(logits.device, logits.dtype)
            self._bias = torch.empty(0, dtype=logits.dtype, device=logits.device)
        if len(self._bias) < size:
            self._bias = torch.empty(max(size, 2 * len(self._bias)), dtype=logits.dtype, device=logits.device)
        return self._bias[:size]


def apply_numpy(logits: torch.Tensor, rows: np.ndarray, mask: np.ndarray, table: torch.Tensor,
                bias: torch.Tensor) -> None:
    """``apply`` for logits on the CPU; ``bias``: a buffer of at least ``mask.size * 32``."""
    k, width = mask.shape
    b = bias.numpy()[: k * width * 32].reshape(k, width * 4, 8)
    # Byte j of a row (little-endian words) holds tokens 8j .. 8j + 7; mode="clip": "raise" buffers
    # the output, 2x slower.
    np.take(table.numpy(), mask.view(np.uint8), axis=0, out=b, mode="clip")
    out, b = logits.numpy(), b.reshape(k, -1)[:, : logits.shape[1]]
    if k == len(out):  # every sampling row is constrained
        np.add(out, b, out=out)
    else:
        out[rows] += b


def apply_torch(logits: torch.Tensor, rows: np.ndarray, mask: np.ndarray, table: torch.Tensor,
                bias: torch.Tensor) -> None:
    """``apply`` on any device."""
    k, width = mask.shape
    index = torch.from_numpy(mask).view(torch.uint8).to(logits.device, non_blocking=True).reshape(-1).int()
    b = bias[: k * width * 32]
    torch.index_select(table, 0, index, out=b.view(-1, 8))
    b = b.view(k, -1)[:, : logits.shape[1]]
    if k == len(logits):
        logits.add_(b)
    else:
        logits.index_add_(0, torch.from_numpy(rows).to(logits.device), b)
