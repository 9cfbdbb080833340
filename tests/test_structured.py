"""Structured outputs inside the engine: the masking logic without a model (real grammars and
the default model's tokenizer, llguidance's own mask application as the reference), then the
engine on a tiny random model: constrained rows beside unconstrained ones, n > 1, preemption,
prefix caching, grammars compiling while others run, and failures that stay in their request."""

from __future__ import annotations

import json
import threading
import time

import jsonschema_rs
import llguidance
import llguidance.numpy
import numpy as np
import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.engine.params import StructuredOutputsParams as Spec
from leanserve.engine.structured import GrammarBitmask, GrammarCompiler, backend, grammar_error
from leanserve.engine.structured.bitmask import apply_numpy, apply_torch, bias_table, bitmask_width
from leanserve.server.protocol import ChatCompletionRequest
from leanserve.server.structured_outputs import constraint, resolve_tool_choice
from leanserve.server.protocol import APIError
from leanserve.server.tool_calls import HermesParser, NamedFunctionParser, RequiredParser, parse_all

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ll_tokenizer(default_tokenizer):
    return backend.load_tokenizer(default_tokenizer.backend.to_str(), VOCAB, list(default_tokenizer.eos_token_ids))


def allowed(mask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))


# ---------------------------------------------------------------------------------- masks, no model


@pytest.mark.parametrize("apply", [apply_numpy, apply_torch])
@pytest.mark.parametrize("vocab", [VOCAB, 1000])  # 1000: the last word only partly used
def test_bitmask_application_matches_llguidance(apply, vocab):
    rng = np.random.default_rng(0)
    width = bitmask_width(vocab)
    logits = torch.from_numpy(rng.standard_normal((6, vocab), dtype=np.float32))
    mask = rng.integers(-2**31, 2**31, (6, width), dtype=np.int64).astype(np.int32)
    mask[1] = 0  # nothing allowed
    mask[2] = -1  # everything allowed
    for rows in (np.arange(6), np.array([1, 3, 4])):
        got = logits.clone()
        apply(got, rows, mask[: len(rows)], bias_table(got.device, got.dtype), torch.empty(len(rows) * width * 32))
        want = logits.numpy().copy()
        sub = want[rows]
        llguidance.numpy.apply_token_bitmask_inplace(sub, mask[: len(rows)])
        want[rows] = sub
        assert np.array_equal(got.numpy(), want)


def test_batched_fill_follows_the_grammar(ll_tokenizer, default_tokenizer):
    """One call fills every matcher's row, each the same as filling it alone; a valid document's
    tokens are always allowed, and once it is complete only EOS is."""
    template = backend.compile_matcher(ll_tokenizer, backend.grammar_text(Spec(json=SCHEMA, disable_any_whitespace=True)))
    doc = default_tokenizer.encode('{"name":"Ann","n":42,"ok":true}', add_special_tokens=False).tolist()
    matchers = [backend.fork(template) for _ in range(4)]
    for i, m in enumerate(matchers):
        assert all(backend.accept(m, t) for t in doc[: i * 3])
    bitmask = GrammarBitmask(8, VOCAB, 2)
    batched = bitmask.fill(matchers).copy()
    for i, m in enumerate(matchers):
        alone = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
        llguidance.numpy.fill_next_token_bitmask(m, alone)
        assert np.array_equal(batched[i], alone[0])
        assert doc[i * 3] in allowed(batched[i])
    overlapped = GrammarBitmask(8, VOCAB, 1, overlap=True).start_fill(matchers)  # on its own thread
    assert np.array_equal(overlapped(), batched)
    m = backend.fork(template)
    for t in doc:
        assert t in allowed(bitmask.fill([m])[0]) and backend.accept(m, t)
    assert backend.is_terminated(m)
    assert allowed(bitmask.fill([m])[0]).tolist() == [default_tokenizer.eos_token_ids[0]]


