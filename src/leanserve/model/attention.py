"""Attention over a paged KV cache for a flat batch that mixes decode tokens and prefill chunks.

The batch is laid out decode tokens first (one per sequence), then prefill chunks back to back.
Decode rows are attended by a kernel that reads each row's blocks in place where one is given
(:class:`PagedDecode`: leanserve's CPU kernel, ``model/kernels``); else in one SDPA call over
keys gathered block-wise from the cache, every row's keys padded to the longest context among
them, or where that would waste most of the work (one long context among short ones) in two
(:func:`split_decode_rows`). Each prefill chunk is attended on its own (a step holds few of
them: the token budget bounds it): by a kernel that reads its blocks in place where one is
given (``prefill_kernel``), else by SDPA, causal over the chunk or against its gathered context.

Everything that depends only on the batch shape (masks, gathered block ids) is built once per
step in :class:`AttentionMetadata` and shared by all layers.

Shapes are kept to a bounded set where kernels are cached per shape. On the CPU, bf16/fp16
matmuls run through oneDNN, which JITs and keeps a kernel per problem shape (~0.2-0.6 MB each,
up to 1,024 in its primitive cache plus 1,024 in ideep's), and bf16/fp16 SDPA through brgemm
micro-kernels kept in a cache with no bound, keyed by query and key block sizes. With shapes
that follow the data (tokens per step, chunk and context lengths, one more key per decoded
token) a mixed workload kept creating kernels, and the churn of the full LRU caches kept
fragmenting the heap: the engine grew by 1.36 GB over 600 mixed requests here. So with
padding on (``block_size`` given to :meth:`AttentionMetadata.build`; the model runner's
``pad_shapes``), prefill chunks attend a bucketed number of query rows (see :func:`bucket`)
and whole, bucketed key blocks; decode rows always attend whole blocks, in SDPA, whose
kernels do not depend on the number of rows. leanserve's own CPU kernels (``paged_decode``,
``prefill_kernel``) compile nothing per shape: their rows and keys go unpadded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .kv_layout import keys_from_cache, stored_keys


def bucket(n: int, multiple: int = 1) -> int:
    """``n`` rounded up to one of a few sizes: multiples of ``multiple``, and at most 8 sizes
    per octave above 8 * ``multiple`` (so at most 12.5 % more than ``n``): 1..15, 16, 18, ..,
    30, 32, 36, .., 60, 64, 72, .. for ``multiple`` 1. Every distinct shape a step hands to the
    backend costs a cached kernel, for good: this keeps their number logarithmic in the size."""
    step = max(multiple, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens in this step."""

    start: int  # first row of the chunk in the flat batch
    length: int  # tokens in the chunk
    context_len: int  # tokens in the cache after this step (prior context + chunk)
    # Blocks holding the context; for SDPA None when the chunk is the whole context (attended over
    # its own keys), for the prefill kernel always given
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None  # [q_len, kv_len] bool for SDPA; None when plain causal over the chunk, or the kernel
    q_len: int = 0  # query rows attended (>= length in SDPA: padded with the rows after the chunk)
    kv_len: int = 0  # keys attended: context_len, or in SDPA whole blocks (padded ones masked)


@dataclass
class DecodeGroup:
    """Decode rows attended in one call, each row's keys padded to the group's longest context."""

    rows: torch.Tensor | None  # [n] long: which of the step's decode rows; None: all of them, in order
    block_ids: torch.Tensor  # [n, blocks] long
    # [n, 1, 1, blocks * block_size] additive float, 0 or -inf (see DecodeMaskTable), shaped for SDPA
    # once per step rather than per layer
    mask: torch.Tensor | None


@dataclass
class PagedDecode:
    """A step's decode rows for a kernel that reads each row's own blocks where they lie in the
    cache: no gather, no padding to the longest context, so no groups and no masks."""

    kernel: Callable  # (q [n, H, Dh], k_cache, v_cache, block_table, seq_lens, scale) -> [n, H, Dh]
    block_table: torch.Tensor  # [n, blocks] int64, entries past a row's context unread
    seq_lens: torch.Tensor  # [n] int64: keys each row attends, its new token's included


