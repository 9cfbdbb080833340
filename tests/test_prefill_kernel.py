"""leanserve's CPU prefill attention kernel (model/kernels/paged_prefill_attention.cpp): a chunk
of a sequence's tokens against a dense float64 causal reference, reading only its own blocks, a
token's output bitwise the same in any chunking and at any thread count. bf16 takes two paths, both
tested where the CPU has AMX: the products in AMX's tiles (oneDNN's micro-kernel), and with oneDNN
turned off, as on CPUs without AMX, in vector instructions."""

from __future__ import annotations

import contextlib

import pytest
import torch

from leanserve.model import kernels
from leanserve.model.kv_layout import keys_from_cache, keys_to_cache
from leanserve.model.prepack import has_amx

# (dtype, where its products are computed): bf16 in AMX's tiles only exists on a CPU with AMX.
PATHS = [(torch.float32, "vector"), (torch.bfloat16, "vector")] + ([(torch.bfloat16, "tiles")] if has_amx() else [])


@contextlib.contextmanager
def on_path(path):
    """The kernel's path for the calls inside: oneDNN off leaves the vector instructions."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = path == "tiles"
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def kernel_op():
    k = kernels.paged_prefill_attention()
    assert k is not None, "the kernel did not build on this machine (see the log)"
    return k


@pytest.fixture(scope="module")
def kernel():
    return kernel_op()


def sequence(context, heads, kv_heads, dim, block, dtype, seed=0):
    """q for every position of a sequence of ``context`` tokens, caches holding its keys and
    values (keys in the cache's order: model/kv_layout.py) in blocks scattered over the pool, and
    its block ids; the null block 0, the slots past the context and two table entries past its
    last block hold NaN, so a kernel that read them would return NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // block)
    num_blocks = 2 * blocks + 3
    k_cache = torch.randn(num_blocks, kv_heads, block, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block, dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks - 1, generator=g)[: blocks + 2] + 1
    last = ids[blocks - 1]
    for cache in (k_cache, v_cache):
        cache[last, :, (context - 1) % block + 1 :] = float("nan")
        cache[ids[blocks:]] = float("nan")
        cache[0] = float("nan")
    q = torch.randn(context, heads, dim, generator=g).to(dtype)
    return q, keys_to_cache(k_cache), v_cache, ids


def reference(q, k_cache, v_cache, ids, context, scale):
    """Every position of q (the last len(q) of the context) against the keys up to its own, float64."""
    n, heads = q.shape[:2]
    group = heads // k_cache.shape[1]
    k = keys_from_cache(k_cache[ids]).transpose(1, 2).flatten(0, 1)[:context].double().repeat_interleave(group, dim=1)
    v = v_cache[ids].transpose(1, 2).flatten(0, 1)[:context].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale
    positions = torch.arange(context - n, context)
    scores = scores.masked_fill(torch.arange(context)[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), v)


# Query heads per KV head 3, 1, 8, 2, and more than the 8 a work item takes (12 in groups of 6;
# 11, a prime, one by one); dims 64, 128, 16, 96, 32; blocks within the kernel's 32-key tiles
# and larger (cut into them).
SHAPES = [(9, 3, 64, 16), (4, 4, 128, 32), (16, 2, 16, 64), (6, 3, 96, 16), (24, 2, 64, 16), (11, 1, 32, 16)]


@pytest.mark.parametrize("heads,kv_heads,dim,block", SHAPES)
@pytest.mark.parametrize("dtype,path", PATHS)
def test_a_chunk_attends_causally_to_exactly_its_context(kernel, heads, kv_heads, dim, block, dtype, path):
    context = 1100
    q, k_cache, v_cache, ids = sequence(context, heads, kv_heads, dim, block, dtype)
    scale = dim ** -0.5
    # (chunk, context): one token, a tile of 16 and one past it, a whole prompt, chunks after
    # context ending mid-block and on a block edge.
    for n, ctx in [(1, 1), (16, 16), (17, 17), (300, 300), (5, 300), (100, 1024), (40, 1100), (1, 1100)]:
        with on_path(path):
            got = kernel(q[ctx - n : ctx], k_cache, v_cache, ids, ctx, scale)
        assert got.dtype == dtype and got.shape == (n, heads, dim)
        want = reference(q[ctx - n : ctx], k_cache, v_cache, ids, ctx, scale)
        # bf16: the result rounded once (8 bits of mantissa); float32: float32 sums over ~1,000 keys.
        tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(got.double(), want, **tol, msg=f"chunk {n} ending at {ctx}")


@pytest.mark.parametrize("heads,kv_heads,dim,block", [SHAPES[0], SHAPES[2]])
@pytest.mark.parametrize("dtype,path", PATHS)
def test_a_tokens_output_is_bitwise_the_same_in_any_chunking_and_thread_count(kernel, heads, kv_heads, dim,
                                                                             block, dtype, path):
    context = 700
    q, k_cache, v_cache, ids = sequence(context, heads, kv_heads, dim, block, dtype, seed=1)

    def chunked(sizes):
        out, start = [], 0
        with on_path(path):
            for n in sizes:
                out.append(kernel(q[start : start + n], k_cache, v_cache, ids, start + n, 0.125))
                start += n
        return torch.cat(out)

    whole = chunked([context])
    for sizes in ([128] * 5 + [60], [1, 699], [333, 367], [16, 17, 15] + [1] * 20 + [632]):
        assert torch.equal(chunked(sizes), whole), sizes
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(chunked([context]), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not has_amx(), reason="bf16 has one path on a CPU without AMX")
def test_on_amx_bf16_takes_the_tiles():
    """The two bf16 paths round differently (the tiles sum in another order), so where they agree
    bit for bit on every element the tests above would be testing one path twice."""
    q, k_cache, v_cache, ids = sequence(300, 9, 3, 64, 16, torch.bfloat16)
    with on_path("tiles"):
        tiles = kernel_op()(q, k_cache, v_cache, ids, 300, 0.125)
    with on_path("vector"):
        vector = kernel_op()(q, k_cache, v_cache, ids, 300, 0.125)
    assert not torch.equal(tiles, vector)
    torch.testing.assert_close(tiles, vector, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype,path", PATHS[1:])
def test_queries_may_be_rows_of_a_wider_buffer(kernel, dtype, path):
    """The engine hands q as a view of the fused QKV projection's output (rows further apart than
    one row of heads): the same result as contiguous queries."""
    q, k_cache, v_cache, ids = sequence(200, 9, 3, 64, 16, dtype)
    qkv = torch.cat((q, torch.randn(200, 6, 64).to(dtype)), dim=1)
    strided = qkv[:, :9]
    assert not strided.is_contiguous()
    with on_path(path):
        assert torch.equal(kernel(strided[150:], k_cache, v_cache, ids, 200, 0.125),
                           kernel(q[150:].contiguous(), k_cache, v_cache, ids, 200, 0.125))


def test_no_tokens_and_bad_arguments(kernel):
    q, k_cache, v_cache, ids = sequence(40, 9, 3, 64, 16, torch.float32)
    assert kernel(q[:0], k_cache, v_cache, ids, 40, 0.1).shape == (0, 9, 64)
    with pytest.raises(RuntimeError, match="must end its context"):
        kernel(q, k_cache, v_cache, ids, 39, 0.1)  # 40 tokens cannot end a context of 39
    with pytest.raises(RuntimeError, match="within its 2 blocks"):
        kernel(q[:5], k_cache, v_cache, ids[:2], 40, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(q.half(), k_cache.half(), v_cache.half(), ids, 40, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q.bfloat16(), k_cache, v_cache, ids, 40, 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k_cache, v_cache, ids.int(), 40, 0.1)
    with pytest.raises(RuntimeError, match="a whole number of query heads per KV head"):
        kernel(torch.randn(40, 10, 64), k_cache, v_cache, ids, 40, 0.1)
    with pytest.raises(RuntimeError, match="block id 99 at 1 is not one of the cache's"):
        kernel(q, k_cache, v_cache, torch.tensor([ids[0].item(), 99, ids[2].item()]), 40, 0.1)
    with pytest.raises(RuntimeError, match="a multiple of 16 dimensions"):
        kernel(q[..., :40].contiguous(), k_cache[..., :40].contiguous(), v_cache[..., :40].contiguous(), ids, 40, 0.1)
