"""Attention over a paged KV cache for a flat batch that mixes decode tokens and prefill chunks.

The batch is laid out decode tokens first (one per sequence), then prefill chunks back to back.
Decode rows are attended in one batched call over keys gathered block-wise from the cache;
each prefill chunk is attended on its own (a step holds few of them: the token budget bounds it).

Everything that depends only on the batch shape (masks, gathered block ids) is built once per
step in :class:`AttentionMetadata` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in this step."""

    start: int  # first row of the chunk in the flat batch
    length: int  # tokens in the chunk
    context_len: int  # tokens in the cache after this step (prior context + chunk)
    block_ids: torch.Tensor | None  # blocks holding the context; None when the chunk is the whole context
    mask: torch.Tensor | None  # [length, context_len] bool, None when plain causal over the chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_block_ids: torch.Tensor | None  # [D, max_blocks] long
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] additive float: 0 or -inf
    prefills: list[PrefillChunk]

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        decode_block_ids: torch.Tensor | None,
        decode_seq_lens: torch.Tensor | None,
        prefills: list[tuple[int, int, int, torch.Tensor | None]],
        block_size: int,
        mask_dtype: torch.dtype = torch.float32,
    ) -> "AttentionMetadata":
        """``prefills`` holds (start, length, context_len, block_ids) per chunk."""
        device = slot_mapping.device
        decode_mask = None
        num_decode = 0
        if decode_block_ids is not None and decode_block_ids.shape[0]:
            num_decode = decode_block_ids.shape[0]
            width = decode_block_ids.shape[1] * block_size
            beyond = torch.arange(width, device=device) >= decode_seq_lens[:, None]
            # Additive float mask, built once per step for all layers: SDPA runs ~15% faster on
            # it than on a bool mask, which it would convert in every layer.
            decode_mask = torch.zeros(beyond.shape, dtype=mask_dtype, device=device).masked_fill_(
                beyond, float("-inf"))[:, None, None, :]
        chunks = []
        for start, length, context_len, block_ids in prefills:
            if context_len == length:
                chunks.append(PrefillChunk(start, length, context_len, None, None))
                continue
            q_pos = torch.arange(context_len - length, context_len, device=device)
            mask = torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]
            chunks.append(PrefillChunk(start, length, context_len, block_ids, mask))
        return cls(slot_mapping, num_decode, decode_block_ids, decode_mask, chunks)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's k/v into the cache, then attends every row to its context. Returns [T, H*D]."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != kv_heads

    d = meta.num_decode
    if d:
        # Gather whole blocks: [D, max_blocks, block_size, KVH, Dh] -> [D, KVH, L, Dh].
        # index_select copies block rows with memcpy; advanced indexing (k_cache[ids]) goes
        # element by element and is ~3x slower: this gather is the decode step's largest cost.
        keys = _gather(k_cache, meta.decode_block_ids).transpose(1, 2)
        values = _gather(v_cache, meta.decode_block_ids).transpose(1, 2)
        out[:d] = F.scaled_dot_product_attention(
            q[:d, :, None, :], keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        ).squeeze(2)

    for c in meta.prefills:
        rows = slice(c.start, c.start + c.length)
        qc = q[rows].transpose(0, 1)
        if c.block_ids is None:
            kc, vc = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kc = _gather(k_cache, c.block_ids[None])[0, : c.context_len].transpose(0, 1)
            vc = _gather(v_cache, c.block_ids[None])[0, : c.context_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale, enable_gqa=gqa)
        out[rows] = o.transpose(0, 1)
    return out.flatten(1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, KVH, D] at [S, n] block ids -> [S, n * block_size, KVH, D]."""
    s, n = block_ids.shape
    return cache.index_select(0, block_ids.reshape(-1)).view(s, n * cache.shape[1], *cache.shape[2:])
