"""Tensor parallelism (``--tensor-parallel-size``): each rank's share of the checkpoint, the
split model against the whole one (logits), the per-step channel, and engines and a live server
at TP=2 against TP=1 (greedy tokens, logprobs), with the ranks started by the code under test."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import gguf
import httpx
import numpy as np
import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.engine.config import EngineConfig
from leanserve.engine.distributed import step_codec
from leanserve.engine.distributed.channel import StepChannel
from leanserve.engine.distributed.group import DistributedGroup, open_store
from leanserve.engine.distributed.shm_ring import SLOTS, ChannelClosed, RingReader, RingWriter
from leanserve.engine.model_runner import ModelInput
from leanserve.engine.params import StructuredOutputsParams
from leanserve.model import ModelSpec, load_model
from leanserve.model.attention import AttentionMetadata
from leanserve.model.parallel import TensorParallel

from .gguf_util import tiny_llama, write_llama_gguf
from .server_util import LiveServer, is_error_event
from .test_checkpoints import ALL_TYPES
from .test_engine import assert_same_greedy, prompts_of
from .test_int4 import write_tiny_q4

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)


class Share(TensorParallel):
    """A rank's place without a group: enough to load its share."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


# ------------------------------------------------------------------------------ loading shares


def _whole_and_shares(spec: ModelSpec, size: int = 2):
    return load_model(spec), [load_model(spec, Share(r, size)) for r in range(size)]


def _check_shares(whole, shares) -> None:
    """Every rank holds exactly its Megatron share of every weight of ``whole``."""
    cfg, size = whole.config, len(shares)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    vocab_rows = -(-cfg.vocab_size // size)
    for r, part in enumerate(shares):
        rows = lambda n: slice(r * n // size, (r + 1) * n // size)  # noqa: E731
        vocab = whole.embed_tokens.weight[r * vocab_rows : (r + 1) * vocab_rows]
        assert torch.equal(part.embed_tokens.weight[: len(vocab)], vocab)
        assert not part.embed_tokens.weight[len(vocab) :].any()  # the last rank's padding
        if not cfg.tie_word_embeddings:
            assert torch.equal(part.lm_head.weight[: len(vocab)], whole.lm_head.weight[r * vocab_rows : (r + 1) * vocab_rows])
        for a, b in zip(whole.layers, part.layers):
            qw, kw, vw = a.self_attn.qkv_proj.weight.split([q, kv, kv])
            assert torch.equal(b.self_attn.qkv_proj.weight, torch.cat((qw[rows(q)], kw[rows(kv)], vw[rows(kv)])))
            if a.self_attn.qkv_proj.bias is not None:
                qb, kb, vb = a.self_attn.qkv_proj.bias.split([q, kv, kv])
                assert torch.equal(b.self_attn.qkv_proj.bias, torch.cat((qb[rows(q)], kb[rows(kv)], vb[rows(kv)])))
            assert torch.equal(b.self_attn.o_proj.weight, a.self_attn.o_proj.weight[:, rows(q)])
            gate, up = a.mlp.gate_up_proj.weight.split([inter, inter])
            assert torch.equal(b.mlp.gate_up_proj.weight, torch.cat((gate[rows(inter)], up[rows(inter)])))
            assert torch.equal(b.mlp.down_proj.weight, a.mlp.down_proj.weight[:, rows(inter)])
            assert torch.equal(b.input_layernorm.weight, a.input_layernorm.weight)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}),
                                             ("llama", {"vocab_size": 49153})],
                         ids=["llama", "tied-qwen2-bias", "qwen3-qk-norm", "odd-vocab"])
