"""leanserve's CPU decode attention kernel (model/kernels): built here, against a dense float64
reference, batch-invariant bit for bit, reading only each row's own blocks; and what happens
where it, or the other kernels (tests/test_prefill_kernel.py, tests/test_layer_ops.py), cannot
be built, and which of them the --attention-backend flag takes."""

from __future__ import annotations

import logging

import pytest
import torch

from leanserve.engine.config import EngineConfig
from leanserve.engine.kv_cache import KVCache
from leanserve.engine.model_runner import AttentionKernels, attention_kernels
from leanserve.model import kernels
from leanserve.model.kv_layout import keys_from_cache, keys_to_cache


@pytest.fixture(scope="module")
def kernel():
    k = kernels.paged_decode_attention()
    assert k is not None, "the kernel did not build on this machine (see the log)"
    return k


def paged_case(lens, heads, kv_heads, dim, block, dtype, seed=0):
    """q, caches (keys in the cache's order: model/kv_layout.py) and a block table whose rows'
    blocks are scattered over the pool; the null block 0, every table entry past a row's context
    and every slot past its length hold NaN, so a kernel that read them would return NaN (a value;
    a key read there would only score a lane the kernel masks)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block) for n in lens]
    num_blocks = sum(blocks) + 1
    k_cache = torch.randn(num_blocks, kv_heads, block, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block, dim, generator=g).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lens), max(blocks) + 2, dtype=torch.long)
    for r, n in enumerate(lens):
        table[r, : blocks[r]] = torch.tensor([ids.pop() for _ in range(blocks[r])])
        last = table[r, blocks[r] - 1]
        k_cache[last, :, (n - 1) % block + 1 :] = float("nan")
        v_cache[last, :, (n - 1) % block + 1 :] = float("nan")
    k_cache[0] = v_cache[0] = float("nan")
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, keys_to_cache(k_cache), v_cache, table, torch.tensor(lens, dtype=torch.long)


def reference(q, k_cache, v_cache, table, lens, scale):
    """Each row against its context, float64, query head h reading KV head h // (heads / kv_heads)."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for r, n in enumerate(lens.tolist()):
        k = keys_from_cache(k_cache[table[r]]).transpose(1, 2).flatten(0, 1)[:n].double()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table[r]].transpose(1, 2).flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[r].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(out)


# Shapes compiled for (3, 1 and 8 query heads per KV head, 64 and 128 dimensions; blocks of 16 keys
# and of sizes that cut the 16-key passes and the 256-token partitions elsewhere), and one that is not.
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(9, 3, 64, 16), (4, 4, 128, 32), (16, 2, 128, 24),
                                                      (6, 2, 64, 48), (8, 1, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_attends_exactly_its_own_context(kernel, heads, kv_heads, dim, block, dtype):
    # Contexts of one token, within a block, at block edges, across the kernel's 256-token partitions.
    lens = [1, 15, 16, 17, 255, 256, 257, 700, 1100]
    q, k_cache, v_cache, table, seq_lens = paged_case(lens, heads, kv_heads, dim, block, dtype)
    scale = dim ** -0.5
    got = kernel(q, k_cache, v_cache, table, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, table, seq_lens, scale)
    # bf16: the result rounded once (8 bits of mantissa); float32: float32 sums over ~1,000 keys.
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 32)])  # a compiled shape, the general one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_is_bitwise_the_same_alone_or_in_any_batch(kernel, dtype, heads, kv_heads, dim):
    lens = [3, 900, 40, 257, 2048, 16]
    q, k_cache, v_cache, table, seq_lens = paged_case(lens, heads, kv_heads, dim, 16, dtype, seed=1)
    together = kernel(q, k_cache, v_cache, table, seq_lens, 0.125)
    for r in range(len(lens)):
        alone = kernel(q[r : r + 1], k_cache, v_cache, table[r : r + 1], seq_lens[r : r + 1], 0.125)
        assert torch.equal(alone[0], together[r])
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    shuffled = kernel(q[order], k_cache, v_cache, table[order], seq_lens[order], 0.125)
    assert torch.equal(shuffled, together[order])
    # More threads or fewer: the same partitions, merged in the same order.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(q, k_cache, v_cache, table, seq_lens, 0.125), together)
    finally:
        torch.set_num_threads(threads)


