"""Attention over the paged KV cache against a dense reference: decode rows gathered (grouped
or not) into SDPA, or read in place by the CPU kernels (their own cases in test_kernels.py and
test_prefill_kernel.py), and prefill chunks beside them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from leanserve.model import attention, kernels
from leanserve.model.attention import (AttentionMetadata, DecodeGroup, DecodeMaskTable, GatherScratch, PagedDecode,
                                      decode_groups, paged_attention, split_decode_rows)
from leanserve.model.kv_layout import keys_from_cache

BLOCK, KV_HEADS, HEADS, DIM = 16, 2, 6, 32


@pytest.mark.parametrize("lens,groups", [
    ([1500] * 64 + [32_000], [list(range(64)), [64]]),  # one long context among short ones
    ([32_000] + [1500] * 64, [list(range(1, 65)), [0]]),  # wherever it sits
    ([100, 900, 120, 1000, 110], [[0, 2, 4], [1, 3]]),  # two populations: the cut between them
    ([1000, 1010, 990, 1020], None),  # alike: one group
    ([10, 20, 30, 40], None),  # padding wastes under half the keys
    ([16] * 63 + [48], [list(range(63)), [63]]),  # 192 row-blocks padded, 66 split: worth a second call
    ([16] * 7 + [64], None),  # 32 row-blocks padded, 11 split: spares less than a second call costs
    ([16, 48], None),  # exactly twice: not more than twice
    ([5000], None),
])
def test_rows_are_split_only_where_padding_to_the_longest_wastes_most_keys(lens, groups):
    got = split_decode_rows(np.asarray(lens), BLOCK)
    assert (None if got is None else [g.tolist() for g in got]) == groups


def dense(q, ks, vs, scale):
    """Each row alone against its own keys, with the query heads repeated per KV head."""
    out = []
    for qi, k, v in zip(q, ks, vs):
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        out.append(F.scaled_dot_product_attention(qi[:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale)[:, 0])
    return torch.stack(out)


def test_decode_groups_cut_each_groups_table_to_its_longest_context_and_mask_it():
    masks = DecodeMaskTable("cpu")
    lens = np.array([40, 3000, 20])
    table = np.arange(3 * 188).reshape(3, 188)
    short, long = decode_groups(table, lens, BLOCK, masks, torch.as_tensor, mask_lone_row=False)
    assert short.rows.tolist() == [0, 2] and short.block_ids.tolist() == table[[0, 2], :3].tolist()
    assert long.rows.tolist() == [1] and long.block_ids.tolist() == table[[1]].tolist()
    assert short.mask.shape == (2, 1, 1, 48)  # shaped for SDPA once, not per layer
    assert (short.mask[1, 0, 0, 20:] == float("-inf")).all() and (short.mask[1, 0, 0, :20] == 0).all()
    assert long.mask.shape == (1, 1, 1, 188 * BLOCK)  # one row of a split group keeps its mask: whole blocks
    (alone,) = decode_groups(table[1:2], lens[1:2], BLOCK, masks, torch.as_tensor, mask_lone_row=False)
    assert alone.rows is None and alone.mask is None  # keys sliced to its context instead
    (padded,) = decode_groups(table[1:2], lens[1:2], BLOCK, masks, torch.as_tensor, mask_lone_row=True)
    assert padded.mask.shape == (1, 1, 1, 188 * BLOCK)
    with pytest.raises(ValueError, match="decode_groups: a group of some of the rows needs a mask"):
        unmasked = DecodeGroup(torch.tensor([0]), long.block_ids, None)
        AttentionMetadata.build(torch.zeros(1, dtype=torch.long), [unmasked], 3000, [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_mixed_lengths_attend_exactly_their_own_contexts(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    lens = np.array([37, 300, 16, 2000, 45, 129, 64])  # 2,000 among short ones: split in two groups
    blocks = -(-lens // BLOCK)
    num_blocks = int(blocks.sum()) + 1
    k_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=g).to(dtype)
    ids = torch.randperm(num_blocks - 1, generator=g) + 1  # each row's blocks scattered, block 0 unused
    table = np.zeros((len(lens), blocks.max()), np.int64)
    for r, start in enumerate(np.cumsum(blocks) - blocks):
        table[r, : blocks[r]] = ids[start : start + blocks[r]]
    d = len(lens)
    q = torch.randn(d, HEADS, DIM, generator=g).to(dtype)
    k_new = torch.randn(d, KV_HEADS, DIM, generator=g).to(dtype)
    v_new = torch.randn(d, KV_HEADS, DIM, generator=g).to(dtype)
    slots = torch.as_tensor(table[np.arange(d), (lens - 1) // BLOCK] * BLOCK + (lens - 1) % BLOCK)
    masks = DecodeMaskTable("cpu", dtype=dtype)
    scratch = GatherScratch()  # shared by the steps below, as the model runner shares its own

    def attend(groups, padding_rows=0, paged=None):
        """Through paged_attention, with ``padding_rows`` after the decode rows (a padded step);
        ``paged``: the rows for the in-place kernel instead of ``groups``."""
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = AttentionMetadata.build(slots, groups, int(lens.max()), [], scratch=scratch, paged_decode=paged)
        pad = torch.zeros(padding_rows, *q.shape[1:], dtype=dtype)
        out = paged_attention(torch.cat((q, pad)), torch.cat((k_new, pad[:, :KV_HEADS])),
                              torch.cat((v_new, pad[:, :KV_HEADS])), kc, vc, meta, DIM ** -0.5)
        assert (out[d:] == 0).all()
        return out[:d].view(d, HEADS, DIM), kc, vc

    whole = masks(torch.as_tensor(lens), table.shape[1] * BLOCK)[:, None, None, :]
    one, kc, vc = attend([DecodeGroup(None, torch.as_tensor(table), whole)])
    groups = decode_groups(table, lens, BLOCK, masks, torch.as_tensor, mask_lone_row=True)
    assert [g.rows.tolist() for g in groups] == [[0, 1, 2, 4, 5, 6], [3]]
    split, kc2, vc2 = attend(groups)
    split_padded, _, _ = attend(groups, padding_rows=3)
    assert torch.equal(split, split_padded)
    # Rows attended a few at a time (DECODE_CHUNK_BYTES), 3 and 1 of the 7 per chunk: in bf16 the
    # same bits; in float32 SDPA on the CPU moves a row's last bits with the batch it is in anyway
    # (~1e-7 here, a whole group against each row alone), chunks or not.
    row_bytes = 2 * table.shape[1] * BLOCK * KV_HEADS * DIM * k_cache.element_size()
    for rows in (3, 1):
        monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", rows * row_bytes)
        chunked = attend([DecodeGroup(None, torch.as_tensor(table), whole)])[0]
        if dtype == torch.bfloat16:
            assert torch.equal(chunked, one)
        else:
            torch.testing.assert_close(chunked, one, atol=1e-6, rtol=1e-6)
    monkeypatch.undo()
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the new keys written once, in place
    block, offset = slots // BLOCK, slots % BLOCK  # each at its slot's offset of its block, head by head
    keys = keys_from_cache(kc)  # token-major (model/kv_layout.py)
    assert torch.equal(keys[block, :, offset], k_new) and torch.equal(vc[block, :, offset], v_new)
    ks = [keys[torch.as_tensor(table[r, : blocks[r]])].transpose(1, 2).flatten(0, 1)[: lens[r]].float()
          for r in range(d)]
    vs = [vc[torch.as_tensor(table[r, : blocks[r]])].transpose(1, 2).flatten(0, 1)[: lens[r]].float() for r in range(d)]
    want = dense(q.float(), ks, vs, DIM ** -0.5)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one.float(), want, **tol)
    torch.testing.assert_close(split.float(), want, **tol)
    # The CPU kernel reading each row's blocks in place (model/kernels), in a padded step too.
    paged = PagedDecode(kernels.paged_decode_attention(), torch.as_tensor(table), torch.as_tensor(lens))
    in_place, kc3, vc3 = attend(None, paged=paged)
    assert torch.equal(kc3, kc) and torch.equal(vc3, vc)
    assert torch.equal(attend(None, padding_rows=3, paged=paged)[0], in_place)
    torch.testing.assert_close(in_place.float(), want, **tol)


def blocks_of(cache, ids):
    """[num_blocks, KVH, block_size, D] at [S, n] block ids -> [S, KVH, n * block_size, D], by indexing."""
    return cache[ids].transpose(1, 2).flatten(2, 3)


def test_gather_scratch_copies_blocks_into_buffers_it_reuses_and_grows_only_when_a_step_needs_more():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, KV_HEADS, BLOCK, DIM, generator=g)
    scratch = GatherScratch()
    ids = torch.tensor([[3, 7, 1], [9, 2, 30]])
    key_cache = keys_from_cache(cache)  # keys token-major, as a gather of keys reads them (model/kv_layout.py)
    keys = scratch.gather(cache, ids, GatherScratch.KEYS)
    assert keys.shape == (2, KV_HEADS, 3 * BLOCK, DIM)
    assert torch.equal(keys, blocks_of(key_cache, ids)) and not torch.equal(keys, blocks_of(cache, ids))
    values = scratch.gather(cache, ids[:, :2], GatherScratch.VALUES)  # a buffer of their own
    assert torch.equal(keys, blocks_of(key_cache, ids)) and torch.equal(values, blocks_of(cache, ids[:, :2]))
    smaller = scratch.gather(cache, ids[:1], GatherScratch.KEYS)
    assert smaller.data_ptr() == keys.data_ptr() and torch.equal(smaller, blocks_of(key_cache, ids[:1]))
    larger = scratch.gather(cache, torch.arange(1, 40).view(3, 13), GatherScratch.KEYS)  # more than it holds
    assert torch.equal(larger, blocks_of(key_cache, torch.arange(1, 40).view(3, 13)))
    again = scratch.gather(cache, ids, GatherScratch.KEYS)  # the grown buffer serves a smaller step
    assert again.data_ptr() == larger.data_ptr() and torch.equal(again, blocks_of(key_cache, ids))
    half = scratch.gather(cache.to(torch.bfloat16), ids, GatherScratch.KEYS)  # another dtype: a new buffer
    assert half.dtype == torch.bfloat16 and torch.equal(half, blocks_of(keys_from_cache(cache.bfloat16()), ids))


def test_a_step_of_two_decode_groups_and_a_prefill_chunk_shares_the_scratch_without_overwriting_a_gather():
    """Both decode groups and a chunk with context gather into the same two buffers, one after
    another: the step's outputs equal those of its parts run as steps of their own."""
    g = torch.Generator().manual_seed(1)
    lens = np.array([37, 300, 16, 2000, 45])  # two decode groups
    chunk, context = 40, 240  # a prompt's second chunk: 200 tokens cached, 40 new
    blocks = np.append(-(-lens // BLOCK), -(-context // BLOCK))
    num_blocks = int(blocks.sum()) + 1
    k_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=g)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=g)
    ids = torch.split(torch.randperm(num_blocks - 1, generator=g) + 1, blocks.tolist())
    table = np.zeros((len(lens), blocks[:-1].max()), np.int64)
    for r in range(len(lens)):
        table[r, : blocks[r]] = ids[r]
    chunk_ids = ids[-1]
    d = len(lens)
    q = torch.randn(d + chunk, HEADS, DIM, generator=g)
    k = torch.randn(d + chunk, KV_HEADS, DIM, generator=g)
    v = torch.randn(d + chunk, KV_HEADS, DIM, generator=g)
    positions = torch.arange(context - chunk, context)
    slots = torch.cat((torch.as_tensor(table[np.arange(d), (lens - 1) // BLOCK] * BLOCK + (lens - 1) % BLOCK),
                       chunk_ids[positions // BLOCK] * BLOCK + positions % BLOCK))
    masks = DecodeMaskTable("cpu")
    scratch = GatherScratch()

    def step(rows, groups, prefills):
        meta = AttentionMetadata.build(slots[rows], groups, int(lens.max()), prefills, scratch=scratch)
        return paged_attention(q[rows], k[rows], v[rows], k_cache.clone(), v_cache.clone(), meta, DIM ** -0.5)

    groups = decode_groups(table, lens, BLOCK, masks, torch.as_tensor, mask_lone_row=True)
    assert len(groups) == 2
    both = step(slice(None), groups, [(d, chunk, context, chunk_ids)])
    decode_only = step(slice(0, d), groups, [])
    chunk_only = step(slice(d, None), None, [(0, chunk, context, chunk_ids)])
    assert torch.equal(both[:d], decode_only) and torch.equal(both[d:], chunk_only)


def test_a_step_of_decode_rows_and_prefill_chunks_in_the_cpu_kernels_equals_it_through_sdpa():
    """Decode rows and two chunks (a whole prompt, and a chunk after 200 cached tokens) in one
    step: by the in-place kernels, each row lands where SDPA over gathered keys puts it."""
    g = torch.Generator().manual_seed(2)
    lens = np.array([37, 300, 16])
    chunks = [(50, 50), (40, 240)]  # (tokens, context after the step)
    blocks = np.concatenate((-(-lens // BLOCK), [-(-ctx // BLOCK) for _, ctx in chunks]))
    num_blocks = int(blocks.sum()) + 1
    k_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=g)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM, generator=g)
    ids = torch.split(torch.randperm(num_blocks - 1, generator=g) + 1, blocks.tolist())
    d = len(lens)
    table = np.zeros((d, blocks[:d].max()), np.int64)
    for r in range(d):
        table[r, : blocks[r]] = ids[r]
    rows = d + sum(n for n, _ in chunks)
    q = torch.randn(rows, HEADS, DIM, generator=g)
    k = torch.randn(rows, KV_HEADS, DIM, generator=g)
    v = torch.randn(rows, KV_HEADS, DIM, generator=g)
    slots = [torch.as_tensor(table[np.arange(d), (lens - 1) // BLOCK] * BLOCK + (lens - 1) % BLOCK)]
    prefills, start = [], d
    for (n, ctx), chunk_ids in zip(chunks, ids[d:]):
        positions = torch.arange(ctx - n, ctx)
        slots.append(chunk_ids[positions // BLOCK] * BLOCK + positions % BLOCK)
        prefills.append((start, n, ctx, chunk_ids))
        start += n
    slots = torch.cat(slots)

    def step(**kernels_given):
        groups = None if kernels_given else decode_groups(table, lens, BLOCK, DecodeMaskTable("cpu"),
                                                          torch.as_tensor, mask_lone_row=True)
        meta = AttentionMetadata.build(slots, groups, int(lens.max()), prefills, **kernels_given)
        return paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, DIM ** -0.5)

    paged = PagedDecode(kernels.paged_decode_attention(), torch.as_tensor(table), torch.as_tensor(lens))
    got = step(paged_decode=paged, prefill_kernel=kernels.paged_prefill_attention())
    torch.testing.assert_close(got, step(), atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="needs every chunk's block ids"):  # SDPA's whole-prompt form
        AttentionMetadata.build(slots, None, 0, [(d, 50, 50, None)], prefill_kernel=kernels.paged_prefill_attention())
