"""What a block is, for moving it: this engine's ``KVLayout``, and every block buffer as one
numpy array over the cache's own memory."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..kv_cache import KVCache
from .messages import KVLayout

# Same-size integer types: a transfer moves bits, and numpy has no bfloat16.
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bytes of the embedding read into the model's fingerprint: enough to tell two checkpoints of
# one architecture apart (fine-tunes change every row), and read in microseconds at start-up.
_FINGERPRINT_BYTES = 1 << 16


def engine_layout(model: torch.nn.Module, block_size: int) -> KVLayout:
    cfg = model.config
    weight = model.embed_tokens.weight
    digest = hashlib.blake2b(repr(cfg).encode(), digest_size=8)
    digest.update(weight.detach().flatten()[: _FINGERPRINT_BYTES // weight.element_size()].cpu().view(torch.uint8)
                  .numpy().tobytes())
    return KVLayout(model=f"{cfg.architecture}-{digest.hexdigest()}", dtype=str(weight.dtype).removeprefix("torch."),
                    num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    block_size=block_size)


def block_array(kv: KVCache) -> np.ndarray:
    """Every block buffer of the cache, ``[num_blocks, layers, 2, kv_heads, block_size,
    head_dim]`` of raw bits over the cache's memory, derived from ``KVCache.block_buffer``
    alone: ``array[b]`` is ``block_buffer(b)``, whatever the cache's layout (checked).

    A transfer then gathers or scatters all its blocks in one numpy call, which runs on its own
    thread without the GIL. A Python loop over ``block_buffer`` instead took ~20 us per block
    here (40 ms for the 2,048 blocks of a 32k-token prompt), holding the GIL the loop needs;
    torch's index ops would start a second OpenMP pool beside the loop's (see ``EngineLoop``).
    Host memory only: a GPU cache needs a transport of its own (NIXL)."""
    n = kv.pool.num_blocks
    first, second, last = kv.block_buffer(0), kv.block_buffer(1), kv.block_buffer(n - 1)
    if first.device.type != "cpu":
        raise ValueError("--kv-transfer-config: ZmqConnector moves host memory; this KV cache is on "
                         f"{first.device}")
    step = second.storage_offset() - first.storage_offset()
    raw = first.view(_RAW[first.element_size()]).as_strided((n, *first.shape), (step, *first.stride()),
                                                              first.storage_offset())
    if raw[n - 1].data_ptr() != last.data_ptr() or raw[n - 1].stride() != last.stride():
        raise RuntimeError("KVCache.block_buffer: blocks are not evenly spaced in one buffer")
    return raw.numpy()
