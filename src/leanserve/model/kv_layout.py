"""What a block of the paged KV cache holds, in what order, and the conversions that read it.

The cache is one tensor, ``[layers, 2 (keys, values), blocks, kv_heads, block_size, head_dim]``
(engine/kv_cache.py); a (layer, keys or values, block, KV head) is ``block_size * head_dim``
contiguous elements, ordered:

- values token-major, ``[block_size][head_dim]``: token t's row, as the shape says;
- keys dimension-major in groups of 32 bits, ``[head_dim / P][block_size][P]`` with ``P`` the
  elements in 32 bits (:func:`key_group`: 2 in bf16 and fp16, 1 in float32): group p of the
  block's tokens side by side, then group p + 1. The declared shape stays ``[block_size,
  head_dim]``; :func:`stored_keys` is the view of the order as it is.

Why keys so: decode attention (model/kernels/paged_decode_attention.cpp) scores 16 keys at once,
one per lane of a vector, so the 16 keys' group p must be one 64-byte load. With the keys token-
major it summed each key's products across lanes instead (shuffles, and bf16 dot products that
issue once every two cycles on the Xeon, against two float32 multiply-adds a cycle): one layer of
64 rows x 1,024 tokens of the default model, 2 threads, 1.79-1.84 -> 1.10-1.13 ms with its blocks
in L2, 3.57-3.84 -> 3.09-3.37 ms from memory (bench/results/decode_lanes.md; a prototype that
transposed each block's keys in registers as it read them, the order unchanged: 1.20 and 3.25
against 1.74 and 3.43). vLLM's CPU backend stores its keys transposed for the same reason. The
prefill kernel's AMX path packs keys into this order anyway (a tile product's right-hand side:
pairs of dimensions), now by copying runs of it.

Nothing else depends on the order: a block is still one contiguous run per (layer, keys or
values), so KV transfer (engine/kv_transfer) sends the bytes as they are (the workers compare
:data:`KEY_ORDER` first), and tensor parallelism's split by KV head is a split of whole runs.
"""

from __future__ import annotations

import torch

# How a block's keys lie, as workers that exchange blocks compare it (engine/kv_transfer's KVLayout):
# an engine with another order reads the same bytes as other keys.
KEY_ORDER = "[head_dim / P][block_size][P], P elements in 32 bits"


def key_group(dtype: torch.dtype) -> int:
    """Key elements kept together in the cache (``P`` above): as many as fill 32 bits."""
    return max(1, 4 // dtype.itemsize)


def stored_keys(k_cache: torch.Tensor) -> torch.Tensor:
    """Keys ``[..., block_size, head_dim]`` as the cache declares them -> a view of their order in
    memory, ``[..., head_dim / P, block_size, P]``."""
    *lead, block_size, head_dim = k_cache.shape
    p = key_group(k_cache.dtype)
    return k_cache.view(*lead, head_dim // p, block_size, p)


def keys_from_cache(k_cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The keys of whole blocks token-major, ``[..., block_size, head_dim]``: a copy, or into
    ``out`` (of that shape, contiguous)."""
    token_major = stored_keys(k_cache).transpose(-3, -2)  # [..., block_size, head_dim / P, P]
    if out is None:
        return token_major.reshape(k_cache.shape)
    out.view(token_major.shape).copy_(token_major)
    return out


def keys_to_cache(keys: torch.Tensor) -> torch.Tensor:
    """Token-major keys of whole blocks ``[..., block_size, head_dim]`` in the cache's order, the
    same shape (a copy): what :func:`keys_from_cache` reads back."""
    *lead, block_size, head_dim = keys.shape
    p = key_group(keys.dtype)
    return keys.reshape(*lead, block_size, head_dim // p, p).transpose(-3, -2).contiguous().view(keys.shape)
