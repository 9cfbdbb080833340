"""The decoder: one file for the Llama family (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3).

Its forward takes a *flat* batch: the new tokens of many sequences back to back, with their
positions, so one call serves prefill chunks and decode tokens of different requests together.
Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); loaders
write the checkpoint's separate tensors into slices of the fused weights. Under tensor
parallelism a model holds one rank's share of every weight (see :mod:`.parallel`).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .layer_ops import LayerOps
from .parallel import TensorParallel, embed


def _empty(*shape, dtype, device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader, so initialising is wasted time
    # (modules are built on the meta device for the same reason, then given these).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device, ops: LayerOps):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = _empty(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with the residual stream, (RMSNorm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """This rank's attention heads and KV heads; the output is summed over ranks."""

    def __init__(self, cfg: ModelConfig, dtype, device, tp: TensorParallel, ops: LayerOps):
        super().__init__()
        self.tp, self.ops = tp, ops
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_size, bias=cfg.attention_bias, device="meta")
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False, device="meta")
        for lin in (self.qkv_proj, self.o_proj):
            lin.weight = _empty(*lin.weight.shape, dtype=dtype, device=device)
            if lin.bias is not None:
                lin.bias = _empty(*lin.bias.shape, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, ops) if cfg.qk_norm else None

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        t, h = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        # q and k heads side by side, rotated in one pass (half the small ops of two passes).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, h + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        q, k = self.ops.rotate(qk, cos, sin).split([h, self.num_kv_heads], dim=1)
        return self.tp.all_reduce(self.o_proj(paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)))


class MLP(nn.Module):
    """This rank's columns of the MLP; the output is summed over ranks."""

    def __init__(self, cfg: ModelConfig, dtype, device, tp: TensorParallel, ops: LayerOps):
        super().__init__()
        self.tp, self.ops = tp, ops
        inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False, device="meta")
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False, device="meta")
        for lin in (self.gate_up_proj, self.down_proj):
            lin.weight = _empty(*lin.weight.shape, dtype=dtype, device=device)

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, tp: TensorParallel, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.self_attn = Attention(cfg, dtype, device, tp, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.mlp = MLP(cfg, dtype, device, tp, ops)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """x: the last sub-block's output (the embeddings for the first layer, whose residual is
        None). Returns this layer's MLP output and the residual stream before it; the stream is
        x + residual, added where the next norm runs (see layer_ops)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, k_cache, v_cache, meta), residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu", tp: TensorParallel | None = None):
        """``tp``: this rank's place when the model is split over ranks (default: one rank)."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        vocab = tp.vocab_rows(cfg.vocab_size)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size, device="meta")
        self.embed_tokens.weight = _empty(vocab, cfg.hidden_size, dtype=dtype, device=device)
        # The elementwise work between the GEMMs, PyTorch's until a runner switches the CPU
        # kernels on (layer_ops.use_cpu_kernels).
        self.ops = ops = LayerOps()
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, tp, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False, device="meta")
        self.lm_head.weight = (self.embed_tokens.weight if cfg.tie_word_embeddings
                               else _empty(vocab, cfg.hidden_size, dtype=dtype, device=device))
        # A GGUF file's Q4/Q8_0 blocks of linear layers, by layer, kept by the loader beside the
        # dequantized weights for the runner's packing to take (prepack.py's q4_layout and
        # q8_layout); emptied there.
        self.gguf_blocks: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        # float32 rotary tables over the whole context; indexed by position each step.
        self.register_buffer("inv_freq", cfg.rope_inv_freq().to(device), persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_rope_freq_factors(self, factors: torch.Tensor) -> None:
        self.inv_freq = self.config.rope_inv_freq(factors).to(self.inv_freq.device)
        self._rope_cache = None

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cache is None or self._rope_cache[0].dtype != dtype:
            pos = torch.arange(self.config.max_position_embeddings, device=self.inv_freq.device)
            angles = torch.outer(pos.float(), self.inv_freq)
            # Row chunks of at most 2,048 angles, under the size at which torch hands cos and sin
            # to its thread pool: each call then runs on this thread alone, as transformers' rotary
            # does on a forward's few positions. On a Xeon the whole-table call came out 1.5e-4 off
            # in its cos (sin exact) in about one process in five, only the first time in a process;
            # elementwise, the chunks give the same bits as one call where that call is right.
            chunks = angles.split(max(1, 2048 // angles.shape[1]))
            self._rope_cache = (torch.cat([c.cos() for c in chunks]).to(dtype),
                                torch.cat([c.sin() for c in chunks]).to(dtype))
        cos, sin = self._rope_cache
        return cos[positions], sin[positions]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, KVH, block_size, D]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,  # rows to compute logits for; None = all
    ) -> torch.Tensor | None:
        """Returns float32 logits [len(logits_indices), vocab]; None on a tensor-parallel rank
        other than 0 (only rank 0 samples)."""
        x, residual = embed(input_ids, self.embed_tokens.weight, self.tp), None
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv_cache[i, 0], kv_cache[i, 1], meta)
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        # Only the rows that sample reach the output head: ~20% of a small model's FLOPs.
        logits = self.lm_head(self.norm(x, residual)[0]).float()
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_vocab(logits)
        return None if logits is None else logits[:, : self.config.vocab_size]
