"""What must match for one engine's KV bytes to mean the same in another's: ``KVLayout``."""

from __future__ import annotations

import hashlib

import torch

from ...model.kv_layout import KEY_ORDER
from .messages import KVLayout

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
                    block_size=block_size, key_order=KEY_ORDER)
