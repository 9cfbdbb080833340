"""Attention over a paged KV cache for a flat batch that mixes decode tokens and prefill chunks.

The batch is laid out decode tokens first (one per sequence), then prefill chunks back to back.
The cache is block-major (``engine/kv_cache.py``); a layer's keys and values are views
[num_blocks, kv_heads, block_size, head_dim]. Decode rows are attended by
``model/decode_attention.py``, which reads the blocks in place; each prefill chunk is attended
on its own, with SDPA over its context's blocks gathered (a step holds few chunks: the token
budget bounds them).

Everything that depends only on the batch shape (masks, block ids, cache slots) is built once
per step in :class:`AttentionMetadata` and shared by all layers.

Shapes are kept to a bounded set where kernels are cached per shape. On the CPU, bf16/fp16
matmuls run through oneDNN, which JITs and keeps a kernel per problem shape (~0.2-0.6 MB each,
up to 1,024 in its primitive cache plus 1,024 in ideep's), and bf16/fp16 SDPA through brgemm
micro-kernels kept in a cache with no bound, keyed by query and key block sizes. With shapes
that follow the data (tokens per step, chunk and context lengths, one more key per decoded
token) a mixed workload kept creating kernels, and the churn of the full LRU caches kept
fragmenting the heap: the engine grew by 1.36 GB over 600 mixed requests here. So with
padding on (``pad_shapes`` given to :meth:`AttentionMetadata.build`; the model runner's
``pad_shapes``), prefill chunks attend a bucketed number of query rows (see :func:`bucket`)
and whole, bucketed key blocks. Compiled decode kernels take any number of rows and blocks;
eager decode attends whole blocks, in SDPA, whose kernels do not depend on the number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .decode_attention import DecodeAttention


def bucket(n: int, multiple: int = 1) -> int:
    """``n`` rounded up to one of a few sizes: multiples of ``multiple``, and at most 8 sizes
    per octave above 8 * ``multiple`` (so at most 12.5 % more than ``n``): 1..15, 16, 18, ..,
    30, 32, 36, .., 60, 64, 72, .. for ``multiple`` 1. Every distinct shape a step hands to the
    backend costs a cached kernel, for good: this keeps their number logarithmic in the size."""
    step = max(multiple, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in this step."""

    start: int  # first row of the chunk in the flat batch
    length: int  # tokens in the chunk
    context_len: int  # tokens in the cache after this step (prior context + chunk)
    block_ids: torch.Tensor | None  # blocks holding the context; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, kv_len] bool, None when plain causal over the chunk
    q_len: int = 0  # query rows attended (>= length: padded with the rows after the chunk)
    kv_len: int = 0  # keys attended: context_len, or whole blocks (padded ones masked)


@dataclass
class AttentionMetadata:
    block_size: int
    slot_block: torch.Tensor  # [T] long: cache block of each new token
    slot_offset: torch.Tensor  # [T] long: its slot in the block
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_block_ids: torch.Tensor | None  # [D, max_blocks] long
    decode_seq_lens: torch.Tensor | None  # [D] int32: context of each decode row, its new token included
    decode_attention: "DecodeAttention | None"
    prefills: list[PrefillChunk]

    @property
    def num_tokens(self) -> int:
        """Rows of the step that are tokens; the model's input may have padding rows after them."""
        return self.slot_block.shape[0]

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        block_size: int,
        prefills: list[tuple[int, int, int, torch.Tensor | None]],
        decode_block_ids: torch.Tensor | None = None,
        decode_seq_lens: torch.Tensor | None = None,
        decode_attention: "DecodeAttention | None" = None,
        pad_shapes: bool = False,
    ) -> "AttentionMetadata":
        """``slot_mapping`` [T]: cache slot (block * block_size + offset) of each new token;
        ``prefills`` holds (start, length, context_len, block_ids) per chunk; decode rows, if
        any, need all three ``decode_*``.

        ``pad_shapes``: each chunk attends ``bucket(length, 16)`` query rows, the chunk's and
        those after it in the flat batch (the caller provides them; their outputs are dropped),
        and a chunk with context attends every key of its ``block_ids`` (the caller may pad them
        with the null block), masked beyond its context."""
        device = slot_mapping.device
        num_decode = 0 if decode_block_ids is None else decode_block_ids.shape[0]
        chunks = []
        for start, length, context_len, block_ids in prefills:
            q_len = bucket(length, 16) if pad_shapes else length
            if context_len == length:
                chunks.append(PrefillChunk(start, length, context_len, None, None, q_len, q_len))
                continue
            kv_len = block_ids.shape[0] * block_size if pad_shapes else context_len
            q_pos = torch.arange(context_len - length, context_len - length + q_len, device=device)
            mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
            chunks.append(PrefillChunk(start, length, context_len, block_ids, mask, q_len, kv_len))
        return cls(block_size, slot_mapping // block_size, slot_mapping % block_size, num_decode,
                   decode_block_ids if num_decode else None, decode_seq_lens if num_decode else None,
                   decode_attention, chunks)


