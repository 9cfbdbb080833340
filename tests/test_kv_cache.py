"""``KVCache.block_buffer``: the contract disaggregated serving moves KV by, whatever the cache's
layout: one block's keys and values for every layer as [layers, 2, kv_heads, block_size, head_dim]."""

from __future__ import annotations

import torch

from leanserve.engine.kv_cache import KVCache


def test_a_block_buffer_reads_and_writes_one_blocks_kv_for_every_layer():
    layers, kv_heads, head_dim, block_size = 3, 2, 4, 5
    kv = KVCache(layers, kv_heads, head_dim, num_blocks=6, block_size=block_size, dtype=torch.float32, device="cpu")
    kv.tensor.copy_(torch.arange(kv.tensor.numel(), dtype=torch.float32).view(kv.tensor.shape))
    buf = kv.block_buffer(4)
    assert buf.shape == (layers, 2, kv_heads, block_size, head_dim)
    # Element [layer, k/v, head, slot, dim] is what the model wrote for that slot of block 4.
    for layer, which, head, slot, dim in [(0, 0, 0, 0, 0), (2, 1, 1, 4, 3), (1, 0, 1, 2, 0)]:
        assert buf[layer, which, head, slot, dim] == kv.tensor[layer, which, 4, slot, head, dim]
    # Writing through it lands in that block only: what a receiver does.
    before = kv.tensor.clone()
    kv.block_buffer(2).copy_(buf.contiguous() * -1)
    changed = (kv.tensor != before).nonzero()[:, 2].unique().tolist()
    assert changed == [2] and torch.equal(kv.block_buffer(2), -kv.block_buffer(4))