def test_no_rows_and_bad_arguments(kernel):
    q, k_cache, v_cache, table, seq_lens = paged_case([20, 30], 9, 3, 64, 16, torch.float32)
    assert kernel(q[:0], k_cache, v_cache, table[:0], seq_lens[:0], 0.1).shape == (0, 9, 64)
    with pytest.raises(RuntimeError, match="seq_lens must be positive"):
        kernel(q, k_cache, v_cache, table, torch.tensor([20, 0]), 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(q.half(), k_cache.half(), v_cache.half(), table, seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q.bfloat16(), k_cache, v_cache, table, seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k_cache, v_cache, table.int(), seq_lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_read_in_place_from_a_wider_buffer(kernel, dtype):
    """q as the model hands it: rows of a QKV buffer (keys and values after each row's query
    heads), read where they lie, the same bits as a contiguous copy; heads not laid out as [H, D]
    within a row are refused."""
    q, k_cache, v_cache, table, seq_lens = paged_case([5, 300, 33], 9, 3, 64, 16, dtype, seed=2)
    qkv = torch.randn(3, 15, 64).to(dtype)
    qkv[:, :9] = q
    view = qkv[:, :9]
    assert not view.is_contiguous()
    assert torch.equal(kernel(view, k_cache, v_cache, table, seq_lens, 0.125),
                       kernel(q, k_cache, v_cache, table, seq_lens, 0.125))
    with pytest.raises(RuntimeError, match="q's rows"):
        kernel(q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, table, seq_lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_token_in_its_slot_and_touches_nothing_else(dtype):
    """The cache write against the layout's definition (engine/kv_cache.py): token t's head h to
    block slot // block_size, head h, offset slot % block_size; k and v as views of a QKV buffer;
    every other row as it was; a slot outside the cache refused before anything is written."""
    write = kernels.write_kv()
    blocks, kv_heads, block, dim = 7, 3, 16, 64
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(blocks, kv_heads, block, dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, kv_heads, block, dim, generator=g).to(dtype)
    slots = torch.tensor([17, 0, 111, 64, 65, 40])  # scattered, within and across blocks, the last slot
    qkv = torch.randn(len(slots), 9 + 2 * kv_heads, dim, generator=g).to(dtype)
    k, v = qkv[:, 9 : 9 + kv_heads], qkv[:, 9 + kv_heads :]
    want_k, want_v = keys_from_cache(k_cache), v_cache.clone()  # keys token-major, as the test writes them

    def check(k, v):
        for t, slot in enumerate(slots.tolist()):
            want_k[slot // block, :, slot % block] = k[t]
            want_v[slot // block, :, slot % block] = v[t]
        write(k, v, k_cache, v_cache, slots)
        assert torch.equal(keys_from_cache(k_cache), want_k) and torch.equal(v_cache, want_v)

    check(k, v)
    # Heads strided too: k and v as views of [KVH, T, D] buffers.
    heads_first = [torch.randn(kv_heads, len(slots), dim, generator=g).to(dtype) for _ in range(2)]
    k, v = (t.transpose(0, 1) for t in heads_first)
    check(k, v)
    with pytest.raises(RuntimeError, match="slot 112 of token 1 outside the cache's 112"):
        write(k, v, k_cache, v_cache, torch.tensor([3, 112, 4, 5, 6, 7]))
    assert torch.equal(keys_from_cache(k_cache), want_k)  # checked first, written after
    with pytest.raises(RuntimeError, match="share a dtype"):
        write(k.half(), v.half(), k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="slots"):
        write(k, v, k_cache, v_cache, slots[:2])
    write(k[:0], v[:0], k_cache, v_cache, slots[:0])  # no tokens: nothing to do


def test_without_a_compiler_the_kernels_fall_back_with_one_log_line(monkeypatch, tmp_path, caplog):
    """No compiler: one line for all libraries. A compiler that fails: one line per library,
    saying why (the compiler's own error) and what runs instead."""
    loaders = [loader.__wrapped__ for loader in  # uncached
               (kernels.paged_decode_attention, kernels.paged_prefill_attention, kernels.layer_ops,
                kernels.brgemm_linear)]
    cache = tmp_path / "cache"
    monkeypatch.setenv("LEANSERVE_KERNEL_CACHE", str(cache))
    failing = tmp_path / "failing-c++"  # answers --version, then fails every build with an error line
    failing.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "failing-c++ 1.0"; exit 0; }\n'
                       'echo "kernel.cpp:1:1: error: no such intrinsic" >&2\nexit 1\n')
    failing.chmod(0o755)
    kernels._compiler.cache_clear()  # said once per process: this test must see it said
    for compiler, says in (("no-such-compiler-here", ["no C++ compiler"]),
                           (str(failing), ["decode attention did not build", "prefill attention did not build",
                                           "SiLU did not build", "bf16 linear layers did not build"])):
        monkeypatch.setenv("CXX", compiler)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="leanserve.model.kernels"):
            kernels.build_together(tuple(kernels.LIBRARY_FLAGS))  # side by side; the loaders then say what failed
            assert [load() for load in loaders] == [None] * 4
        assert len(caplog.records) == len(says)
        assert all(s in r.message for s, r in zip(says, caplog.records))
    assert all("error: no such intrinsic" in r.message for r in caplog.records)
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing half-built left behind


def test_the_attention_backend_flag():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash").validate()
    with pytest.raises(ValueError, match="cpu-paged runs on the CPU"):
        EngineConfig(attention_backend="cpu-paged", device="cuda").validate()

    class Config:
        num_heads, num_kv_heads, head_dim = 9, 3, 64

    class Model:
        config = Config()

    fp16 = KVCache(1, 3, 64, 4, 16, torch.float16, "cpu")
    bf16 = KVCache(1, 3, 64, 4, 16, torch.bfloat16, "cpu")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cpu-paged decode attention takes float32 or bfloat16"):
        attention_kernels("cpu-paged", Model(), fp16, cpu)
    assert attention_kernels("auto", Model(), fp16, cpu) == AttentionKernels()  # auto: SDPA where none applies
    assert attention_kernels("sdpa", Model(), bf16, cpu) == AttentionKernels()
    # The cache write comes with the decode kernel, whichever attends prefill chunks.
    decode = AttentionKernels(kernels.paged_decode_attention(), write=kernels.write_kv())
    both = AttentionKernels(kernels.paged_decode_attention(), kernels.paged_prefill_attention(), kernels.write_kv())
    assert attention_kernels("auto", Model(), bf16, cpu) == both
    assert attention_kernels("cpu-paged", Model(), bf16, cpu) == both
    assert attention_kernels("auto", Model(), KVCache(1, 3, 64, 4, 16, torch.float32, "cpu"), cpu) == both
    # A head size the prefill kernel is not compiled for: auto attends prefill chunks with SDPA,
    # cpu-paged says why it cannot.
    Config.head_dim = 40
    bf16_40 = KVCache(1, 3, 40, 4, 16, torch.bfloat16, "cpu")
    assert attention_kernels("auto", Model(), bf16_40, cpu) == decode
    with pytest.raises(ValueError, match="cpu-paged prefill attention takes heads of a multiple of 16 dimensions"):
        attention_kernels("cpu-paged", Model(), bf16_40, cpu)