class DecodeMaskTable:
    """Additive attention masks for decode rows, by sequence length.

    Row L of the table is 0 for key positions < L and -inf after, so a step's mask is one row
    gather (``index_select``) instead of building a [rows, width] tensor from scratch in three
    full-size ops (~0.3 ms per step at 256 rows here). In the model's dtype, which SDPA wants
    on some backends (0 and -inf are exact in any float dtype; its softmax runs in float32).
    The table grows by doubling, up to ``max_width`` columns; wider steps build their mask
    directly.
    """

    def __init__(self, device, max_width: int = 2048, dtype: torch.dtype = torch.float32):
        self.device, self.max_width, self.dtype = device, max_width, dtype
        self.table = torch.empty(0, 0, device=device, dtype=dtype)

    def __call__(self, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
        if width > self.max_width:
            return self._build(seq_lens, width)
        if self.table.shape[1] < width:
            n = min(self.max_width, max(width, 2 * self.table.shape[1], 64))
            self.table = self._build(torch.arange(n + 1, device=self.device), n)
        return self.table[:, :width].index_select(0, seq_lens)

    def _build(self, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
        beyond = torch.arange(width, device=self.device)[None, :] >= seq_lens[:, None]
        return torch.zeros(beyond.shape, device=self.device, dtype=self.dtype).masked_fill_(beyond, float("-inf"))


def paged_attention(
    q: torch.Tensor,  # [T, H, Dh]
    k: torch.Tensor,  # [T, KVH, Dh]
    v: torch.Tensor,  # [T, KVH, Dh]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, Dh]: this layer's keys
    v_cache: torch.Tensor,  # [num_blocks, KVH, block_size, Dh]: and values
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's k/v into the cache, then attends every row to its context. Returns [T, H*Dh].

    Rows past ``meta.num_tokens`` are padding: not written to the cache, zero in the output."""
    n = meta.num_tokens
    padded = q.shape[0] != n
    k_cache[meta.slot_block, :, meta.slot_offset] = k[:n] if padded else k
    v_cache[meta.slot_block, :, meta.slot_offset] = v[:n] if padded else v
    d = meta.num_decode
    if not meta.prefills and not padded:  # a pure decode step: no output to assemble from parts
        return meta.decode_attention(q, k_cache, v_cache, meta.decode_block_ids, meta.decode_seq_lens,
                                     scale).flatten(1)
    out = torch.empty_like(q)
    if padded:
        out[n:] = 0
    gqa = q.shape[1] != k_cache.shape[1]
    if d:
        out[:d] = meta.decode_attention(q[:d], k_cache, v_cache, meta.decode_block_ids, meta.decode_seq_lens,
                                        scale)

    for c in meta.prefills:
        # 4-D [1, heads, len, Dh]: given 3-D tensors, CPU SDPA leaves its flash kernel for the math
        # path, ~6x slower at 2,048 tokens (270 vs 45 ms per layer here).
        rows = slice(c.start, c.start + (c.q_len or c.length))
        qc = q[rows].transpose(0, 1)[None]
        if c.block_ids is None:
            # Causal: the chunk's rows never see the padding rows after them.
            kc, vc = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kv_len = c.kv_len or c.context_len
            kc = _context(k_cache, c.block_ids)[:, :, :kv_len]
            vc = _context(v_cache, c.block_ids)[:, :, :kv_len]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale, enable_gqa=gqa)
        out[c.start : c.start + c.length] = o[0, :, : c.length].transpose(0, 1)
    return out.flatten(1)


def _context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, KVH, BS, Dh] at n block ids -> [1, KVH, n * BS, Dh], a copy."""
    return cache.index_select(0, block_ids).transpose(0, 1).flatten(1, 2)[None]
