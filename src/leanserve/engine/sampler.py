"""Sampling all rows of a step in one batched call.

Greedy, temperature, top-k, top-p, min-p, repetition/presence/frequency penalties, min_tokens,
seeded rows and logprobs. Each optional stage runs only on the rows that need it, so the
common all-greedy batch costs one argmax. Random rows use the exponential race
(argmax p / q with q ~ Exp(1), equivalent to sampling from p); a seeded row draws its q from
its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [R] float32; 0 = greedy
    all_greedy: bool
    # Filled only when some row samples randomly:
    top_k: torch.Tensor | None = None  # [R] int64; 0 = off
    top_p: torch.Tensor | None = None  # [R] float32
    min_p: torch.Tensor | None = None  # [R] float32
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # rows with penalties: (row, prompt ids, output ids, repetition, presence, frequency)
    penalties: list[tuple[int, torch.Tensor, torch.Tensor, float, float, float]] = field(default_factory=list)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # rows under min_tokens: ids to mask
    max_num_logprobs: int = -1  # -1: no row wants logprobs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] float32, of the sampled token
    top_ids: torch.Tensor | None = None  # [R, k]
    top_logprobs: torch.Tensor | None = None  # [R, k]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax. On the CPU, numpy's SIMD argmax is ~9x faster than torch's (0.4 vs
    3.9 ms for 64 x 49,152 logits here): it matters as much as a layer of the forward."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, device="cpu", seed: int | None = None):
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        for row, ids in meta.banned:
            logits[row, ids] = float("-inf")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs >= 0 else None
        for row, prompt, output, rep, pres, freq in meta.penalties:
            _apply_penalties(logits[row], prompt, output, rep, pres, freq)

        if meta.all_greedy:
            tokens = argmax(logits)
        else:
            tokens = self._sample(logits, meta)
        return _with_logprobs(tokens, raw_logprobs, meta.max_num_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = argmax(logits)
        greedy = meta.temperature == 0
        temp = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp[:, None]
        if meta.any_top_k or meta.any_top_p:
            logits = _top_k_top_p(logits, meta.top_k, meta.top_p, meta.any_top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.any_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < meta.min_p[:, None] * top, 0.0)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        sampled = argmax(probs / q)
        return torch.where(greedy, greedy_tokens, sampled)


def _apply_penalties(row: torch.Tensor, prompt, output, rep: float, pres: float, freq: float) -> None:
    """vLLM / OpenAI semantics: repetition over prompt + output (divide positive logits, multiply
    negative ones); presence and frequency over the output only."""
    if rep != 1.0:
        seen = torch.unique(torch.cat((prompt, output)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if (pres or freq) and len(output):
        counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)
        row -= freq * counts + pres * (counts > 0).to(row.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_p: bool) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    if not any_top_p:
        # top-k only: a partial selection over the largest k in the batch, not a full sort.
        kmax = int(k.max())
        vals = logits.topk(kmax, dim=-1).values
        threshold = vals.gather(1, (k - 1).clamp(max=kmax - 1)[:, None])
        return logits.masked_fill(logits < threshold, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _with_logprobs(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, k: int) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(tokens)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    if k > 0:
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
        return SamplerOutput(tokens, chosen, top_ids, top_lp)
    return SamplerOutput(tokens, chosen)
