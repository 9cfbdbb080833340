"""llguidance, the grammar library, behind the few calls the engine makes: a spec becomes grammar
text, grammar text becomes a matcher, matchers fill token bitmasks (all constrained rows of a
step in one call) and accept sampled tokens. No other module imports llguidance.

Why llguidance (measured here, SmolLM2's 49,152-token vocabulary, ``bench/results/structured.md``):
a JSON schema compiles to a matcher in ~0.4 ms and is validated in ~0.2 ms, a mask costs ~0.1 ms
per row, and it installs as one 3 MB wheel with no dependencies. xgrammar would pull triton,
transformers and apache-tvm-ffi into a CPU-only install.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

Matcher = llguidance.LLMatcher

# Whitespace allowed between JSON tokens unless the request says otherwise: llama.cpp's rule
# (none, a space, or one or two newlines and up to 20 spaces or tabs). Unbounded whitespace,
# vLLM's default, lets a model emit whitespace until max_tokens: a tiny random model did so in
# 3 of 3 samples of a 4-field schema here; with this rule 8 of 8 finished, in 30-65 tokens.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"


def grammar_text(spec) -> str:
    """A ``StructuredOutputsParams`` -> llguidance's grammar text. Raises ValueError for a spec
    that cannot be read (not one constraint, a JSON schema that is not JSON)."""
    kinds = spec.kinds
    if len(kinds) != 1:
        raise ValueError(f"give exactly one of json, regex, choice, grammar or json_object, got {kinds or 'none'}")
    if spec.disable_any_whitespace:
        options = {"whitespace_flexible": False}
    else:
        options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern or JSON_WHITESPACE}
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        if spec.disable_additional_properties and isinstance(schema, dict):
            schema = _closed_objects(schema)
        return Matcher.grammar_from_json_schema(schema, defaults=options)
    if spec.json_object:
        return Matcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.regex is not None:
        return Matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        if not spec.choice:
            raise ValueError("choice: must list at least one string")
        return llguidance.grammar_from("choice", spec.choice)
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or llama.cpp's GBNF


def grammar_error(spec) -> str | None:
    """Why the spec cannot constrain decoding (None: it can). No tokenizer needed: run by the
    API process before anything reaches the engine."""
    try:
        text = grammar_text(spec)
    except (ValueError, TypeError) as e:
        return str(e)
    error = Matcher.validate_grammar(text)
    return error or None


def load_tokenizer(tokenizers_json: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The matcher's view of the vocabulary, from a `tokenizers` JSON; ``vocab_size`` is the
    model's (the logits' width), which may exceed the tokenizer's. ~0.4 s for 49k tokens."""
    return llguidance.LLTokenizer(tokenizers_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def compile_matcher(tokenizer: llguidance.LLTokenizer, text: str) -> Matcher:
    """A matcher in its initial state; raises ValueError if the grammar is invalid. Drops the
    GIL while it builds."""
    matcher = Matcher(tokenizer, text, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


def fork(matcher: Matcher) -> Matcher:
    """An independent copy in the same state (~7 us): a compiled grammar serves many requests."""
    return matcher.deep_copy()


class BitmaskFiller:
    """Fills one bitmask row per matcher, all in one call that drops the GIL and spreads the rows
    over ``threads`` threads."""

    def __init__(self, threads: int):
        self._executor = llguidance.LLExecutor(num_threads=max(1, threads))

    def fill(self, matchers: list[Matcher], out: np.ndarray) -> None:
        """``out``: int32 [>= len(matchers), ceil(vocab / 32)], row i for matcher i; bit t of a
        row set = token t allowed."""
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(len(matchers)))), out)


def accept(matcher: Matcher, token_id: int) -> bool:
    """Advances the matcher by a sampled token; False if the grammar does not allow it."""
    return matcher.consume_token(token_id)


def is_terminated(matcher: Matcher) -> bool:
    """The grammar is complete and allows nothing more (but EOS)."""
    return matcher.is_stopped()


def _closed_objects(schema: dict) -> dict:
    """vLLM's ``disable_additional_properties``: objects with properties admit no others."""
    def walk(node):
        if isinstance(node, dict):
            node = {k: walk(v) for k, v in node.items()}
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)
