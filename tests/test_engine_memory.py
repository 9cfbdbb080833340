"""Engine memory stays flat: the shapes a step hands to the backend come from a bounded set.

On the CPU, bf16 matmuls (oneDNN) and bf16 SDPA (brgemm micro-kernels) build and keep a
kernel per problem shape; with shapes that followed the data (tokens per step, chunk and
context lengths, one more key per decoded token) the engine process grew by hundreds of MB
over a few hundred mixed requests. These tests record the shapes themselves, which is
deterministic, instead of measuring RSS, which is not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from leanserve.engine.config import EngineConfig
from leanserve.engine.core import EngineCore
from leanserve.engine.params import SamplingParams
from leanserve.engine.stats import FIELDS
from leanserve.model.attention import DecodeMaskTable, bucket


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


class ShapeLog(TorchFunctionMode):
    """Records the shapes of the calls whose kernels are cached per shape."""

    def __init__(self):
        super().__init__()
        self.linear: set[tuple[int, int, int]] = set()  # (rows, in, out)
        self.sdpa: set[tuple] = set()  # (batch, heads, q_len, kv_len)
        self.matmul: set[tuple] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            self.linear.add((x.shape[0], w.shape[1], w.shape[0]))
        elif func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            self.sdpa.add((q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        elif func in (torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.matmul.add((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **kwargs)


CONTEXT_TOKENS, DECODE_ROWS = FIELDS.index("num_context_tokens"), FIELDS.index("num_generation_requests")


def drive(core: EngineCore, requests: int, seed: int = 0) -> int:
    """Mixed traffic: prompt lengths 1..400, outputs 1..24 tokens, n up to 3, some prompt
    logprobs and shared prefixes. Returns the number of distinct tokens-per-step seen."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 49000, 64).astype(np.int32)
    step_sizes = set()
    submitted = 0
    while submitted < requests or core.has_work:
        while submitted < requests and len(core.requests) < 24:
            n = int(rng.integers(1, 400))
            prompt = rng.integers(3, 49000, n).astype(np.int32)
            if rng.random() < 0.3:
                prompt = np.concatenate([shared, prompt])
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True,
                                    n=int(rng.choice([1, 1, 2, 3])),
                                    prompt_logprobs=1 if rng.random() < 0.1 else None)
            core.add_request(submitted * 10, prompt, params)
            submitted += 1
        before = core.stats.count
        core.step()
        if core.stats.count > before:
            row = core.stats.window(1)[0]
            step_sizes.add(int(row[CONTEXT_TOKENS] + row[DECODE_ROWS]))
    return len(step_sizes)


def test_bucket_is_small_close_and_monotonic():
    sizes = [bucket(n) for n in range(1, 8193)]
    assert all(b >= n for n, b in zip(range(1, 8193), sizes))
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert max(b / n for n, b in zip(range(1, 8193), sizes)) <= 1.125
    assert len(set(sizes)) == 16 + 8 * 9  # exact up to 16, then 8 per octave up to 8,192
    assert all(bucket(n, 16) % 16 == 0 and bucket(n, 16) >= n for n in range(1, 4097))
    assert len({bucket(n, 16) for n in range(1, 2049)}) <= 40


@pytest.mark.parametrize("backend", ["sdpa", "auto"])  # SDPA's shapes; leanserve's CPU kernels take any
def test_bf16_step_shapes_are_bounded(tiny, backend):
    config = EngineConfig(model=tiny, dtype="bfloat16", kv_cache_memory=32 << 20, max_num_seqs=32,
                          max_num_batched_tokens=512, attention_backend=backend)
    core = EngineCore.from_config(config.resolve())
    assert core.runner.pad_shapes
    log = ShapeLog()
    with log:
        distinct_steps = drive(core, 40)
    rows = {r for r, _, _ in log.linear}
    buckets = {bucket(n) for n in range(1025)}  # a step may pad a little past its token budget
    assert rows <= buckets, sorted(rows - buckets)
    assert distinct_steps > 10  # the traffic did vary the step's size
    # Decode attention is SDPA over whole blocks, or the kernel; no batched matmul whose shape follows the batch.
    assert not log.matmul
    # auto: prefill chunks too in leanserve's kernel.
    assert bool(log.sdpa) == (backend == "sdpa")
    q_lens = {bucket(n, 16) for n in range(1, 513)}
    for batch, heads, q_len, kv_len in log.sdpa:
        # whole (bucketed) blocks of context, or a chunk's own rows bucketed to multiples of 16
        assert kv_len % 16 == 0, (batch, heads, q_len, kv_len)
        if batch == 1 and heads == core.model.config.num_heads:  # a prefill chunk
            assert q_len in q_lens


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_padding_leaves_outputs_unchanged(tiny, backend):
    """fp32 (no padding by default) with padding forced on: the same greedy tokens and the same
    prompt logprobs, over chunked prefill, prefix hits, n > 1 and decode, in SDPA (chunks padded
    to bucketed rows and blocks) and in leanserve's CPU kernels (only the step's rows padded)."""
    def run(pad: bool):
        config = EngineConfig(model=tiny, dtype="float32", kv_cache_memory=32 << 20, max_num_batched_tokens=128,
                              attention_backend=backend)
        core = EngineCore.from_config(config.resolve())
        core.runner.pad_shapes = pad
        tokens: dict[int, list[int]] = {}
        plps: dict[int, list[np.ndarray]] = {}

        def emit(out):
            ids, toks, _, _ = out.arrays()
            for rid, tok in zip(ids.tolist(), toks.tolist()):
                tokens.setdefault(rid, []).append(tok)
            for rid, (lp, *_rest) in out.prompt_logprobs.items():
                plps.setdefault(rid, []).append(np.frombuffer(lp, np.float32))

        rng = np.random.default_rng(1)
        shared = rng.integers(3, 49000, 40).astype(np.int32)
        for i, n in enumerate([1, 5, 17, 150, 33, 300, 64, 2]):
            prompt = rng.integers(3, 49000, n).astype(np.int32)
            if i % 2:
                prompt = np.concatenate([shared, prompt])
            core.add_request(i * 10, prompt, SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True,
                                                            n=2 if i == 3 else 1,
                                                            prompt_logprobs=0 if i == 5 else None))
        while core.has_work:
            out = core.step()
            if out is not None:
                emit(out)
        return tokens, {k: np.concatenate(v) for k, v in plps.items()}

    plain, plain_lp = run(False)
    padded, padded_lp = run(True)
    assert plain == padded
    assert plain_lp.keys() == padded_lp.keys()
    for rid in plain_lp:
        np.testing.assert_allclose(padded_lp[rid], plain_lp[rid], atol=1e-4)


def test_decode_mask_table_is_bounded():
    table = DecodeMaskTable("cpu", max_width=256)
    for width in range(16, 1025, 16):
        mask = table(torch.tensor([1, width]), width)
        assert mask.shape == (2, width)
        assert torch.isinf(mask[0, 1:]).all() and not torch.isinf(mask[1]).any()
    assert table.table.shape[1] <= 256 and table.table.shape[0] <= 257
