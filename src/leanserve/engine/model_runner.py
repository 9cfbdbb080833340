"""The executor interface: one call per step, ``ModelRunner.execute(ModelInput) -> ModelOutput``.

``ModelInput`` is numpy arrays plus the sampling metadata (torch tensors, and the seeded rows'
generators), everything the forward and the sampler need and nothing else, so the same call can
run in-process or be broadcast to worker ranks for tensor parallelism (``engine/distributed``:
every rank runs :meth:`ModelRunner.forward` on it, rank 0 also samples). Building it
(``build_model_input``) is the engine's job and reads only the scheduled batch and the
persistent batch arrays: decode rows are gathered with a few vectorised numpy ops; each
prefill chunk is one slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..model import kernels
from ..model.attention import (AttentionMetadata, DecodeMaskTable, GatherScratch, PagedDecode, bucket,
                               decode_groups)
from ..model.layer_ops import use_cpu_kernels
from ..model.prepack import packs_for_brgemm, prepack_linears
from ..model.transformer import Transformer
from .batch_state import BatchState, blocks_needed
from .kv_cache import KVCache
from .sampler import Sampler, SamplerOutput, SamplingMetadata
from .scheduler import ScheduledBatch
from .structured import GrammarBitmask


@dataclass
class ModelInput:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    decode_block_table: np.ndarray  # [D, max_blocks] int64
    decode_seq_lens: np.ndarray  # [D] int64
    prefills: list[tuple[int, int, int, np.ndarray]]  # (row start, length, context_len, block ids)
    logits_indices: np.ndarray  # [R] rows that sample, decode rows first
    sampling: SamplingMetadata | None  # None on tensor-parallel ranks other than 0, which never sample
    # prompt logprobs: (request id, first row, targets) -> logprob of each next prompt token
    prompt_logprob_rows: list[tuple[int, int, np.ndarray, int]] = field(default_factory=list)
    # Structured outputs: the sampling rows (indices into logits_indices) under a grammar, and
    # their matchers; the runner masks those rows' logits between the forward and the sampler.
    grammar_rows: np.ndarray | None = None
    grammars: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class ModelOutput:
    sampled: SamplerOutput
    forward_ms: float
    sample_ms: float
    grammar_ms: float = 0.0
    prompt_logprobs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    broadcast_ms: float = 0.0  # handing the input to the other tensor-parallel ranks


class ExecutorFailed(RuntimeError):
    """The executor can run no more steps (e.g. a tensor-parallel rank died): the engine stops."""


def build_model_input(b: BatchState, sched: ScheduledBatch) -> ModelInput:
    bs = b.block_size
    d = sched.decode_slots
    num_d = len(d)
    total = num_d + sched.num_prefill_tokens
    input_ids = np.empty(total, np.int64)
    positions = np.empty(total, np.int64)
    slot_mapping = np.empty(total, np.int64)

    # Decode rows: a handful of vectorised gathers over the persistent batch.
    pos_d = b.num_computed[d]
    input_ids[:num_d] = b.last_token[d]
    positions[:num_d] = pos_d
    slot_mapping[:num_d] = b.block_table[d, pos_d // bs] * bs + pos_d % bs
    seq_lens = pos_d + 1
    width = int(blocks_needed(seq_lens.max(), bs)) if num_d else 0
    decode_bt = b.block_table[d, :width]

    # Prefill chunks: one slice each (a step holds few: the token budget bounds them).
    prefills = []
    sample_rows, prompt_lp_rows = [], []
    row = num_d
    for req, start, n, samples in sched.prefills:
        s = req.slot
        end = start + n
        pos = np.arange(start, end)
        input_ids[row : row + n] = b.tokens(req, start, end)
        positions[row : row + n] = pos
        slot_mapping[row : row + n] = b.block_table[s, pos // bs] * bs + pos % bs
        prefills.append((row, n, end, b.block_table[s, : blocks_needed(end, bs)]))
        if req.params.prompt_logprobs is not None:
            last = min(end, req.num_prompt_tokens - 1)  # positions that predict a prompt token
            if last > start:
                targets = np.asarray(req.prompt[start + 1 : last + 1], np.int64)
                prompt_lp_rows.append((req.request_id, row, targets, req.params.prompt_logprobs))
        if samples:
            sample_rows.append(row + n - 1)
        row += n
    logits_indices = np.arange(num_d)
    if sample_rows:
        logits_indices = np.concatenate((logits_indices, sample_rows))
    constrained = b.constrained[sched.sample_slots]
    grammar_rows = np.flatnonzero(constrained) if constrained.any() else None
    return ModelInput(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        decode_block_table=decode_bt,
        decode_seq_lens=seq_lens,
        prefills=prefills,
        logits_indices=logits_indices,
        sampling=_sampling_metadata(b, sched.sample_slots),
        prompt_logprob_rows=prompt_lp_rows,
        grammar_rows=grammar_rows,
        grammars=[] if grammar_rows is None else [b.requests[s].grammar for s in sched.sample_slots[grammar_rows]],
    )


def _sampling_metadata(b: BatchState, slots: np.ndarray) -> SamplingMetadata:
    temp = b.temperature[slots]
    random_rows = temp > 0
    meta = SamplingMetadata(temperature=torch.from_numpy(temp), all_greedy=not random_rows.any())
    if not meta.all_greedy:
        top_k, top_p, min_p = b.top_k[slots], b.top_p[slots], b.min_p[slots]
        meta.top_k, meta.top_p, meta.min_p = torch.from_numpy(top_k), torch.from_numpy(top_p), torch.from_numpy(min_p)
        meta.any_top_k = bool((random_rows & (top_k > 0)).any())
        meta.any_top_p = bool((random_rows & (top_p < 1)).any())
        meta.any_min_p = bool((random_rows & (min_p > 0)).any())
        for row in np.flatnonzero(b.seeded[slots]):
            meta.generators[int(row)] = b.requests[slots[row]].generator
    if not b.special[slots].any():
        return meta
    meta.max_num_logprobs = int(b.num_logprobs[slots].max())
    for row in np.flatnonzero(b.penalized[slots]):
        s = slots[row]
        req = b.requests[s]
        meta.penalties.append((
            int(row), torch.from_numpy(req.prompt.astype(np.int64)), torch.from_numpy(b.output_tokens(s).astype(np.int64)),
            float(b.repetition_penalty[s]), float(b.presence_penalty[s]), float(b.frequency_penalty[s]),
        ))
    under_min = b.num_tokens[slots] < b.min_total[slots]
    for row in np.flatnonzero(under_min):  # min_tokens: stop ids (EOS included) cannot be sampled yet
        meta.banned.append((int(row), [int(t) for t in b.stop_ids[slots[row]] if t >= 0]))
    return meta


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with zeros appended up to ``n`` entries (``a`` itself when it has them)."""
    if len(a) >= n:
        return a
    out = np.zeros(n, a.dtype)
    out[: len(a)] = a
    return out