# Decode rows are attended this many bytes of gathered keys and values at a time: each chunk is
# gathered and handed to SDPA while it is still in the CPU's caches, instead of every row's keys
# gathered first and read back from memory. Measured here (AMD EPYC, 2 threads, the default
# model's heads, per layer): 64 rows x 1,040 keys 13.9 -> 8.7-9.7 ms, 64 x 528 6.2 -> 4.3, 128 x
# 272 6.9 -> 4.6, 64 x 272 2.5 -> 2.1; best between 3 and 6 MB a chunk; no change at 16 rows.
# In bf16 SDPA attends each row on its own: a row's result is bitwise the same in any chunk (in
# float32 the CPU kernel moves a row's last bits with the rows beside it, chunks or not).
DECODE_CHUNK_BYTES = 4 << 20

# An extra group costs a fixed ~45 us per layer (its own gather and SDPA call, and its rows'
# index_select / index_copy_), one row's block of keys ~1.5 us (the default model in bf16, 2
# threads, here): a split must spare this many row-blocks of keys to pay for itself.
MIN_SPARED_ROW_BLOCKS = 32


def split_decode_rows(seq_lens: np.ndarray, block_size: int) -> list[np.ndarray] | None:
    """Decode rows in two groups, short contexts and long ones, where padding every row to the
    longest context would gather more than twice the keys of the split that pads least, and at
    least ``MIN_SPARED_ROW_BLOCKS`` more; None where one group is as good. One 32k-token row
    among 64 rows of 1.5k otherwise pads all 65 to 32k: 20x the keys, a 64-row step of a small
    model taking 0.5 s instead of 33 ms, and streaming a gigabyte through the caches."""
    blocks = -(-seq_lens // block_size)
    order = np.argsort(blocks, kind="stable")
    ranked = blocks[order]
    d = len(ranked)
    if d < 2:
        return None
    short = np.arange(1, d)  # rows in the short group, for each cut
    keys = short * ranked[:-1] + (d - short) * ranked[-1]  # row-blocks gathered with that cut
    cut = int(np.argmin(keys))
    padded = d * ranked[-1]
    if 2 * keys[cut] >= padded or padded - keys[cut] < MIN_SPARED_ROW_BLOCKS:
        return None
    return [np.sort(order[: cut + 1]), np.sort(order[cut + 1 :])]


def decode_groups(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, masks: "DecodeMaskTable",
                  to_device: Callable[[np.ndarray], torch.Tensor], mask_lone_row: bool) -> list[DecodeGroup]:
    """A step's decode rows as :class:`DecodeGroup`s on the device (``to_device``): one group,
    or the two of :func:`split_decode_rows`, each cut to its own longest context. A lone row
    goes without a mask unless ``mask_lone_row`` (its keys then sliced to its context: a new
    shape, and kernel, per length; with a mask they are whole blocks)."""
    if (parts := split_decode_rows(seq_lens, block_size)) is None:
        masked = len(seq_lens) > 1 or mask_lone_row
        mask = masks(to_device(seq_lens), block_table.shape[1] * block_size)[:, None, None, :] if masked else None
        return [DecodeGroup(None, to_device(block_table), mask)]
    groups = []
    for rows in parts:
        lens = seq_lens[rows]
        width = int(-(-lens.max() // block_size))
        groups.append(DecodeGroup(to_device(rows), to_device(block_table[rows, :width]),
                                  masks(to_device(lens), width * block_size)[:, None, None, :]))
    return groups


class GatherScratch:
    """Memory for the keys and values attention copies out of the paged cache, reused by every
    layer (and, held by the model runner, every step): one buffer for keys, one for values (and
    one where keys land as stored before they are put token-major), grown when a step needs more
    (to a :func:`bucket` size, so a growing context reallocates rarely), never shrunk.

    Each layer used to allocate its own and free it: tens of MB per layer at long contexts (64
    rows of 1,024 tokens gather 25 MB of keys, as much of values). glibc's malloc hands memory
    that large back to the kernel on ``free`` (above its mmap threshold, or by trimming the top
    of its heap), so every layer's copy page-faulted, and the kernel zeroed each page first:
    a decode step of the default model over 64 x 1,024 tokens took 373k page faults and ~1,020
    ms, most of it system time; with the buffers reused, no fault and ~500 ms (64 x 2,048:
    ~2,000 -> ~900 ms; short contexts unchanged: the same memory came back from malloc's free
    lists). A gathered tensor is valid until the next gather into the same buffer: each call
    site hands it to SDPA before gathering again, and nothing keeps it across calls.

    The buffers hold the largest gather so far, for good: a chunk of decode rows (about
    ``DECODE_CHUNK_BYTES`` for both, or one row's context where that is more) or one prefill
    chunk's context (8,192 tokens of the default model in bf16: 3 MB of keys). The KV cache's
    memory plan does not count them."""

    KEYS, VALUES = 0, 1  # which buffer a gather fills
    _STAGED_KEYS = 2  # keys in the cache's order, before they are put token-major into KEYS

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None, None, None]  # KEYS, VALUES, _STAGED_KEYS

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
        """[num_blocks, KVH, block_size, D] at [S, n] block ids -> [S, KVH, n * block_size, D] (a
        view of [KVH, S, n * block_size, D]), token-major, in buffer ``which`` (:attr:`KEYS` or
        :attr:`VALUES`). One index_select per KV head, each copying its blocks' rows with memcpy:
        the same time as one over whole blocks (0.12 against 0.10 ms for 16 rows x 1,056 tokens
        here), where one over the heads' dimension, or advanced indexing (``cache[ids]``), goes
        element by element (3.4 ms). Keys, stored dimension-major in a block (model/kv_layout.py),
        are gathered as stored and then copied token-major: a second copy of them, on the path that
        reads the cache through SDPA (not the CPU's kernels)."""
        s, n = block_ids.shape
        kv_heads, block_size, head_dim = cache.shape[1:]
        rows = (kv_heads, s * n, block_size, head_dim)
        out = self._buffer(which, rows, cache)
        gathered = self._buffer(self._STAGED_KEYS, rows, cache) if which == self.KEYS else out
        ids = block_ids.reshape(-1)
        for h in range(kv_heads):
            torch.index_select(cache[:, h], 0, ids, out=gathered[h])
        if which == self.KEYS:
            keys_from_cache(gathered, out=out)
        return out.view(kv_heads, s, n * block_size, head_dim).transpose(0, 1)

    def _buffer(self, which: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        size = math.prod(shape)
        buf = self._buffers[which]
        if buf is None or buf.numel() < size or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[which] = torch.empty(bucket(size), dtype=like.dtype, device=like.device)
        return buf[:size].view(shape)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_groups: list[DecodeGroup]  # empty without decode rows
    decode_len: int  # longest decode context (the exact one when D == 1 and there is no mask)
    prefills: list[PrefillChunk]
    scratch: GatherScratch  # where the step's layers gather keys and values
    paged_decode: PagedDecode | None = None  # decode rows for an in-place kernel, instead of decode_groups
    # (q [n, H, Dh], k_cache, v_cache, block_ids [blocks], context_len, scale) -> [n, H, Dh]: a chunk's
    # rows against its context, read in place; None: SDPA
    prefill_kernel: Callable | None = None
    # (k [T, KVH, Dh], v, k_cache, v_cache, slot_mapping): the step's keys and values into the cache,
    # in one call; None: an index_put_ per cache at cache_rows()
    write_kv: Callable | None = None

    # cache_rows()'s result, computed by the first layer, used by all
    _cache_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Rows of the step that are tokens; the model's input may have padding rows after them."""
        return self.slot_mapping.shape[0]

    def cache_rows(self, kv_heads: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, KVH] each: where the step's new keys and values go in a layer's cache, token t's
        head h to (block * KVH + h, offset) for its slot block * block_size + offset, as (block
        and head, offset). The same for every layer: computed once a step."""
        if self._cache_rows is None:
            block, offset = self.slot_mapping // block_size, self.slot_mapping % block_size
            heads = torch.arange(kv_heads, device=self.slot_mapping.device)
            self._cache_rows = (block[:, None] * kv_heads + heads, offset[:, None].expand(-1, kv_heads))
        return self._cache_rows

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        decode_groups: list[DecodeGroup] | None,
        decode_len: int,
        prefills: list[tuple[int, int, int, torch.Tensor | None]],
        block_size: int | None = None,
        scratch: GatherScratch | None = None,
        paged_decode: PagedDecode | None = None,
        prefill_kernel: Callable | None = None,
        write_kv: Callable | None = None,
    ) -> "AttentionMetadata":
        """``decode_groups`` cover the decode rows (one group without ``rows``, or groups that
        partition them); a group without a mask is a lone decode row attending exactly
        ``decode_len`` keys (a new shape per length); ``decode_len`` the longest decode context;
        ``prefills`` holds (start, length, context_len, block_ids) per chunk.

        ``block_size`` set: SDPA's shapes are bucketed. Each chunk attends ``bucket(length, 16)`` query
        rows, the chunk's and those after it in the flat batch (the caller provides them; their
        outputs are dropped), and a chunk with context attends every key of its ``block_ids``
        (the caller may pad them with the null block), masked beyond its context.

        ``scratch``: the gather buffers to reuse (the model runner keeps one for all its steps);
        None: this step's own.

        ``paged_decode``: the decode rows for an in-place kernel, given instead of ``decode_groups``.

        ``prefill_kernel``: attends each chunk's own rows to the keys of its ``block_ids`` where
        they lie, every chunk's given (the chunk's own blocks included): no mask, no padding.

        ``write_kv``: writes the step's keys and values into the cache (one call a layer for both),
        instead of an index_put_ per cache."""
        device = slot_mapping.device
        decode_groups = decode_groups or []
        if any(g.rows is not None and g.mask is None for g in decode_groups):
            raise ValueError("decode_groups: a group of some of the rows needs a mask (keys are cut to "
                             "decode_len, the step's longest context, only for a lone row)")
        if paged_decode is not None and decode_groups:
            raise ValueError("decode_groups: none when paged_decode covers the decode rows")
        num_decode = (sum(g.block_ids.shape[0] for g in decode_groups) if paged_decode is None
                      else paged_decode.seq_lens.shape[0])
        chunks = []
        for start, length, context_len, block_ids in prefills:
            if prefill_kernel is not None:
                if block_ids is None:
                    raise ValueError("prefills: the prefill kernel needs every chunk's block ids, its own "
                                     "blocks included")
                chunks.append(PrefillChunk(start, length, context_len, block_ids, None, length, context_len))
                continue
            q_len = length if block_size is None else bucket(length, 16)
            if context_len == length:
                chunks.append(PrefillChunk(start, length, context_len, None, None, q_len, q_len))
                continue
            kv_len = context_len if block_size is None else block_ids.shape[0] * block_size
            q_pos = torch.arange(context_len - length, context_len - length + q_len, device=device)
            mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
            chunks.append(PrefillChunk(start, length, context_len, block_ids, mask, q_len, kv_len))
        return cls(slot_mapping, num_decode, decode_groups, decode_len, chunks,
                   scratch if scratch is not None else GatherScratch(), paged_decode, prefill_kernel, write_kv)


class DecodeMaskTable:
    """Additive attention masks for decode rows, by sequence length.

    Row L of the table is 0 for key positions < L and -inf after, so a step's mask is one row
    gather (``index_select``) instead of building a [rows, width] tensor from scratch in three
    full-size ops (~0.3 ms per step at 256 rows here). In the model's dtype, which SDPA wants
    on some backends (0 and -inf are exact in any float dtype; its softmax runs in float32).
    The table grows by doubling, up to ``max_width`` columns; wider steps build their mask
    directly.
    """

    def __init__(self, device, max_width: int = 2048, dtype: torch.dtype = torch.float32):
        self.device, self.max_width, self.dtype = device, max_width, dtype
        self.table = torch.empty(0, 0, device=device, dtype=dtype)

    def __call__(self, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
        if width > self.max_width:
            return self._build(seq_lens, width)
        if self.table.shape[1] < width:
            n = min(self.max_width, max(width, 2 * self.table.shape[1], 64))
            self.table = self._build(torch.arange(n + 1, device=self.device), n)
        return self.table[:, :width].index_select(0, seq_lens)

    def _build(self, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
        beyond = torch.arange(width, device=self.device)[None, :] >= seq_lens[:, None]
        return torch.zeros(beyond.shape, device=self.device, dtype=self.dtype).masked_fill_(beyond, float("-inf"))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's k/v into the cache, then attends every row to its context. Returns [T, H*D].

    Rows past ``meta.num_tokens`` are padding: not written to the cache, zero in the output."""
    num_blocks, kv_heads, block_size, head_dim = k_cache.shape
    n = meta.num_tokens
    padded = q.shape[0] != n
    new_k, new_v = (k[:n], v[:n]) if padded else (k, v)
    if meta.write_kv is not None:
        meta.write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    else:
        # One index_put_ a cache: values as rows of head_dim, keys in groups of 32 bits (model/kv_layout.py).
        block_head, offset = meta.cache_rows(kv_heads, block_size)
        keys = stored_keys(k_cache).flatten(0, 1)  # [blocks * KVH, head_dim / P, block_size, P]
        keys[block_head, :, offset] = new_k.reshape(*block_head.shape, keys.shape[1], keys.shape[3])
        v_cache.view(-1, block_size, head_dim)[block_head, offset] = new_v
    d = meta.num_decode
    if not meta.prefills and not padded:  # a pure decode step: no output to assemble from parts
        return _decode_attention(q, k_cache, v_cache, meta, scale).flatten(1)
    out = torch.empty_like(q)
    if padded:
        out[n:] = 0
    gqa = q.shape[1] != kv_heads
    if d:
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, meta, scale)

    for c in meta.prefills:
        if meta.prefill_kernel is not None:
            rows = slice(c.start, c.start + c.length)
            out[rows] = meta.prefill_kernel(q[rows], k_cache, v_cache, c.block_ids, c.context_len, scale)
            continue
        # 4-D [1, heads, len, Dh]: given 3-D tensors, CPU SDPA leaves its flash kernel for the math
        # path, ~6x slower at 2,048 tokens (270 vs 45 ms per layer here).
        rows = slice(c.start, c.start + (c.q_len or c.length))
        qc = q[rows].transpose(0, 1)[None]
        if c.block_ids is None:
            # Causal: the chunk's rows never see the padding rows after them.
            kc, vc = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kv_len = c.kv_len or c.context_len
            # Views of the scratch buffers: consumed by this SDPA call, before the next gather.
            kc = meta.scratch.gather(k_cache, c.block_ids[None], GatherScratch.KEYS)[:, :, :kv_len]
            vc = meta.scratch.gather(v_cache, c.block_ids[None], GatherScratch.VALUES)[:, :, :kv_len]
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale, enable_gqa=gqa)
        out[c.start : c.start + c.length] = o[0, :, : c.length].transpose(0, 1)
    return out.flatten(1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """One query per sequence against its context: [D, H, Dh] -> [D, H, Dh], in place by the
    kernel of ``meta.paged_decode``, else gathered group by group."""
    if (paged := meta.paged_decode) is not None:
        # q's rows may be views of the QKV buffer (the CPU's rotary rotates them in place): the
        # kernel reads them where they are, no copy
        return paged.kernel(q, k_cache, v_cache, paged.block_table, paged.seq_lens, scale)
    (first, *more) = meta.decode_groups
    if not more and first.rows is None:
        return _attend_group(q, k_cache, v_cache, first, meta, scale)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out.index_copy_(0, g.rows, _attend_group(q.index_select(0, g.rows), k_cache, v_cache, g, meta, scale))
    return out


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """A group's rows against their gathered contexts: [n, H, Dh] -> [n, H, Dh].

    The G query heads that share a KV head are folded into G query rows, so SDPA sees
    [n, KVH, G, Dh] queries against [n, KVH, L, Dh] keys: each KV head's keys are read once,
    nothing is repeated per query head, softmax runs in float32 whatever the cache dtype. On
    the CPU this runs SDPA's flash kernel, whose micro-kernels depend only on block sizes (L is
    whole blocks), not on n: two batched matmuls instead made oneDNN build and cache two
    kernels per (n, L), ~1.1 MB per pair in bf16, a new pair for every token of a lone
    sequence. It is also faster here (one thread, per layer, 64 rows x 1,024 tokens: 10 vs
    23 ms in bf16, 13 vs 76 ms in fp32). (SDPA with the H heads as heads and ``enable_gqa``
    took ~10x longer in bf16.) Many rows go in chunks of ``DECODE_CHUNK_BYTES`` of keys and
    values, each gathered and attended before the next.
    """
    n, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    qg = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
    row_bytes = 2 * group.block_ids.shape[1] * math.prod(k_cache.shape[1:]) * k_cache.element_size()
    rows = max(1, DECODE_CHUNK_BYTES // row_bytes)  # rows per chunk (see DECODE_CHUNK_BYTES)
    if rows >= n:
        return _attend_rows(qg, k_cache, v_cache, group.block_ids, group.mask, meta, scale).reshape(q.shape)
    out = qg.new_empty(qg.shape)
    for i in range(0, n, rows):
        out[i : i + rows] = _attend_rows(qg[i : i + rows], k_cache, v_cache, group.block_ids[i : i + rows],
                                         group.mask[i : i + rows], meta, scale)
    return out.view(q.shape)


def _attend_rows(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                 mask: torch.Tensor | None, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Rows [n, KVH, G, Dh] against the keys of their ``block_ids`` [n, blocks]: one gather, one SDPA call."""
    # Whole blocks, [n, KVH, L = blocks * block_size, Dh]. Views of the scratch buffers:
    # consumed by the SDPA call below, before another group or chunk gathers.
    keys = meta.scratch.gather(k_cache, block_ids, GatherScratch.KEYS)
    values = meta.scratch.gather(v_cache, block_ids, GatherScratch.VALUES)
    if mask is None:  # a lone sequence without a mask: keys sliced to its context
        keys, values = keys[:, :, : meta.decode_len], values[:, :, : meta.decode_len]
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
