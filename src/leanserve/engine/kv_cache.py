"""The paged KV cache: a pool of fixed-size blocks with reference counts and prefix caching.

* Free blocks sit in one intrusive doubly linked list in LRU order (least recently freed at the
  head). Allocation pops the head; a prefix hit on a free-but-cached block unlinks it from the
  middle: both O(1), no allocation per operation.
* A full block is keyed by a chained hash: blake2b(parent key + the block's token ids). Keys are
  computed once per block, when the block becomes full (or lazily during a prefix lookup, which
  stops at the first miss), so hashing work per iteration is bounded by the token budget.
* A freed block keeps its key and contents until it is reallocated, so a later request with the
  same prefix can still hit it: eviction is simply "reuse the LRU free block".

Block 0 is reserved as the null block: padding in block tables points at it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


class Block:
    __slots__ = ("block_id", "ref_count", "key", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.key: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory: room for {num_blocks} KV blocks; at least 2 are needed")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[bytes, Block] = {}
        # Sentinel-headed circular list of free blocks; block 0 (null) never enters it.
        self._head = Block(-1)
        self._head.prev = self._head.next = self._head
        self.num_free = 0
        for b in self.blocks[1:]:
            self._push_tail(b)

    # ---- free list
    def _push_tail(self, b: Block) -> None:
        tail = self._head.prev
        b.prev, b.next = tail, self._head
        tail.next = self._head.prev = b
        self.num_free += 1

    def _unlink(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    # ---- allocation
    def allocate(self, n: int) -> list[int]:
        """n blocks from the LRU end; cached contents of reused blocks are evicted."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with {self.num_free} free blocks")
        out = []
        for _ in range(n):
            b = self._head.next
            self._unlink(b)
            if b.key is not None:
                del self.cached[b.key]
                b.key = None
            b.ref_count = 1
            out.append(b.block_id)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Freed in reverse, so a request's tail blocks are
        evicted before its prefix, which other requests are likelier to share."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                self._push_tail(b)

    def share(self, block_ids: list[int]) -> None:
        """One more reference to each block (n > 1 samples, prefix hits)."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_count == 0:
                self._unlink(b)
            b.ref_count += 1

    # ---- prefix cache
    def lookup(self, key: bytes) -> int | None:
        b = self.cached.get(key)
        return None if b is None else b.block_id

    def register(self, block_id: int, key: bytes) -> None:
        # Always registered (a dict insert): n > 1 siblings share through it even when prefix
        # caching is off for unrelated requests; the scheduler decides who may look up.
        if key in self.cached:
            return
        b = self.blocks[block_id]
        b.key = key
        self.cached[key] = b

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free


def block_key(parent: bytes, tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()


class KVCache:
    """The cache tensor plus its block pool; one tensor for all layers:
    [layers, 2 (k, v), num_blocks, kv_heads, block_size, head_dim].

    What a block holds: for every layer, its ``block_size`` tokens' keys and values,
    [kv_heads, block_size, head_dim] each: KV head by KV head, each head's keys (and values) of the
    block together (vLLM's CPU backend orders its blocks so too); values token-major, keys
    dimension-major in groups of 32 bits (``model/kv_layout.py`` says exactly how, and why).
    Decode attention walks one KV head through a context's blocks, so it reads runs of
    ``block_size`` tokens (the default model in bf16: 2 KB with 16-token blocks, 4 KB with the CPU
    default of 32) rather than 128-byte rows 384 bytes apart: one layer of 64 rows x 1,024 tokens
    3.5 -> 2.4 ms with 16-token blocks, with the kernel's prefetch (AMD EPYC, 2 threads,
    bench/results/kv_layout.md). In memory, one layer's keys (or values) of
    every block are one contiguous pool (``tensor[layer, k/v]``), which attention reads a row's
    blocks from, and a run of consecutive blocks is, for each layer's keys and values, one
    contiguous piece (``spans``); a rank of tensor parallelism holds its own heads' cache."""

    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tensor = torch.zeros(num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                                  device=device)

    @staticmethod
    def bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def spans(self) -> torch.Tensor:
        """The cache's memory as raw bytes, [layers * 2, num_blocks, span_bytes] (a view, no copy):
        row ``2 * layer + kv`` holds that layer's keys (kv = 0) or values (kv = 1), and
        ``spans()[r, b]`` is block b's [kv_heads, block_size, head_dim] of them. Blocks ``a`` to
        ``b`` of one row are one contiguous piece of memory, ``spans()[r, a:b]``: the unit
        disaggregated serving moves KV in (``kv_transfer``), read in place to send, written to
        receive."""
        layers, kv, num_blocks = self.tensor.shape[:3]
        return self.tensor.view(torch.uint8).view(layers * kv, num_blocks, -1)
