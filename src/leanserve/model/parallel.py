"""Tensor parallelism as the model sees it: which share of each weight this rank holds, and the
two collectives its forward needs.

The split is Megatron's. q/k/v and gate/up are column-parallel (a rank holds the rows of its
attention heads, KV heads and MLP columns); o and down are row-parallel (the matching input
columns), so each attention block and each MLP ends in one all-reduce of [tokens, hidden].
Embedding and output head are vocabulary-parallel: a rank holds ``ceil(vocab / size)`` rows
(the last rank's tail zero-padded); its embedding rows cover only its ids, so the lookup is
summed with one more all-reduce, and its head computes its vocabulary slice of the logits,
gathered on rank 0, the only rank that samples. Replicating them instead would save that
all-reduce (one per step, not per layer) but cost every rank the whole table, 2 GB of bf16
for a 128k x 8,192 vocabulary, and leave rank 0 computing the whole head alone: ~21 % of the
default model's FLOPs (bench/results/tp.md).

:class:`TensorParallel` itself is one rank alone: shares are whole and the collectives return
their input. ``engine/distributed`` subclasses it over a torch.distributed process group.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class TensorParallel:
    """This process's rank among ``size`` ranks that hold one model between them."""

    rank: int = 0
    size: int = 1

    def share(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of ``n`` rows or columns split evenly (``n % size == 0``)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_share(self, vocab_size: int) -> tuple[int, int]:
        """This rank's [start, end) of the vocabulary; every rank holds ``vocab_rows`` rows, the
        last one's past ``end`` being zero padding."""
        start = self.rank * self.vocab_rows(vocab_size)
        return start, min(vocab_size, start + self.vocab_rows(vocab_size))

    def vocab_rows(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place)."""
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [rows, vocab_rows] logits side by side, [rows, size * vocab_rows], on rank 0;
        None on the others."""
        return logits


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError naming the flag when the model cannot be split ``size`` ways."""
    flag = "tensor_parallel_size (--tensor-parallel-size)"
    if size < 1:
        raise ValueError(f"{flag}: must be >= 1, got {size}")
    if cfg.num_kv_heads < size:
        raise ValueError(f"{flag}: {size} ranks for the model's {cfg.num_kv_heads} KV heads; each rank needs at "
                         f"least one (replicating KV heads is not supported)")
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP columns (intermediate_size)", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"{flag}: {size} does not divide the model's {n} {what}")


def embed(ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embedding lookup with this rank's vocabulary rows, summed over ranks: ids outside the
    rank's share contribute zeros there."""
    if tp.size == 1:
        return torch.nn.functional.embedding(ids, weight)
    start = tp.rank * weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    x = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return tp.all_reduce(x.masked_fill_(outside[:, None], 0))
