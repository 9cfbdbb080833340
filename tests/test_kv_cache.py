"""``KVCache.spans``: the contract disaggregated serving moves KV by: every layer's keys and
values of each block as raw bytes, a run of consecutive blocks one contiguous piece per row; and
the order of a block's keys within it (model/kv_layout.py)."""

from __future__ import annotations

import pytest
import torch

from leanserve.engine.kv_cache import KVCache
from leanserve.model.kv_layout import key_group, keys_from_cache, keys_to_cache, stored_keys


def test_spans_are_the_caches_memory_row_by_row():
    layers, kv_heads, head_dim, block_size = 3, 2, 4, 5
    kv = KVCache(layers, kv_heads, head_dim, num_blocks=6, block_size=block_size, dtype=torch.bfloat16, device="cpu")
    kv.tensor.copy_(torch.arange(kv.tensor.numel(), dtype=torch.float32).view(kv.tensor.shape))
    spans = kv.spans()
    span_bytes = block_size * kv_heads * head_dim * 2
    assert spans.shape == (layers * 2, 6, span_bytes) and spans.data_ptr() == kv.tensor.data_ptr()
    # Row 2 * layer + kv, block b: that layer's keys or values of block b, as written by the model.
    for layer, which, block in [(0, 0, 0), (2, 1, 5), (1, 0, 3)]:
        got = spans[2 * layer + which, block].view(torch.bfloat16).view(kv_heads, block_size, head_dim)
        assert torch.equal(got, kv.tensor[layer, which, block])
    # Blocks 2..4 of a row are one piece of memory; writing bytes into a block lands in it only.
    run = spans[3, 2:5].numpy()
    assert run.flags.c_contiguous and run.ctypes.data == kv.tensor.data_ptr() + (3 * 6 + 2) * span_bytes
    before = kv.tensor.clone()
    spans.numpy()[:, 1] = spans.numpy()[:, 4]
    changed = (kv.tensor != before).nonzero()[:, 2].unique().tolist()
    assert changed == [1] and torch.equal(kv.tensor[:, :, 1], kv.tensor[:, :, 4])


@pytest.mark.parametrize("dtype,group", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 1)])
def test_a_blocks_keys_lie_dimension_major_in_groups_of_32_bits(dtype, group):
    """model/kv_layout.py's order, element by element: key t's dimension d of a (block, KV head) at
    (d // P) * block_size * P + t * P + d % P, P the elements in 32 bits; the conversions invert
    each other and the view shows the order as stored."""
    blocks, kv_heads, block_size, head_dim = 3, 2, 5, 8
    shape = (blocks, kv_heads, block_size, head_dim)
    keys = torch.arange(blocks * kv_heads * block_size * head_dim).to(dtype).view(shape)  # 240 values: exact in bf16
    stored = keys_to_cache(keys)
    assert key_group(dtype) == group and stored.shape == keys.shape
    run = stored[2, 1].flatten()  # one (block, KV head): its block_size * head_dim elements as they lie
    for t in range(block_size):
        for d in range(head_dim):
            assert run[(d // group) * block_size * group + t * group + d % group] == keys[2, 1, t, d]
    assert torch.equal(keys_from_cache(stored), keys)
    assert torch.equal(stored_keys(stored)[2, 1, 3, 4], keys[2, 1, 4, 3 * group : 4 * group])
    assert stored_keys(stored).data_ptr() == stored.data_ptr()
