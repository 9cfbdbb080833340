"""Structured outputs and tool calling through the official openai client against a live server
on a tiny random model: its text is noise, so output that parses and matches the schema shows
the constraint at work. Schemas are validated by jsonschema_rs, a validator nobody here wrote."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema_rs
import openai
import pydantic
import pytest

from .server_util import LiveServer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                                 "unit": {"enum": ["C", "F"]}},
                                "required": ["city", "unit"], "additionalProperties": False}},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
HI = [{"role": "user", "content": "Hi"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int
    member: bool


# A template that shows tools, calls and results the way Qwen2.5's does (--chat-template).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "32M", "--max-model-len", "1024",
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template),
                   "--max-logprobs", "5")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def person_format(strict=True):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


# ------------------------------------------------------------------------------ response_format


def test_json_schema_chat_streamed_and_not(client, model):
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=200, temperature=1.0, seed=1, n=3,
                                       response_format=person_format())
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema_rs.validate(PERSON, json.loads(c.message.content))
    chunks = list(client.chat.completions.create(model=model, messages=HI, max_tokens=200, temperature=0,
                                                 response_format=person_format(False), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema_rs.validate(PERSON, json.loads(text))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_parse_with_a_pydantic_model(client, model):
    r = client.beta.chat.completions.parse(model=model, messages=HI, max_tokens=200, temperature=0,
                                           response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_completions(client, model):
    r = client.completions.create(model=model, prompt="JSON:", max_tokens=200, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema_rs.validate(PERSON, json.loads(r.choices[0].text))
    r = client.completions.create(model=model, prompt="JSON:", max_tokens=100, temperature=0,
                                  extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # the noise may fill the object until max_tokens; what there is must be a prefix of one
        assert r.choices[0].text.startswith("{")


# ------------------------------------------------------------------------------ vLLM's structured_outputs


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
    ({"choice": ["yes", "no", "maybe not"]}, lambda t: t in ("yes", "no", "maybe not")),
    ({"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'},
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ({"grammar": 'root ::= "A" [0-9] [0-9] "Z"'}, lambda t: re.fullmatch(r"A[0-9]{2}Z", t)),  # llama.cpp's GBNF
])
def test_structured_outputs(client, model, constraint, check):
    for stream in (False, True):
        kw = dict(model=model, messages=HI, max_tokens=40, temperature=0.8, seed=3,
                  extra_body={"structured_outputs": constraint})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        assert check(text), text


def test_logprobs_stop_strings_and_length(client, model):
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=30, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"structured_outputs": {"regex": "[ab]{20}"}})
    content = r.choices[0].logprobs.content
    assert re.fullmatch("[ab]{20}", r.choices[0].message.content)
    assert all(t.token in ("a", "b") or set(t.token) <= {"a", "b"} for t in content)
    # masked alternatives have no probability (vLLM's -9999.0 stands in for -inf)
    assert all(set(a.token) <= {"a", "b"} or a.logprob == -9999.0 for t in content for a in t.top_logprobs)
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=30, temperature=0, stop=["b"],
                                       extra_body={"structured_outputs": {"regex": "a{3}b[ab]{20}"}})
    assert r.choices[0].message.content == "aaa" and r.choices[0].finish_reason == "stop"
    # a grammar that cannot be completed within max_tokens ends with "length"
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=5,
                                       extra_body={"structured_outputs": {"regex": "x{50}"}})
    assert r.choices[0].message.content == "x" * len(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------ tools


def _check_call(call, tools):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    jsonschema_rs.validate(spec[call.function.name], json.loads(call.function.arguments))


def test_named_tool_choice(client, model):
    kw = dict(model=model, messages=HI, max_tokens=100, temperature=0, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"  # OpenAI: named -> "stop"
    _check_call(call, [WEATHER])
    with client.beta.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert streamed.function.arguments == call.function.arguments


def test_required_tool_choice_streamed_and_not(client, model):
    kw = dict(model=model, messages=HI, max_tokens=200, temperature=0.7, seed=5, tools=[WEATHER, TIME],
              tool_choice="required", parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    _check_call(call, [WEATHER, TIME])
    with client.beta.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # parallel calls: the noise may go on adding calls until max_tokens; every call made is valid
    r = client.chat.completions.create(**{**kw, "parallel_tool_calls": True, "max_tokens": 120})
    assert r.choices[0].message.tool_calls
    for call in r.choices[0].message.tool_calls:
        _check_call(call, [WEATHER, TIME])


def test_auto_tool_choice_hermes(client, model):
    """The model's own format, forced here by a regex (a random model would never write it)."""
    said = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    kw = dict(model=model, messages=HI, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
              extra_body={"structured_outputs": {"regex": re.escape(said)}})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.content == "Let me check. " and r.choices[0].finish_reason == "tool_calls"
    (call,) = m.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    with client.beta.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Let me check. "
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    plain = client.chat.completions.create(model=model, messages=HI, max_tokens=5, temperature=0, tools=[WEATHER])
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tool_results_go_through_the_chat_template(client, model, server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=3, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "Current weather in a city" in text  # the tools, as the template shows them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\n21 degrees and sunny\n</tool_response>" in text


def test_max_logprobs_flag(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "logprobs": True,
                                                             "top_logprobs": 6}, timeout=30)
    assert r.status_code == 400 and "[0, 5]" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0.function.parameters"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    # and the server goes on serving
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_auto_tool_choice_flags_and_generation_config(tiny_chat_model, tmp_path):
    """Without --enable-auto-tool-choice, tools default to "auto" and are refused (vLLM's rule);
    --generation-config DIR supplies sampling defaults that request fields override."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 7,
                                                                 "eos_token_id": 2}))
    s = LiveServer(tiny_chat_model, "--kv-cache-memory", "16M", "--max-model-len", "512",
                   "--generation-config", str(tmp_path))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "tools": [WEATHER]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "tools": [WEATHER],
                                                             "tool_choice": "none"}, timeout=30)
        assert r.status_code == 200
        body = {"messages": HI, "ignore_eos": True}
        a, b = (httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30).json() for _ in range(2))
        assert a["usage"]["completion_tokens"] == 7 and a["choices"][0]["message"] == b["choices"][0]["message"]
        c = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 1.0,
                                                        "ignore_eos": True}, timeout=30).json()
        assert c["usage"]["completion_tokens"] == 3
    finally:
        assert s.stop() == 0


def test_chat_template_flag_reads_a_file_or_inline_source(tmp_path):
    from leanserve.tokenizer.chat_template import ChatTemplate, read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(path)) == "{{ messages[0].content }}"
    assert read_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="neither a file nor"):
        read_chat_template("no_such_file.jinja")
    with pytest.raises(ValueError, match="chat template: line 1"):
        ChatTemplate("{% for %}")
