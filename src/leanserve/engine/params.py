"""Sampling parameters: what a request asks of the sampler and the stop checks.

Validation happens once, at enqueue, and raises ``ValueError`` naming the field; nothing invalid
enters the queue. Stop *strings* are a frontend concern (they need text); the engine stops on
token ids only.
"""

from __future__ import annotations

import msgspec


class StructuredOutputsParams(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """vLLM's ``structured_outputs``: exactly one constraint (``json`` schema, ``regex``,
    ``choice``, ``grammar`` (Lark or GBNF) or ``json_object``) plus options. It crosses to the
    engine as given; the engine compiles it (``engine/structured``), the API process validates it
    first (``structured.grammar_error``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @property
    def kinds(self) -> list[str]:
        """The constraint fields set (exactly one in a valid spec)."""
        return [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives besides the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        def bad(field: str, why: str):
            raise ValueError(f"{field}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > vocab_size:
            bad("top_k", f"must be -1, 0 (disabled) or in [1, {vocab_size}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            bad("seed", "must fit in 64 bits")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                bad("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and not 0 <= value <= max_logprobs:
                bad(name, f"must be in [0, {max_logprobs}], got {value}")