def test_compiler_caches_by_spec_and_forks_independent_matchers(ll_tokenizer):
    compiler = GrammarCompiler(lambda: ll_tokenizer)
    a = compiler.compile(Spec(choice=["yes", "no"]), n=2).result()
    b = compiler.compile(Spec(choice=["yes", "no"])).result()
    assert len(compiler._cache) == 1 and len(a) == 2 and len(b) == 1
    assert backend.accept(a[0], ll_tokenizer.tokenize_str("yes")[0])
    assert not backend.is_terminated(a[1]) and not backend.is_terminated(b[0])  # untouched by a[0]
    with pytest.raises(ValueError, match="regex"):
        compiler.compile(Spec(regex="(")).result()
    compiler.shutdown()


def test_grammar_errors_name_the_problem():
    assert grammar_error(Spec(json=SCHEMA)) is None
    assert grammar_error(Spec(json=json.dumps(SCHEMA))) is None
    assert grammar_error(Spec(regex=r"\d+")) is None
    assert grammar_error(Spec(grammar='root ::= "a"+')) is None  # GBNF
    assert "objekt" in grammar_error(Spec(json={"type": "objekt"}))
    assert "not valid JSON" in grammar_error(Spec(json="{"))
    assert "regex" in grammar_error(Spec(regex="(a"))
    assert "exactly one" in grammar_error(Spec(regex="a", choice=["b"]))
    assert "exactly one" in grammar_error(Spec())
    assert grammar_error(Spec(grammar="start: ((")) is not None


# ---------------------------------------------------------------------------------- tool calls, no model


def chunked(parser, text: str, size: int):
    content, calls = "", []
    for i in range(0, len(text), size):
        c, d = parser.feed(text[i: i + size])
        content, calls = content + c, calls + d
    c, d = parser.finish()
    return content + c, [(x.index, x.name, x.arguments) for x in calls + d]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_hermes_parser_streamed_in_any_pieces(size):
    text = ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>y"}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call> trailing')
    content, calls = chunked(HermesParser(), text, size)
    # a "</tool_call>" inside a JSON string ends the tag (as in vLLM's regex): that call is not JSON
    assert content == "Sure. " and calls == [(0, "g", "{}")]
    content, calls = chunked(HermesParser(), 'Hi <tool_call>{"name": "f", "arguments": {"k": [1, 2]}}', size)
    assert content == "Hi " and calls == [(0, "f", '{"k": [1, 2]}')]  # unclosed at the end still counts
    assert chunked(HermesParser(), "a < b <tool", size) == ("a < b <tool", [])
    assert chunked(HermesParser(), "x <tool_call>not json</tool_call> y", size) == ("x ", [])
    assert chunked(HermesParser(), "x <tool_call>not json", size) == ("x ", [])


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_and_named_parsers(size):
    text = '[{"name": "f", "parameters": {"s": "a}]\\"{"}}, {"name": "g", "parameters": {}}]'
    assert chunked(RequiredParser(), text, size) == ("", [(0, "f", '{"s": "a}]\\"{"}'), (1, "g", "{}")])
    assert chunked(RequiredParser(), '[{"name": "f", "para', size) == ('[{"name": "f", "para', [])  # cut off
    content, calls = chunked(NamedFunctionParser("f"), '{"x": 1}', size)
    assert content == "" and calls[0][:2] == (0, "f") and "".join(c[2] for c in calls) == '{"x": 1}'
    assert parse_all(NamedFunctionParser("f"), '{"x": 1}')[1][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_tool_choice_rules_and_the_required_schema():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}

    def req(**kw):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)

    assert resolve_tool_choice(req(), False) == "none"
    assert resolve_tool_choice(req(tools=[tool]), True) == "auto"
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        resolve_tool_choice(req(tools=[tool]), False)
    r = req(tools=[tool], tool_choice="required", parallel_tool_calls=False)
    schema = constraint(r, resolve_tool_choice(r, False)).json
    assert schema["$defs"] == {"P": {"type": "integer"}} and schema["maxItems"] == 1
    jsonschema_rs.validate(schema, [{"name": "f", "parameters": {"p": 3}}])
    assert not jsonschema_rs.is_valid(schema, [{"name": "f", "parameters": {"p": "x"}}])
    named = req(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert constraint(named, resolve_tool_choice(named, False)).json == tool["function"]["parameters"]


# ---------------------------------------------------------------------------------- the engine, tiny model


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory=32 << 20, max_model_len=512) as llm:
        yield llm


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_a_constraint_does_not_change_its_neighbours_output(llm):
    """Same batch, same shapes; only the second request's constraint differs."""
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]
    free = llm.generate(prompts, [greedy(), greedy()])
    constrained = llm.generate(prompts, [greedy(), greedy(structured_outputs=Spec(json=SCHEMA))])
    assert constrained[0].outputs[0].token_ids == free[0].outputs[0].token_ids
    jsonschema_rs.validate(SCHEMA, json.loads(constrained[1].outputs[0].text))
    assert constrained[1].outputs[0].finish_reason == "stop"  # ended when the grammar completed