def test_safetensors_shares(arch, overrides, tiny_model_dir):
    _check_shares(*_whole_and_shares(ModelSpec.resolve(tiny_model_dir(arch, **overrides), "float32")))


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, default_model):
    """Every quantization type, Q and K rows permuted as llama.cpp writes them. Matrices take the
    types in turn (embedding, then q, k, v, o, gate, up, down per layer): layer 0's o_proj is
    Q4_K, whose 256-column blocks straddle its row-parallel split (128 | 128), its down_proj
    Q4_K split on a block boundary (256 | 256)."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf")
    q = gguf.GGMLQuantizationType
    types = [q.F32, q.Q8_0, q.Q4_0, q.Q4_1, q.Q4_K, q.Q5_K, q.Q6_K, q.Q4_K, q.F16, q.BF16]
    assert set(types) == set(ALL_TYPES)
    write_llama_gguf(path, tiny_llama(hidden=256, layers=2), default_model, types)
    return path


def test_gguf_shares_read_only_their_blocks(mixed_gguf):
    _check_shares(*_whole_and_shares(ModelSpec.resolve(mixed_gguf, "float32")))


def test_int4_shares(tmp_path, default_model):
    """``--quantization gguf``: each rank's 4-bit blocks, from the same file, give the same
    products as the whole layer's rows (column-parallel) or partial sums (row-parallel)."""
    spec = ModelSpec.resolve(write_tiny_q4(str(tmp_path / "q4.gguf"), default_model, tied=False), "bfloat16",
                             quantization="gguf")
    whole, shares = _whole_and_shares(spec)
    x = torch.randn(3, whole.config.hidden_size, dtype=torch.bfloat16)
    full = whole.layers[0].self_attn.qkv_proj(x)
    q = whole.config.num_heads * whole.config.head_dim
    assert torch.equal(shares[0].layers[0].self_attn.qkv_proj(x)[:, : q // 2], full[:, : q // 2])
    inter = whole.config.intermediate_size
    h = torch.randn(3, inter, dtype=torch.bfloat16)
    parts = [s.layers[0].mlp.down_proj(h[:, r * inter // 2 : (r + 1) * inter // 2]) for r, s in enumerate(shares)]
    want = whole.layers[0].mlp.down_proj(h).float()
    # Each partial sum is rounded to bf16 on its own: agreement to bf16's precision of the output.
    torch.testing.assert_close(parts[0].float() + parts[1].float(), want, rtol=0, atol=1e-2 * want.abs().max().item())


# ------------------------------------------------------------------------------ the split model


def _logits(model, ids: list[int]) -> torch.Tensor | None:
    """All-position logits of one prompt (one prefill), through the paged attention path."""
    cfg = model.config
    block, n = 16, len(ids)
    kv = torch.zeros(cfg.num_layers, 2, -(-n // block) + 1, cfg.num_kv_heads // model.tp.size, block, cfg.head_dim)
    meta = AttentionMetadata.build(torch.arange(block, block + n), None, 0, [(0, n, n, None)])
    return model(torch.tensor(ids), torch.arange(n), kv, meta)


def split_logits(spec: ModelSpec, ids: list[int], size: int = 2) -> torch.Tensor:
    """Rank 0's logits of a model split over ``size`` gloo ranks, here as threads of this process
    (each rank its own group object over one store, as in separate processes)."""
    store, rdv = open_store("127.0.0.1", size)
    out = {}

    def rank(r):
        from torch.distributed import TCPStore

        s = store if r == 0 else TCPStore(rdv.host, rdv.port, size, is_master=False)
        group = DistributedGroup(s, r, size, torch.device("cpu"), "127.0.0.1")
        out[r] = _logits(load_model(spec, group), ids)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[1] is None
    return out[0]


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}),
                                             ("llama", {"vocab_size": 49153})],
                         ids=["llama", "tied-qwen2-bias", "qwen3-qk-norm", "odd-vocab"])
def test_split_model_logits_equal_the_whole(arch, overrides, tiny_model_dir):
    spec = ModelSpec.resolve(tiny_model_dir(arch, **overrides), "float32")
    ids = prompts_of([37])[0].tolist()
    assert_logits_close(split_logits(spec, ids), _logits(load_model(spec), ids))


def test_split_gguf_model_logits_equal_the_whole(mixed_gguf):
    spec = ModelSpec.resolve(mixed_gguf, "float32")
    ids = prompts_of([21])[0].tolist()
    assert_logits_close(split_logits(spec, ids), _logits(load_model(spec), ids))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: the split changes only the order of the sums over the split dimensions, so the
    logits agree to a few float32 ulps of their own scale (these random models' reach ~100)."""
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


# ------------------------------------------------------------------------------ the step channel


def _step_input(seed: int) -> ModelInput:
    rng = np.random.default_rng(seed)
    t, d = 40, 3
    ints = lambda n: rng.integers(0, 1000, n).astype(np.int64)  # noqa: E731
    return ModelInput(ints(t), ints(t), ints(t), ints(d * 5).reshape(d, 5), ints(d),
                      [(3, 20, 52, ints(4)), (23, 17, 17, ints(2))], ints(5), sampling=None,
                      prompt_logprob_rows=[(7, 23, ints(16), 2)])


def test_step_codec_round_trip():
    inp = _step_input(0)
    got = step_codec.decode(np.concatenate([p.ravel() for p in step_codec.encode(inp)]))
    for name in ("input_ids", "positions", "slot_mapping", "decode_block_table", "decode_seq_lens", "logits_indices"):
        assert np.array_equal(getattr(got, name), getattr(inp, name)), name
    assert [(a, b, c, d.tolist()) for a, b, c, d in got.prefills] == [(a, b, c, d.tolist()) for a, b, c, d in inp.prefills]
    assert [(a, b, c.tolist(), d) for a, b, c, d in got.prompt_logprob_rows] == \
        [(a, b, c.tolist(), d) for a, b, c, d in inp.prompt_logprob_rows]


def test_shm_ring_delivers_every_message_in_order_then_closes():
    words = 4096
    writer = RingWriter(readers=2, slot_words=words)
    got = [[], []]

    def read(i):
        reader = RingReader(writer.name, i, 2, words)
        try:
            while True:
                got[i].append(reader.read())
        except ChannelClosed:
            reader.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    sent = [np.arange(n, dtype=np.int64) * n for n in range(1, 5 * SLOTS)]  # wraps around the slots
    for msg in sent:
        writer.write([msg[:1], msg[1:]])
    time.sleep(0.1)
    writer.close()
    for t in threads:
        t.join(5)
    for g in got:
        assert [m.tolist() for m in g] == [m.tolist() for m in sent]


def test_channel_reaches_ranks_here_by_the_ring_and_elsewhere_by_socket():
    channel = StepChannel([True, False, True], 256, "127.0.0.1")
    assert [spec.address is None for spec in channel.specs] == [True, False, True]
    got = [[] for _ in channel.specs]

    def read(i):
        reader = channel.specs[i].reader(alive=lambda: True)
        try:
            while True:
                got[i].append(reader.read().tolist())
        except ChannelClosed:
            reader.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    sent = [np.arange(n, dtype=np.int64) for n in range(1, 12)]
    for msg in sent:
        channel.send([msg])
    time.sleep(0.2)
    channel.close()
    for t in threads:
        t.join(5)
    assert got == [[m.tolist() for m in sent]] * 3


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("size, message", [
    (2, "tensor_parallel_size (--tensor-parallel-size): 2 does not divide the model's 9 attention heads"),
    (4, "tensor_parallel_size (--tensor-parallel-size): 4 ranks for the model's 3 KV heads"),
    (0, "tensor_parallel_size (--tensor-parallel-size): must be >= 1, got 0"),
])
def test_sizes_the_model_cannot_take_fail_at_start_up(default_model, size, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=default_model, tensor_parallel_size=size).resolve()


@pytest.mark.parametrize("backend, device, message", [
    ("mpi", "cpu", "distributed_executor_backend (--distributed-executor-backend): 'mpi'; choose one of mp, ray"),
    ("ray", "cuda", "distributed_executor_backend (--distributed-executor-backend): ray places CPU ranks and "
                    "engines only"),
])
def test_bad_backends_fail_at_start_up(backend, device, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend=backend, device=device).validate()


def test_kv_transfer_with_tensor_parallel_fails_at_start_up():
    from leanserve.engine.kv_transfer.config import KVTransferConfig

    kv = KVTransferConfig.from_json('{"kv_connector": "ZmqConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match=r"kv_transfer \(--kv-transfer-config\): not supported with "
                                         r"--tensor-parallel-size > 1"):
        EngineConfig(tensor_parallel_size=2, kv_transfer=kv).validate()


def test_bad_size_is_one_line_from_the_cli(default_model):
    r = subprocess.run([sys.executable, "-m", "leanserve.cli", "serve", default_model, "-tp", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("leanserve: error: tensor_parallel_size (--tensor-parallel-size): "
                                                 "2 does not divide the model's 9 attention heads")


# ------------------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", 16 << 20)
    return LLM(path, **kw)


def _same_outputs(got, want, tol=1e-4):
    """Greedy tokens equal (but at exact ties, see assert_same_greedy), and every logprob of the
    shared tokens within ``tol``."""
    got, want = [o.outputs[0] for o in got], [o.outputs[0] for o in want]
    assert_same_greedy(got, want)
    for a, b in zip(got, want):
        for x, y in zip(a.logprobs, b.logprobs):
            if x["token_id"] != y["token_id"]:
                break
            assert abs(x["logprob"] - y["logprob"]) < tol
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]


def test_engine_at_tp2_matches_tp1(tiny):
    """Chunked prefill (64-token budget), prompt logprobs, then prefix hits (a second batch
    sharing 80 tokens with the first; prompt logprobs skip the prefix cache) through the ranks."""
    first = prompts_of([3, 150, 17, 64, 65, 90, 1, 33])
    second = [np.concatenate((first[1][:80], p)) for p in prompts_of([5, 12], seed=1)]
    kw = dict(max_num_batched_tokens=64, max_num_seqs=16)
    with_prompt_lps = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    with make_llm(tiny, **kw) as one:
        want = one.generate(first, with_prompt_lps) + one.generate(second, GREEDY)
    with make_llm(tiny, tensor_parallel_size=2, **kw) as two:
        got = two.generate(first, with_prompt_lps) + two.generate(second, GREEDY)
        stats = two.engine.stats.summary()
        hits = two.engine.scheduler.prefix_hits
    _same_outputs(got, want)
    for a, b in zip(got[: len(first)], want):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(x[0] - y[0]) < 1e-4
    assert hits > 0 and stats["broadcast_ms"]["p50"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_at_tp2_matches_tp1_other_architectures(arch, tiny_model_dir):
    """And a structured output: rank 0 masks the gathered logits of the constrained row."""
    path = tiny_model_dir(arch)
    prompts = prompts_of([5, 40, 23])
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=16, logprobs=3,
                                             structured_outputs=StructuredOutputsParams(regex="[a-z]{4,12}"))]
    with make_llm(path) as one:
        want = one.generate(prompts, params)
    with make_llm(path, tensor_parallel_size=2) as two:
        got = two.generate(prompts, params)
    _same_outputs(got, want)
    assert got[2].outputs[0].finish_reason == "stop" and got[2].outputs[0].text.isalpha()


def test_default_model_at_tp3_matches_tp1(default_model, default_tokenizer):
    """The real checkpoint (GGUF, Q4_1 layers and a Q8_0 embedding read per rank), split three
    ways (its 9 heads and 3 KV heads allow 1 or 3)."""
    prompts = [default_tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    with make_llm(default_model) as one:
        want = one.generate(prompts, params)
    with make_llm(default_model, tensor_parallel_size=3) as three:
        got = three.generate(prompts, params)
    _same_outputs(got, want, tol=1e-3)


def test_a_dead_rank_fails_requests_with_its_name(tiny):
    llm = make_llm(tiny, tensor_parallel_size=2)
    try:
        (stream,) = llm.client.submit(prompts_of([8])[0], SamplingParams(max_tokens=2000, ignore_eos=True))
        events = iter(stream)
        next(events)
        os.kill(llm.engine.runner.ranks.pids[0], signal.SIGKILL)
        t = time.monotonic()
        last = None
        for last in events:
            pass
        assert time.monotonic() - t < 10
        assert last.error and "tensor-parallel rank 1" in last.error and "SIGKILL" in last.error, last
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            llm.generate([prompts_of([4])[0]], GREEDY)
    finally:
        llm.close()


# ------------------------------------------------------------------------------ live servers


ARGS = ("--kv-cache-memory", "16M")
PROMPTS = [f"Count with me: {i}, {i + 1}," for i in range(4)]


def completions(url: str, **extra) -> list:
    body = {"max_tokens": 12, "temperature": 0, "logprobs": 2} | extra
    out = []
    for p in PROMPTS:
        r = httpx.post(url + "/v1/completions", json=body | {"prompt": p}, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        out.append((c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
    return out


def rank_pids(server: LiveServer) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.engine_pid())], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "leanserve.engine.distributed" in line]


def test_live_server_at_tp2_matches_tp1_and_a_dead_rank_fails_requests(tiny_chat_model):
    with ThreadPoolExecutor(2) as pool:
        two, one = pool.map(lambda extra: LiveServer(tiny_chat_model, *ARGS, *extra), (("-tp", "2"), ()))
    try:
        try:
            want = completions(one.url)
        finally:
            one.stop()
        got = completions(two.url)
        assert [(t, toks) for t, toks, _ in got] == [(t, toks) for t, toks, _ in want]
        for (_, _, a), (_, _, b) in zip(got, want):
            assert np.allclose(a, b, atol=1e-4)
        (rank,) = rank_pids(two)

        async def main():
            async with httpx.AsyncClient(base_url=two.url, timeout=60) as c:
                body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as st:
                    lines = st.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    os.kill(rank, signal.SIGKILL)
                    error = None
                    async for line in lines:
                        if is_error_event(line):
                            error = line
                    assert error and "tensor-parallel rank 1" in error, error
                deadline = time.monotonic() + 10
                while (await c.get("/health")).status_code == 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert (await c.get("/health")).status_code == 503
                r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                assert r.status_code == 503

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        two.stop()


# ------------------------------------------------------------------------------ Ray


def test_ray_ranks_match_local_ones_and_a_dead_actor_fails_requests(tiny, ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    prompts = prompts_of([5, 40, 23, 77])
    with make_llm(tiny, tensor_parallel_size=2) as local:
        want = local.generate(prompts, GREEDY)
    llm = make_llm(tiny, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        got = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        (stream,) = llm.client.submit(prompts_of([8])[0], SamplingParams(max_tokens=1000, ignore_eos=True))
        events = iter(stream)
        next(events)
        os.kill(llm.engine.runner.ranks.pids[0], signal.SIGKILL)
        last = None
        for last in events:
            pass
        assert last.error and "tensor-parallel rank 1" in last.error, last
    finally:
        llm.close()
