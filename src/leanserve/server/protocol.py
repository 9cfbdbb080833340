"""OpenAI request schemas (plus vLLM's extra sampling fields) and the OpenAI error object."""

from __future__ import annotations

import json
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine.params import SamplingParams

MAX_N = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or error_type(status)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.status), status_code=self.status)


class InvalidString(ValueError):
    """A string field that cannot be text (a lone UTF-16 surrogate, which JSON's \\u escapes can
    express but UTF-8, the tokenizer and the wire format cannot). ``param`` is the field's path."""

    def __init__(self, param: str):
        super().__init__(f"{param}: contains a lone surrogate code point, which is not valid Unicode text")
        self.param = param


def _check_strings(value, path: str) -> None:
    # One walk over the raw JSON before any field is used; a body is bounded by the server's
    # body-size limit, so this is O(body).
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidString(path or "body") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}.{i}" if path else str(i))


class _Body(BaseModel):
    """Every request body: strings are checked to be valid text before anything reads them."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        _check_strings(data, "")
        return data


def error_type(status: int) -> str:
    if status >= 500:
        return "service_unavailable" if status == 503 else "server_error"
    return {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")


def error_body(message: str, type_: str, param: str | None, code: int | str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type(status), param, status), status_code=status, headers=headers)


def bad_request_from(e: ValueError) -> APIError:
    """Engine/params validation errors read 'field: why'; the field becomes the error's param."""
    msg = str(e)
    field = msg.split(":", 1)[0] if ":" in msg and " " not in msg.split(":", 1)[0] else None
    return APIError(400, msg, field)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # ``schema`` would shadow BaseModel.schema
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (engine.params.StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict | None = Field(default=None, alias="json")  # ``json`` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def fields(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName
class KVTransferParams(BaseModel):
    """vLLM's ``kv_transfer_params`` (disaggregated serving; ignored by a server without
    ``--kv-transfer-config``). On a request to a prefill worker: ``do_remote_decode``; in its
    answer, and on the request to a decode worker: where the prompt's KV waits."""

    model_config = ConfigDict(extra="ignore")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: int | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    # Not vLLM's: the lease's epoch (stale ids are refused), and the prompt tokens the prefill
    # worker served from its prefix cache (the usage's cached_tokens, as a single server reports).
    remote_epoch: int | None = None
    remote_num_cached_tokens: int = 0


class _SamplingFields(_Body):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    kv_transfer_params: KVTransferParams | None = None

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
        if self.n < 1 or self.n > MAX_N:
            raise APIError(400, f"n: must be between 1 and {MAX_N}, got {self.n}", "n")

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """``defaults``: the server's (``--generation-config``) for the fields the request left unset."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = defaults or {}

        def pick(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates read the arguments as a mapping (Qwen's: ``arguments | tojson``), as
            # vLLM and transformers hand them over.
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: rendered by templates that show tools
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
