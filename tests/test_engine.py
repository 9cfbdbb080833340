"""The executor: batch invariance, chunked prefill, prefix caching, preemption, abort, seeds,
validation and sampling features, driven through the real engine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.engine.request import FinishReason
from leanserve.engine.stats import FIELDS
from leanserve.model import ModelSpec, load_model
from leanserve.model import attention
from leanserve.model.attention import split_decode_rows

from .test_model import dense_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", 16 << 20)
    return LLM(path, **kw)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49000, size=n).astype(np.int32) for n in lengths]


def alone(llm, prompts, params):
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def wait_idle(llm, timeout=10.0):
    end = time.monotonic() + timeout
    while llm.engine.has_work and time.monotonic() < end:
        time.sleep(0.01)


def assert_same_greedy(got, ref, tol=1e-4):
    """Greedy outputs (CompletionOutputs with logprobs >= 2) agree token for token, except that
    two may part ways at an exact tie: where the reference's top two logprobs are within ``tol``
    (float32 rounding differs between batch shapes, and on this Xeon a random model hit a
    1e-5 tie), the rest of that sequence is a different continuation by nature. Any other
    difference fails."""
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        if a.token_ids == b.token_ids:
            continue
        k = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top = b.logprobs[k]["top"]
        assert {a.token_ids[k], b.token_ids[k]} <= {t for t, _ in top[:2]} and top[0][1] - top[1][1] < tol, (
            f"prompt {i} differs at token {k}, not at a tie: {a.logprobs[k]} vs {b.logprobs[k]}")


def test_batch_invariance_with_chunked_prefill(tiny):
    # Budget 64 tokens per step: prompts up to 150 tokens are split across iterations.
    lengths = [3, 150, 17, 64, 65, 90, 1, 33] * 4
    prompts = prompts_of(lengths)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    with make_llm(tiny, max_num_batched_tokens=64, max_num_seqs=32, enable_prefix_caching=False) as llm:
        together = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.stats.summary()["num_context_tokens"]["p99"] <= 64
        assert_same_greedy(together, [llm.generate([p], params)[0].outputs[0] for p in prompts])


@pytest.mark.parametrize("backend", ["sdpa", "cpu-paged"])
def test_short_sequences_decoded_beside_a_long_one_give_what_they_give_alone(tiny, monkeypatch, backend):
    """Short sequences decoded beside a long one decode the same greedy tokens as each sequence
    alone: with gathered keys (sdpa) in a short group and a long one (one long context would pad
    them all to its length); with the in-place kernel (cpu-paged), which pads nothing."""
    splits = []

    def recording_split(seq_lens, block_size):
        parts = split_decode_rows(seq_lens, block_size)
        splits.append(parts is not None)
        return parts

    monkeypatch.setattr(attention, "split_decode_rows", recording_split)
    prompts = prompts_of([900, 5, 12, 3, 30, 7, 9, 20])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with make_llm(tiny, max_num_seqs=8, attention_backend=backend) as llm:
        together = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert any(splits) if backend == "sdpa" else not splits
        assert_same_greedy(together, [llm.generate([p], params)[0].outputs[0] for p in prompts])


def test_batch_invariance_default_model(default_model, default_tokenizer):
    texts = ["The capital of France is", "Write a haiku about the sea.\n", "1, 2, 3, 4,", "In 1492, Columbus"]
    prompts = [default_tokenizer.encode(t) for t in texts]
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with make_llm(default_model, max_num_batched_tokens=8) as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        assert together == alone(llm, prompts, p)


def test_prefix_cache_computes_only_the_rest(tiny):
    shared = prompts_of([160])[0]
    a = np.concatenate([shared, prompts_of([7], seed=1)[0]])
    b = np.concatenate([shared, prompts_of([9], seed=2)[0]])
    with make_llm(tiny) as ref_llm:
        expected = alone(ref_llm, [b], GREEDY)[0]
    with make_llm(tiny) as llm:
        llm.generate([a], GREEDY)
        before = llm.engine.scheduler.prompt_tokens_total
        out = llm.generate([b], GREEDY)[0]
        computed = llm.engine.scheduler.prompt_tokens_total - before
    assert out.num_cached_tokens == 160  # five full 32-token blocks (the CPU default)
    assert computed == len(b) - 160
    assert out.outputs[0].token_ids == expected
    assert llm.engine.scheduler.prefix_hits >= 160


def test_prefix_cache_eviction_under_small_pool(tiny):
    # 12 blocks of 16 tokens: each request needs ~6, so cached blocks are evicted constantly.
    prompts = prompts_of([70, 70, 70, 70], seed=3)
    prompts += [np.concatenate([prompts[0][:64], prompts_of([5], seed=9)[0]])]  # a prefix of an evicted one
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * kv * block * kv_heads * head_dim * fp32
    with make_llm(tiny, enable_prefix_caching=False) as ref_llm:
        expected = alone(ref_llm, prompts, GREEDY)
    with make_llm(tiny, kv_cache_memory=13 * block_bytes, max_num_seqs=2, block_size=16) as llm:
        assert llm.engine.kv.pool.num_blocks == 13
        got = alone(llm, prompts, GREEDY) + [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.kv.pool.num_used == 0
    assert got == expected + expected


def test_preemption_keeps_outputs(tiny):
    prompts = prompts_of([40, 45, 50, 55, 60, 35], seed=4)
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    with make_llm(tiny) as ref_llm:
        expected = alone(ref_llm, prompts, p)
    # 16 usable blocks; 6 requests growing to ~6 blocks each cannot all stay resident.
    with make_llm(tiny, kv_cache_memory=17 * block_bytes, max_num_seqs=6, block_size=16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.pool.num_used == 0
    assert got == expected


def test_abort_frees_every_block(tiny):
    with make_llm(tiny) as llm:
        p = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [llm.client.submit(x, p)[0] for x in prompts_of([100, 200, 300], seed=5)]
        for s in streams:  # every request is running and holding blocks
            next(iter(s))
        assert llm.engine.kv.pool.num_used > 0
        llm.client.abort([s.request_id for s in streams])
        reasons = [list(s)[-1].finish_reason for s in streams]
        assert reasons == [FinishReason.ABORT] * 3
        wait_idle(llm)
        assert llm.engine.kv.pool.num_used == 0
        assert not llm.engine.requests and not llm.engine.scheduler.running


def test_seeded_request_is_reproducible_across_batches(tiny):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    target = prompts_of([12], seed=6)[0]
    with make_llm(tiny) as llm:
        a = llm.generate([target], p)[0].outputs[0].token_ids
        b = llm.generate([*prompts_of([30, 5, 60], seed=7), target], [noise, noise, noise, p])[-1].outputs[0].token_ids
        c = llm.generate([target], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=99,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("max_tokens", dict(max_tokens=0)),
        ("temperature", dict(temperature=-0.5)),
        ("top_p", dict(top_p=0.0)),
        ("top_k", dict(top_k=-3)),
        ("min_p", dict(min_p=1.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("presence_penalty", dict(presence_penalty=3.0)),
        ("frequency_penalty", dict(frequency_penalty=-2.5)),
        ("n", dict(n=0)),
        ("min_tokens", dict(min_tokens=50, max_tokens=10)),
        ("stop_token_ids", dict(stop_token_ids=[10**7])),
        ("logprobs", dict(logprobs=1000)),
    ],
)
def test_bad_parameters_name_the_field(tiny, field, kwargs):
    with make_llm(tiny) as llm:
        with pytest.raises(ValueError, match=f"^{field}:"):
            llm.generate([prompts_of([5])[0]], SamplingParams(**kwargs))
        assert not llm.engine.has_work  # nothing entered the queue


def test_bad_prompts(tiny):
    with make_llm(tiny, max_model_len=64) as llm:
        with pytest.raises(ValueError, match="^prompt: is empty"):
            llm.generate([[]], GREEDY)
        with pytest.raises(ValueError, match="^prompt:"):
            llm.generate([prompts_of([64])[0]], GREEDY)
        with pytest.raises(ValueError, match="^max_tokens:"):
            llm.generate([prompts_of([60])[0]], SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="^prompt: token ids"):
            llm.generate([[1, 2, 10**9]], GREEDY)
        assert not llm.engine.has_work


def test_enqueue_holds_the_prompt_without_copying(tiny):
    from leanserve.engine.config import EngineConfig
    from leanserve.engine.core import EngineCore

    core = EngineCore.from_config(EngineConfig(model=tiny, dtype="float32", kv_cache_memory=16 << 20).resolve())
    prompt = prompts_of([40000])[0]
    core.max_model_len = 50000  # the tiny model's context is shorter; only the enqueue path runs here
    core.add_request(7, prompt, SamplingParams(max_tokens=1))
    core._fetch()
    assert core.requests[7].prompt is prompt  # the caller's int32 array itself: no copy, no list
    with pytest.raises(ValueError, match="^prompt: must be a 1-D int32"):
        core.add_request(8, prompt.tolist(), SamplingParams())


def test_stop_token_ids_max_tokens_and_min_tokens(tiny):
    prompt = prompts_of([10], seed=8)[0]
    with make_llm(tiny) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
        assert free.finish_reason == "length" and len(free.token_ids) == 12
        stop_at = free.token_ids[5]
        first = free.token_ids.index(stop_at)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))[0]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == free.token_ids[: first + 1]
        later = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at],
                                                      min_tokens=first + 1))[0].outputs[0]
        assert len(later.token_ids) > first + 1 and stop_at not in later.token_ids[: first + 1]


def test_logprobs_and_prompt_logprobs_match_dense_forward(tiny):
    prompt = prompts_of([20], seed=10)[0]
    model = load_model(ModelSpec.resolve(tiny, "float32"))
    ref = torch.log_softmax(dense_logits(model, prompt.tolist()), dim=-1)
    with make_llm(tiny) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, prompt_logprobs=2))[0]
    first = out.outputs[0].logprobs[0]
    assert first["token_id"] == out.outputs[0].token_ids[0] == int(ref[-1].argmax())
    assert abs(first["logprob"] - float(ref[-1].max())) < 1e-4
    assert [t for t, _ in first["top"]] == ref[-1].topk(3).indices.tolist()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        lp, top = out.prompt_logprobs[pos]
        assert abs(lp - float(ref[pos - 1, prompt[pos]])) < 1e-4
        assert len(top) == 2


def test_n_samples_share_prompt_blocks(tiny):
    prompt = prompts_of([100], seed=11)[0]
    with make_llm(tiny) as llm:
        out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5))[0]
        assert len(out.outputs) == 3
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # distinct samples
        assert llm.engine.scheduler.prefix_hits >= 2 * 96  # siblings reuse the six full blocks


def test_penalties_and_top_k_run(tiny):
    # The penalty arithmetic is checked exactly in test_sampler.py; here, that the engine hands
    # each row its own prompt and output tokens. The tiny model never repeats itself unprompted,
    # so the penalties here are negative: they reward repeats, and change what it says.
    # Presence and frequency penalties shift logits, hence logprobs, by the same amount: each
    # token of a penalised greedy run is the argmax of (its step's raw top logprobs + the reward
    # of the tokens output before it).
    prompt = prompts_of([10], seed=12)[0]
    pres, freq = -2.0, -2.0
    with make_llm(tiny) as llm:
        rep = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=0.1,
                                                    ignore_eos=True))[0].outputs[0].token_ids
        penalised = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=freq,
                                                          presence_penalty=pres, logprobs=20,
                                                          ignore_eos=True))[0].outputs[0]
        topk = llm.generate([prompt], SamplingParams(temperature=0.7, top_k=1, max_tokens=16, min_p=0.1,
                                                     ignore_eos=True))[0].outputs[0].token_ids
        greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    assert topk == greedy  # top_k=1 is greedy
    assert len(set(greedy)) == len(greedy) and not set(greedy) & set(prompt.tolist())
    # Repetition (over prompt and output): the rewarded run repeats tokens seen before.
    assert rep != greedy
    assert any(t in prompt.tolist() or t in rep[:i] for i, t in enumerate(rep))
    tokens = penalised.token_ids
    assert tokens != greedy and len(set(tokens)) < len(tokens)
    for i, step in enumerate(penalised.logprobs):
        raw = dict(step["top"]) | {step["token_id"]: step["logprob"]}
        before = tokens[:i]
        score = {t: lp - freq * before.count(t) - pres * (t in before) for t, lp in raw.items()}
        assert tokens[i] == max(score, key=score.get), i


def test_iteration_stats_are_recorded(tiny):
    with make_llm(tiny) as llm:
        t0 = time.time()
        llm.generate(prompts_of([10, 20, 30]), GREEDY)
        t1 = time.time()
        s = llm.engine.stats.summary()
        rows = llm.engine.stats.window()
    col = {name: rows[:, i] for i, name in enumerate(FIELDS)}
    # Each iteration's start on the wall clock, in order and within the call.
    began = col["start_time_s"]
    assert t0 <= began[0] and began[-1] <= t1 and (np.diff(began) * 1e3 >= col["host_step_ms"][:-1] - 0.5).all()
    assert "start_time_s" not in s  # a time stamp has no percentiles
    assert s["iterations"]["count"] == len(rows) >= 24
    # Every prompt token is computed once; each request decodes 23 rows after its prefill gave
    # it its first token (however the three arrivals split over iterations).
    assert col["num_context_tokens"].sum() == 60
    assert col["num_generation_requests"].sum() == 3 * (GREEDY.max_tokens - 1)
    assert col["num_new_requests"].sum() == 3
    assert (col["forward_ms"] > 0).all()
    phases = sum(col[n] for n in ("fetch_ms", "schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "output_ms"))
    assert (phases <= col["host_step_ms"] + 1e-6).all()  # the phases are disjoint parts of the step
    assert col["num_running"][-1] == 0 and col["num_waiting"][-1] == 0 and col["kv_blocks_used"][-1] == 0
    for name in ("host_step_ms", "forward_ms"):
        assert s[name]["p50"] == pytest.approx(float(np.percentile(col[name], 50)))


def test_stream_yields_the_same_text_as_generate(tiny):
    prompt = prompts_of([12], seed=13)[0]
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with make_llm(tiny) as llm:
        full = llm.generate([prompt], p)[0].outputs[0]
        deltas = list(llm.stream(prompt, p))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finish_reason == "length"


def _cli(*args, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "leanserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_cli_generate_and_chat(tiny_chat_model):
    gen = _cli("generate", "Hello there", tiny_chat_model, "--dtype", "float32", "--max-tokens", "8",
               "--kv-cache-memory", "16M")
    assert gen.returncode == 0, gen.stderr
    with LLM(tiny_chat_model, dtype="float32", kv_cache_memory=16 << 20) as llm:
        expected = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert gen.stdout == expected + "\n"
    chat = _cli("chat", tiny_chat_model, "--dtype", "float32", "--max-tokens", "6", "--kv-cache-memory", "16M",
                stdin="hi\nand again\n\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("> ") >= 2  # answered both turns, then quit on the empty line


def test_cli_bad_model_is_one_line():
    r = _cli("generate", "x", "/nonexistent/model.gguf")
    assert r.returncode == 2
    assert r.stderr.strip() == "leanserve: error: model path does not exist: /nonexistent/model.gguf"


def test_stop_strings_offline(default_model):
    p = SamplingParams(temperature=0.0, max_tokens=16)
    with make_llm(default_model) as llm:
        full = llm.generate("Count: 1, 2, 3,", p)[0].outputs[0]
        stop = full.text.strip().split(",")[1]
        ps = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop])
        out = llm.generate("Count: 1, 2, 3,", ps)[0].outputs[0]
        streamed = list(llm.stream("Count: 1, 2, 3,", ps))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert "".join(d.text for d in streamed) == out.text and streamed[-1].finish_reason == "stop"


def test_vllm_style_offline_calls(tiny_chat_model):
    """What vLLM users write: ``sampling_params=``, TokensPrompt/TextPrompt dicts, ``chat``."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_chat_model, dtype="float32", kv_cache_memory=16 << 20) as llm:
        ids = llm.tokenizer.encode("Hello there").tolist()
        by_ids = llm.generate([{"prompt_token_ids": ids}], sampling_params=sp)[0]
        by_text = llm.generate({"prompt": "Hello there"}, sampling_params=sp)[0]
        assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
        assert len(by_ids.outputs[0].token_ids) == 6 and by_ids.prompt is None and by_text.prompt == "Hello there"
        with pytest.raises(ValueError, match="prompt"):
            llm.generate({"prompt": "a", "prompt_token_ids": [1]}, sampling_params=sp)
        chat = llm.chat([{"role": "user", "content": "Hi"}], sampling_params=sp)[0]
        assert list(chat.prompt_token_ids) == list(llm.chat_prompt([{"role": "user", "content": "Hi"}]))
        assert len(chat.outputs[0].token_ids) == 6


def test_a_script_that_never_closes_llm_exits_cleanly(tiny_chat_model):
    import subprocess
    import sys

    script = ("from leanserve import LLM, SamplingParams\n"
              f"llm = LLM({tiny_chat_model!r}, dtype='float32', kv_cache_memory=16 << 20)\n"
              "print(llm.generate('Hi', SamplingParams(max_tokens=4))[0].outputs[0].finish_reason)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "length", r.stderr
    assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr
