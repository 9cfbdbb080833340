"""Decode attention over the block-major KV cache against a dense reference, and the cache's
block layout (what a block holds, in what order: the contract a KV transfer relies on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._inductor.config

from leanserve.engine.kv_cache import KVCache
from leanserve.model.attention import AttentionMetadata, paged_attention
from leanserve.model.decode_attention import DecodeAttention

LAYERS = 2


def fill(kv: KVCache, layer: int, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    """Writes one sequence's [tokens, KVH, Dh] keys and values into its blocks, by the layout
    KVCache documents: block, layer, k/v, head, slot, head dim."""
    bs = kv.block_size
    for i, b in enumerate(block_ids):
        k, v = keys[i * bs : (i + 1) * bs], values[i * bs : (i + 1) * bs]
        kv.tensor[b, layer, 0, :, : len(k)] = k.transpose(0, 1)
        kv.tensor[b, layer, 1, :, : len(v)] = v.transpose(0, 1)


def reference(q, keys, values, scale):
    """Dense attention of one query row [H, Dh] to [L, KVH, Dh] keys/values, in float64."""
    groups = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, 1).transpose(0, 1)  # [H, L, Dh]
    v = values.double().repeat_interleave(groups, 1).transpose(0, 1)
    p = torch.softmax((q.double()[:, None] @ k.transpose(1, 2))[:, 0] * scale, -1)  # [H, L]
    return (p[:, None] @ v)[:, 0]


def random_batch(kv: KVCache, num_heads: int, head_dim: int, lengths: list[int], layer: int, dtype, seed: int):
    """Sequences of the given lengths in randomly chosen blocks; the block table is padded with
    the null block (and one more column of it), stale random values elsewhere."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, bs = kv.tensor.shape[3], kv.block_size
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=g))  # stale contents everywhere
    free = (torch.randperm(kv.tensor.shape[0] - 1, generator=g) + 1).tolist()
    width = -(-max(lengths) // bs) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    refs, ctx = [], []
    for row, n in enumerate(lengths):
        ids = [free.pop() for _ in range(-(-n // bs))]
        table[row, : len(ids)] = torch.tensor(ids)
        keys = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        values = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        fill(kv, layer, ids, keys, values)
        ctx.append((keys, values))
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    for row, (keys, values) in enumerate(ctx):
        refs.append(reference(q[row], keys, values, scale))
    return q, table, torch.tensor(lengths, dtype=torch.int32), torch.stack(refs), scale


# (dtype, KV heads, query heads per KV head, head dim, block size)
CONFIGS = [
    (torch.bfloat16, 3, 3, 64, 16),  # the default model's attention
    (torch.float32, 2, 2, 16, 32),
    (torch.float32, 2, 1, 32, 16),  # no grouping
]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-kvh{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}")
def setup(request):
    dtype, kv_heads, groups, head_dim, bs = request.param
    kv = KVCache(LAYERS, kv_heads, head_dim, 64, bs, dtype, "cpu")
    attn = DecodeAttention("cpu", dtype)
    attn.warm_up(kv.layers[0, 0], kv.layers[0, 1], kv_heads * groups, head_dim)
    assert attn.compiled
    return kv, attn, kv_heads * groups, head_dim, dtype


@pytest.mark.parametrize("lengths", [[1], [37], [5, 200, 16, 17, 1, 64, 33], list(range(1, 40, 3))])
def test_decode_matches_dense_reference(setup, lengths):
    kv, attn, num_heads, head_dim, dtype = setup
    layer = 1
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    fallbacks = attn.fallbacks
    with torch.inference_mode():  # as the model runs: inputs are inference tensors
        q, table, seq_lens, ref, scale = random_batch(kv, num_heads, head_dim, lengths, layer, dtype, len(lengths))
        fused = attn(q, kv.layers[layer, 0], kv.layers[layer, 1], table, seq_lens, scale)
        eager = attn.eager(q.view(len(lengths), kv.tensor.shape[3], -1, head_dim), kv.layers[layer, 0],
                           kv.layers[layer, 1], table, seq_lens, scale).view_as(q)
    for out in (fused, eager):
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert attn.compiles == 1 and attn.fallbacks == fallbacks  # every shape ran the one warmed-up kernel


def test_a_call_that_needs_another_kernel_runs_eagerly(setup):
    kv, attn, num_heads, head_dim, dtype = setup
    q, table, seq_lens, ref, scale = random_batch(kv, num_heads, head_dim, [20, 3], 0, dtype, 0)
    before = attn.fallbacks
    out = attn(q, kv.layers[0, 0], kv.layers[0, 1], table, seq_lens, scale)  # outside inference mode
    assert attn.fallbacks == before + 1 and attn.compiles == 1
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_uncompiled_decode_attention_is_eager():
    kv = KVCache(LAYERS, 2, 16, 16, 16, torch.float32, "cpu")
    attn = DecodeAttention("cpu", torch.float32, compile=False)
    attn.warm_up(kv.layers[0, 0], kv.layers[0, 1], 4, 16)
    q, table, seq_lens, ref, scale = random_batch(kv, 4, 16, [9, 30], 0, torch.float32, 1)
    out = attn(q, kv.layers[0, 0], kv.layers[0, 1], table, seq_lens, scale)
    assert not attn.compiled and attn.compiles == 0
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_writes_the_documented_layout():
    """A step's keys and values land in their blocks as KVCache's docstring says, for every
    layer view; a block is one contiguous buffer; export/import move it whole."""
    kv = KVCache(LAYERS, 2, 8, 6, 4, torch.float32, "cpu")
    attn = DecodeAttention("cpu", torch.float32, compile=False)
    slots = torch.tensor([4 * 3 + 1, 4 * 5 + 0, 4 * 5 + 3])  # block 3 slot 1, block 5 slots 0 and 3
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    q = torch.randn(3, 4, 8)
    table = torch.tensor([[3], [5], [5]])
    meta = AttentionMetadata.build(slots, 4, [], table, torch.tensor([2, 1, 4], dtype=torch.int32), attn)
    for layer in range(LAYERS):
        paged_attention(q, k + layer, v - layer, kv.layers[layer, 0], kv.layers[layer, 1], meta, 0.5)
    for layer in range(LAYERS):
        for row, (b, s) in enumerate([(3, 1), (5, 0), (5, 3)]):
            for h in range(2):
                assert torch.equal(kv.tensor[b, layer, 0, h, s], k[row, h] + layer)
                assert torch.equal(kv.tensor[b, layer, 1, h, s], v[row, h] - layer)
    assert kv.tensor[5].is_contiguous() and kv.tensor[5].numel() * 4 == KVCache.bytes_per_block(
        LAYERS, 2, 8, 4, torch.float32)
    sent = kv.export_blocks([3, 5])
    other = KVCache(LAYERS, 2, 8, 6, 4, torch.float32, "cpu")
    got = other.import_blocks(sent)
    assert torch.equal(other.tensor[got], kv.tensor[[3, 5]])
    assert np.all(np.array(got) > 0)


def test_without_a_compiler_decode_attention_is_eager_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, "/nonexistent/c++"))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # a cached kernel needs no compiler
    kv = KVCache(LAYERS, 2, 16, 16, 16, torch.float32, "cpu")
    attn = DecodeAttention("cpu", torch.float32)
    with caplog.at_level("WARNING", logger="leanserve.model.decode_attention"):
        attn.warm_up(kv.layers[0, 0], kv.layers[0, 1], 4, 16)
    assert not attn.compiled
    ours = [r for r in caplog.records if r.name == "leanserve.model.decode_attention"]  # (torch logs its own)
    assert len(ours) == 1 and "eagerly" in ours[0].getMessage()
    q, table, seq_lens, ref, scale = random_batch(kv, 4, 16, [9, 30], 0, torch.float32, 1)
    torch.testing.assert_close(attn(q, kv.layers[0, 0], kv.layers[0, 1], table, seq_lens, scale).double(), ref,
                               atol=1e-5, rtol=1e-5)


def test_a_row_is_attended_the_same_whatever_the_batch(setup):
    """Decode attention is batch invariant, bit for bit: a row's result does not depend on the
    other rows, nor on how many (masked) blocks they make the step attend."""
    kv, attn, num_heads, head_dim, dtype = setup
    fallbacks = attn.fallbacks
    with torch.inference_mode():
        q, table, seq_lens, _, scale = random_batch(kv, num_heads, head_dim, [40, 3, 150, 17, 90], 1, dtype, 7)
        together = attn(q, kv.layers[1, 0], kv.layers[1, 1], table, seq_lens, scale)
        for row in range(len(q)):
            width = -(-int(seq_lens[row]) // kv.block_size)
            alone = attn(q[row : row + 1], kv.layers[1, 0], kv.layers[1, 1], table[row : row + 1, :width],
                         seq_lens[row : row + 1], scale)
            assert torch.equal(alone[0], together[row])
    assert attn.fallbacks == fallbacks  # all of them ran the compiled kernel
