"""One configuration for every supported decoder: the Llama family with small switches.

Llama 2/3, SmolLM and Mistral are the base; Qwen2 adds q/k/v biases; Qwen3 adds per-head
RMSNorm on q and k. Everything the model file branches on is a field here, read either from a
Hugging Face ``config.json`` or from GGUF metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Hugging Face model_type / GGUF general.architecture -> the switches that differ.
_ARCH_TRAITS = {
    "llama": dict(attention_bias=False, qk_norm=False),
    "mistral": dict(attention_bias=False, qk_norm=False),
    "qwen2": dict(attention_bias=True, qk_norm=False),
    "qwen3": dict(attention_bias=False, qk_norm=True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_TRAITS)


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line naming the problem."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @staticmethod
    def traits(architecture: str) -> dict:
        if architecture not in _ARCH_TRAITS:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return _ARCH_TRAITS[architecture]

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        traits = cls.traits(arch)
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            eos = cfg.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=_hf_rope_theta(cfg),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", traits["attention_bias"])),
                qk_norm=traits["qk_norm"],
                rope_scaling=_hf_rope_scaling(cfg),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing the field {e.args[0]!r}") from None

    @classmethod
    def from_gguf(cls, meta: dict, has_output_tensor: bool) -> "ModelConfig":
        arch = meta.get("general.architecture", "")
        traits = cls.traits(arch)

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        kv_heads = get("attention.head_count_kv", heads)
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=traits["attention_bias"],
            qk_norm=traits["qk_norm"],
            rope_scaling=scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )

    def rope_inv_freq(self, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse frequencies of rotary embeddings, with the checkpoint's scaling applied.

        ``freq_factors`` is llama.cpp's ``rope_freqs`` tensor: GGUF files of Llama 3.1+ store the
        llama3 scaling already evaluated as per-frequency divisors.
        """
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if freq_factors is not None:
            return (inv / freq_factors.to(torch.float64)).float()
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            inv = inv / scaling["factor"]
        elif kind == "llama3":
            inv = _llama3_scale(inv, scaling)
        elif kind != "default":
            raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
        return inv.float()


def _hf_rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _hf_rope_scaling(cfg: dict) -> dict | None:
    # transformers >= 5 writes rope settings under "rope_parameters"; older files use "rope_scaling".
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (same formula as transformers' _compute_llama3_parameters)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