def default_pad_shapes(model: Transformer, device: torch.device) -> bool:
    """Whether steps should be padded to bucketed shapes: where the kernels are cached per
    shape, i.e. bf16/fp16 on the CPU (oneDNN matmuls, brgemm SDPA); fp32 runs on MKL there,
    which caches nothing per shape, so padding would only cost."""
    return device.type == "cpu" and model.embed_tokens.weight.dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels attention runs in (``--attention-backend``, see ``model/kernels``); None: SDPA."""

    decode: Callable | None = None  # decode rows, each against its own blocks (PagedDecode)
    prefill: Callable | None = None  # one prefill chunk against its blocks (AttentionMetadata.prefill_kernel)
    write: Callable | None = None  # the step's keys and values into the cache (AttentionMetadata.write_kv)


def attention_kernels(backend: str, model: Transformer, kv_cache: KVCache, device: torch.device) -> AttentionKernels:
    """leanserve's CPU attention kernels for this model and cache. ``auto`` takes each kernel
    where it applies (the CPU, float32 or bfloat16, shapes within its limits) and builds, SDPA
    elsewhere; ``cpu-paged`` takes both, raising ValueError where either does not apply or build;
    ``sdpa`` takes none."""
    if backend == "sdpa":
        return AttentionKernels()
    cfg, dtype = model.config, kv_cache.tensor.dtype
    why_not = (f"runs on the CPU, not {device}" if device.type != "cpu" else
               f"takes float32 or bfloat16, not {dtype}" if dtype not in kernels.DTYPES else None)
    why_not_decode = why_not or ("takes at most 128 heads of at most 256 dimensions and blocks of at most 256 "
                                 "tokens" if cfg.num_heads > 128 or cfg.head_dim > 256 or kv_cache.block_size > 256
                                 else None)
    why_not_prefill = why_not or ("takes heads of a multiple of 16 dimensions, at most 256"
                                  if cfg.head_dim % 16 or cfg.head_dim > 256 else None)
    decode = kernels.paged_decode_attention() if why_not_decode is None else None
    prefill = kernels.paged_prefill_attention() if why_not_prefill is None else None
    if backend == "cpu-paged":
        for kernel, why, what in ((decode, why_not_decode, "decode"), (prefill, why_not_prefill, "prefill")):
            if kernel is None:
                raise ValueError(f"attention_backend (--attention-backend): cpu-paged {what} attention "
                                 f"{why or 'did not build here (see the log)'}")
    # The cache write comes with the decode kernel's library, wherever that builds (why_not: the
    # CPU, float32 or bfloat16); it has no limit on shapes of its own.
    write = kernels.write_kv() if why_not is None else None
    return AttentionKernels(decode, prefill, write)


class ModelRunner:
    # Why no step can run any more; a runner over several ranks sets it (see engine/distributed).
    failure: str | None = None

    def __init__(self, model: Transformer, kv_cache: KVCache, device="cpu", seed: int | None = None,
                 pad_shapes: bool | None = None, grammar_bitmask: GrammarBitmask | None = None,
                 attention_backend: str = "auto"):
        self.model = model
        self.grammar_bitmask = grammar_bitmask
        self.kv = kv_cache
        self.device = torch.device(device)
        dtype = model.embed_tokens.weight.dtype
        if self.device.type == "cpu" and dtype in kernels.DTYPES:
            # Built side by side, not one after another where each is first asked for.
            attention = () if attention_backend == "sdpa" else ("paged_decode_attention", "paged_prefill_attention")
            kernels.build_together(("layer_ops",) + attention
                                   + (("brgemm_linear",) if packs_for_brgemm(model, self.device) else ()))
        prepack_linears(model, self.device)  # bf16 on the CPU: weights in the GEMM's layout, once
        use_cpu_kernels(model.ops, self.device, dtype)  # norms, rotary, SiLU
        self.gather_scratch = GatherScratch()  # every step's layers gather keys and values into it
        self.sampler = Sampler(self.device, seed)
        self.decode_masks = DecodeMaskTable(self.device, dtype=dtype)
        self.attention = attention_kernels(attention_backend, model, kv_cache, self.device)
        # Bounded shapes (see model/attention.py): the step's token rows, the rows reaching the
        # output head and, in SDPA, each prefill chunk's query rows and key blocks are padded to
        # buckets.
        self.pad_shapes = default_pad_shapes(model, self.device) if pad_shapes is None else pad_shapes

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> ModelOutput:
        """One step: the forward, grammar masks on its logits, then sampling (and prompt logprobs)."""
        args = self.prepare(inp)
        # Grammar masks: filled while the forward runs where that pays (see GrammarBitmask).
        masks = self.grammar_bitmask.start_fill(inp.grammars) if inp.grammars else None
        t0 = time.perf_counter()
        logits = self.run_model(*args)
        t1 = t2 = time.perf_counter()
        n_sample = len(inp.logits_indices)
        if masks is not None:  # the time the grammar adds after the forward: the fill's rest, the apply
            self.grammar_bitmask.apply(logits[:n_sample], inp.grammar_rows, masks())
            t2 = time.perf_counter()
        prompt_lps = self._prompt_logprobs(logits[n_sample:], inp.prompt_logprob_rows) if inp.prompt_logprob_rows else {}
        sampled = self.sampler(logits[:n_sample], inp.sampling)
        t3 = time.perf_counter()
        return ModelOutput(sampled, (t1 - t0) * 1e3, (t3 - t2) * 1e3, (t2 - t1) * 1e3, prompt_lps)

    def shutdown(self) -> None:
        """Stops what the runner started: nothing here; the other ranks of a tensor-parallel one."""

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> None:
        """A step's forward without sampling: what tensor-parallel ranks other than 0 run."""
        self.run_model(*self.prepare(inp))

    def run_model(self, input_ids, positions, meta: AttentionMetadata, rows, num_logits: int) -> torch.Tensor | None:
        """float32 logits of the rows that sample, then of the prompt-logprob rows; None on a
        tensor-parallel rank other than 0."""
        logits = self.model(input_ids, positions, self.kv.tensor, meta, rows)
        if logits is not None and len(logits) != num_logits:
            logits = logits[:num_logits]
        return logits

    def prepare(self, inp: ModelInput) -> tuple:
        """The model's arguments for ``inp`` (tensors on the device, attention metadata) and the
        number of logit rows wanted: :meth:`run_model`'s arguments."""
        num_decode = len(inp.decode_block_table)
        bs = self.kv.block_size
        pad = self.pad_shapes
        prefills = inp.prefills
        num_rows = inp.num_tokens
        if pad and self.attention.prefill is None:
            # SDPA's shapes: context block ids padded with the null block (masked), and enough
            # rows after each chunk for its bucketed query rows. The prefill kernel takes any.
            prefills = [(start, n, ctx, blocks if n == ctx else _padded(blocks, bucket(len(blocks))))
                        for start, n, ctx, blocks in prefills]
            for start, n, _, _ in prefills:
                num_rows = max(num_rows, start + bucket(n, 16))
        if pad:
            num_rows = bucket(num_rows)
        paged = groups = None
        if num_decode and self.attention.decode is not None:
            paged = PagedDecode(self.attention.decode, self._t(inp.decode_block_table).contiguous(),
                                self._t(inp.decode_seq_lens).contiguous())
        elif num_decode:
            groups = decode_groups(inp.decode_block_table, inp.decode_seq_lens, bs, self.decode_masks, self._t, pad)
        meta = AttentionMetadata.build(
            self._t(inp.slot_mapping),
            groups,
            int(inp.decode_seq_lens.max()) if num_decode else 0,
            [(start, n, ctx, self._t(blocks)) for start, n, ctx, blocks in prefills],
            bs if pad else None,
            self.gather_scratch,
            paged,
            self.attention.prefill,
            self.attention.write,
        )
        rows = inp.logits_indices
        extra = [np.arange(r0, r0 + len(t)) for _, r0, t, _ in inp.prompt_logprob_rows]
        if extra:
            rows = np.concatenate([rows, *extra])
        num_logits = len(rows)
        # All rows sample (a pure decode step): no gather of hidden states before the head.
        if num_logits == inp.num_tokens and not extra:
            rows_t = None
        else:
            rows_t = self._t(_padded(rows, bucket(num_logits)) if pad else rows)
        input_ids, positions = inp.input_ids, inp.positions
        if num_rows != inp.num_tokens:
            input_ids, positions = _padded(input_ids, num_rows), _padded(positions, num_rows)
        return self._t(input_ids), self._t(positions), meta, rows_t, num_logits

    @staticmethod
    def _prompt_logprobs(logits, chunks):
        out, off = {}, 0
        for request_id, _, targets, k in chunks:
            lp = torch.log_softmax(logits[off : off + len(targets)], dim=-1)
            off += len(targets)
            chosen = lp.gather(1, torch.from_numpy(targets)[:, None]).squeeze(1)
            top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            out[request_id] = (chosen.numpy(), top_ids.numpy().astype(np.int32), top_lp.numpy())
        return out
