"""What KV transfer says: between the API process and its engine (``RemotePrefill`` in,
``KVLease`` out) and between workers over the side channel (``PullRequest``/``ReleaseLease``
to a prefill worker; ``BlocksHeader`` plus one frame of block bytes, or ``Refused``, back).

Side-channel messages are msgpack structs with only scalars and short lists: block contents
never go through msgpack or pickle; they travel as one raw frame, ``len(block_ids)`` block
buffers back to back, each ``[layers, 2, kv_heads, block_size, head_dim]`` of ``dtype`` (the keys of
each ``[block_size, head_dim]`` in ``key_order``).
"""

from __future__ import annotations

import msgspec


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """What must match between workers for one's block bytes to mean the same in the other's cache."""

    model: str  # architecture and a digest of the weights (``fingerprint``)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    key_order: str  # how a block's keys lie within it (model/kv_layout.py's KEY_ORDER)

    def mismatch(self, theirs: "KVLayout", here: str, there: str) -> str | None:
        """None when compatible, else every difference, named: 'block_size: 16 on the prefill
        worker, 32 on the decode worker' (``here``, ``there``: who is who)."""
        diffs = [f"{f}: {getattr(self, f)} {here}, {getattr(theirs, f)} {there}"
                 for f in self.__struct_fields__ if getattr(self, f) != getattr(theirs, f)]
        return "; ".join(diffs) or None


class RemotePrefill(msgspec.Struct, array_like=True, gc=False):
    """Where a decode request's prompt KV waits: a lease on a prefill worker (the request's
    ``kv_transfer_params``, vLLM's ``remote_*`` fields)."""

    engine_id: str
    request_id: int
    epoch: int
    block_ids: list[int]
    host: str
    port: int
    num_cached_tokens: int = 0  # prompt tokens the prefill worker served from its prefix cache


class KVLease(msgspec.Struct, array_like=True, gc=False):
    """A finished prefill's blocks, kept for a decode worker to pull: what the engine reports, and
    where it is (an API process may front several engines, each with its own side channel)."""

    request_id: int
    epoch: int
    block_ids: list[int]
    num_cached_tokens: int
    engine_id: str
    host: str
    port: int


# ------------------------------------------------------------------ side channel, decode -> prefill


class PullRequest(msgspec.Struct, tag="pull", array_like=True, gc=False):
    engine_id: str  # the prefill engine the puller means: a restarted worker refuses its predecessor's ids
    request_id: int
    epoch: int
    block_ids: list[int]
    layout: KVLayout  # the puller's: a mismatch is refused before any bytes move
    reply_to: int  # the puller's own request id, echoed in the answer


class ReleaseLease(msgspec.Struct, tag="release", array_like=True, gc=False):
    """The decode side will not pull (its request was aborted, failed or timed out)."""

    engine_id: str
    request_id: int
    epoch: int


# ------------------------------------------------------------------ side channel, prefill -> decode


class BlocksHeader(msgspec.Struct, tag="blocks", array_like=True, gc=False):
    """Frame 0 of an answer; frame 1 is the blocks' bytes, in ``block_ids`` order."""

    engine_id: str
    request_id: int
    epoch: int
    layout: KVLayout  # dtype, layer count, kv heads, head dim, block size: the bytes' meaning
    block_ids: list[int]
    reply_to: int


class Refused(msgspec.Struct, tag="refused", array_like=True, gc=False):
    engine_id: str
    request_id: int
    epoch: int
    reply_to: int
    reason: str


ToPrefill = PullRequest | ReleaseLease
FromPrefill = BlocksHeader | Refused
