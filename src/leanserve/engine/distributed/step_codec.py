"""A step's model input as the other ranks receive it: int64 words, no serialiser.

Every array of :class:`ModelInput` is int64 already, so a message is a 6-word header and the
arrays back to back: a decode step of 64 sequences at 256-token contexts is 838 words (6.7 KB)
with the CPU's 32-token blocks (1,350 with 16). Only what the forward reads is sent; sampling
settings stay on rank 0, the only rank that samples. A rank decodes views into its copy of the message and runs the very forward rank
0 runs, so every rank makes the same shape decisions (padding, which rows reach the head) and
the collectives line up.
"""

from __future__ import annotations

import numpy as np

from ..model_runner import ModelInput

HEADER = 6  # tokens, decode rows, block table width, prefill chunks, sampled rows, prompt-logprob chunks


def encode(inp: ModelInput) -> list[np.ndarray]:
    """The message's pieces, 1-D, in order (the writer copies them into place)."""
    rows, width = inp.decode_block_table.shape
    chunks = np.array([(start, n, ctx, len(blocks)) for start, n, ctx, blocks in inp.prefills], np.int64)
    lp = np.array([(rid, r0, len(t), k) for rid, r0, t, k in inp.prompt_logprob_rows], np.int64)
    header = np.array([inp.num_tokens, rows, width, len(inp.prefills), len(inp.logits_indices),
                       len(inp.prompt_logprob_rows)], np.int64)
    return [header, inp.input_ids, inp.positions, inp.slot_mapping, inp.decode_block_table.ravel(),
            inp.decode_seq_lens, inp.logits_indices, chunks.ravel(), *(blocks for *_, blocks in inp.prefills),
            lp.ravel(), *(t for _, _, t, _ in inp.prompt_logprob_rows)]


def decode(msg: np.ndarray) -> ModelInput:
    """The ModelInput ``msg`` carries (views into ``msg``; no sampling settings)."""
    t, d, w, p, r, lp = msg[:HEADER].tolist()
    off = HEADER

    def take(n: int) -> np.ndarray:
        nonlocal off
        off += n
        return msg[off - n : off]

    input_ids, positions, slot_mapping = take(t), take(t), take(t)
    block_table, seq_lens, logits_indices = take(d * w).reshape(d, w), take(d), take(r)
    chunks = take(4 * p).reshape(p, 4).tolist()
    prefills = [(start, n, ctx, take(nb)) for start, n, ctx, nb in chunks]
    lp_rows = take(4 * lp).reshape(lp, 4).tolist()
    prompt_logprob_rows = [(rid, r0, take(n), k) for rid, r0, n, k in lp_rows]
    return ModelInput(input_ids, positions, slot_mapping, block_table, seq_lens, prefills, logits_indices,
                      sampling=None, prompt_logprob_rows=prompt_logprob_rows)


def max_words(max_num_seqs: int, max_step_tokens: int, max_blocks: int) -> int:
    """The longest message a config can produce: every token row in three arrays (and once more
    as a prompt-logprob target), a full decode block table and, for each sequence, a prefill
    chunk with every block. ``max_step_tokens``: the most a step computes (the engine's
    ``max_prefill_tokens``, never below its chunk budget)."""
    t, s = max_step_tokens + max_num_seqs, max_num_seqs
    return HEADER + 4 * t + s * (max_blocks + 1) + t + s * (4 + max_blocks) + s * 4