def test_n_samples_logprobs_and_stats(llm):
    before = llm.engine.stats.count
    out = llm.generate([[3, 4, 5]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=80, logprobs=2,
                                                    structured_outputs=Spec(json=SCHEMA)))[0]
    texts = [o.text for o in out.outputs]
    assert len(set(texts)) > 1
    for o in out.outputs:
        jsonschema_rs.validate(SCHEMA, json.loads(o.text))
        assert all(lp["logprob"] > float("-inf") for lp in o.logprobs)
    rows = llm.engine.stats.window(llm.engine.stats.count - before)
    grammar = llm.engine.stats.column(rows, "grammar_ms")
    assert (grammar > 0).all()  # every step had constrained rows: its grammar phase was measured
    plain_before = llm.engine.stats.count
    llm.generate([[3, 4, 5]], greedy(5))
    assert (llm.engine.stats.column(llm.engine.stats.window(llm.engine.stats.count - plain_before), "grammar_ms")
            == 0).all()


def test_preemption_and_prefix_cache_keep_outputs_valid(tiny_model_dir):
    """A pool too small for all of them: requests are preempted and recomputed (mostly from the
    prefix cache); their matchers hold the output tokens kept across the preemption."""
    shared = list(range(100, 164))
    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory=256 << 10, max_model_len=256,
             block_size=16) as small:
        outs = small.generate([shared + [i] for i in range(12)],
                              SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=100,
                                             structured_outputs=Spec(json=SCHEMA)))
        assert small.engine.scheduler.num_preemptions > 0 and small.engine.scheduler.prefix_hits > 0
    for o in outs:
        for c in o.outputs:
            jsonschema_rs.validate(SCHEMA, json.loads(c.text))


def test_a_compiling_grammar_holds_back_no_other_request(llm):
    core = llm.engine
    gate = threading.Event()
    real = core.grammars
    tokenizer = real._tokenizer.result()
    core.grammars = GrammarCompiler(lambda: (gate.wait(30), tokenizer)[1])
    try:
        slow = llm.client.submit(np.arange(10, 20, dtype=np.int32), greedy(20, structured_outputs=Spec(regex="[a-z]+")))
        aborted = llm.client.submit(np.arange(10, 20, dtype=np.int32), greedy(20, structured_outputs=Spec(regex="a+")))
        t0 = time.monotonic()
        free = llm.generate([[1, 2, 3]], greedy(20))[0]  # runs to the end while both wait
        assert len(free.outputs[0].token_ids) == 20 and time.monotonic() - t0 < 20
        llm.client.abort([aborted[0].request_id])
        assert [ev.finish_reason.openai for ev in aborted[0]][-1] == "abort"
        gate.set()
        events = list(slow[0])
        assert events[-1].finish_reason.openai in ("stop", "length") and len(events) > 1
        # a grammar the engine cannot compile (the API would have refused it) ends its own request
        (bad,) = llm.client.submit(np.arange(10, 20, dtype=np.int32), greedy(5, structured_outputs=Spec(regex="(")))
        (ev,) = list(bad)
        assert ev.finish_reason.openai == "error" and "regex" in ev.error
        assert llm.generate([[1, 2, 3]], greedy(3))[0].outputs[0].finish_reason == "length"
    finally:
        gate.set()
        core.grammars.shutdown()
        core.grammars = real
    assert not core.has_work
