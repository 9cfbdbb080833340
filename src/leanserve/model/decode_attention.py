"""Decode attention over the block-major paged KV cache: one query row per sequence.

The fast path is :func:`fused_decode` compiled by ``torch.compile`` (Inductor: C++/OpenMP on the
CPU, Triton on CUDA). Written as broadcasts and reductions over the cache indexed by the block
table, it compiles to loops that read each key and value in place, once, for all the query
heads that share it. The eager way (:meth:`DecodeAttention.eager`) copies every block of every
context out of the cache, then SDPA reads the copy: 3x the memory traffic, and a fresh
multi-MB temporary per layer. Measured here on the default model (one thread, both ways
interleaved in one process; bench/results/long_context.md for the 2-core numbers): a decode
step of 64 sequences x 1,024 tokens took 0.52-0.57 s compiled vs 0.68-1.2 s the old way
(gather + SDPA); at 16 x 1,024 it was 1-15 % slower, at 64 x 128 within 2 %; a lone sequence
pays the compiled region's fixed cost, ~65 us per layer (dynamo's guards and the call): 1 x
1,024 took 62 vs 56 ms.

:class:`DecodeAttention` owns one engine's compiled kernel: it compiles it at start-up
(:meth:`DecodeAttention.warm_up`), counts compilations, never compiles while serving (a call
that would need a new kernel runs eagerly, counted in ``fallbacks``), and runs everything
eagerly, with one log line, where compilation is unavailable (no C++ compiler, say).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from torch._dynamo.decorators import mark_unbacked

from .attention import DecodeMaskTable

log = logging.getLogger(__name__)


def fused_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query row per sequence to its cached context, written for Inductor.

    q [D, KVH, G, Dh] (the G query heads sharing each KV head); k_cache, v_cache
    [num_blocks, KVH, block_size, Dh]; block_table [D, W] (padding entries may point anywhere:
    masked); seq_lens [D] int32. Returns [D, KVH, G, Dh] in q's dtype; softmax in float32.

    Eagerly this would materialise [D, W, KVH, block_size, Dh] products: it is meant to be
    compiled. Each query head of a KV head is its own reduction over the same loops, which
    Inductor fuses into one loop nest that loads each key/value vector once for all of them
    (a single reduction over a G dimension made G passes over the keys: ~20 % slower here).
    """
    d, kv_heads, groups, head_dim = q.shape
    width = block_table.shape[1]
    block_size = k_cache.shape[2]
    keys = k_cache[block_table].float()  # [D, W, KVH, BS, Dh], read in place
    values = v_cache[block_table].float()
    qs = q.float() * scale
    slot = torch.arange(width * block_size, device=q.device, dtype=seq_lens.dtype).view(width, 1, block_size)
    beyond = slot >= seq_lens.view(d, 1, 1, 1)  # [D, W, 1, BS]
    outs = []
    for g in range(groups):
        s = (qs[:, None, :, g, None, :] * keys).sum(4).masked_fill(beyond, float("-inf"))  # [D, W, KVH, BS]
        p = (s - s.amax(dim=(1, 3), keepdim=True)).exp()
        outs.append((p[..., None] * values).sum(dim=(1, 3)) / p.sum(dim=(1, 3))[..., None])  # [D, KVH, Dh]
    return torch.stack(outs, 2).to(q.dtype)


class DecodeAttention:
    """One engine's decode attention: compiled where possible, eager otherwise.

    Calls run eagerly until :meth:`warm_up` has compiled the kernel; from then on they run it
    and never compile (dynamo's ``fail_on_recompile`` stance): a call that would need another
    kernel (a new dtype, inputs made outside inference mode) runs eagerly instead, counted in
    ``fallbacks``. One kernel serves every step: the numbers of rows, of blocks per row and of
    blocks in the cache are traced as unbacked sizes (dynamo neither specialises them, nor
    sizes 1 among them), so ``compiles`` stays 1.
    """

    def __init__(self, device, dtype: torch.dtype, compile: bool = True):
        self.masks = DecodeMaskTable(device, dtype=dtype)  # for the eager path
        self.compiles = 0
        self.fallbacks = 0
        self._fn = None  # the compiled kernel, once warmed up
        self._to_compile = None
        if compile:
            # Dynamo keeps compiled graphs, their guards and the recompile limit per code object:
            # a copy of the function's code per instance keeps them (and the count) this engine's.
            code = fused_decode.__code__.replace()
            fn = types.FunctionType(code, fused_decode.__globals__, fused_decode.__name__)
            self._to_compile = torch.compile(fn, backend=self._compile, dynamic=False)

    @property
    def compiled(self) -> bool:
        return self._fn is not None

    def _compile(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        # Fused multiply-adds (C++ on the CPU compiles without by default): ~10 % less time here.
        return compile_fx(gm, example_inputs, config_patches={"cpp.enable_floating_point_contract_flag": "fast"})

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, head_dim: int) -> None:
        """Compiles the kernel for caches of this layout, on their null block. Where compiling
        fails (no C++ compiler, an unsupported device), logs one line and stays eager."""
        if self._to_compile is None:
            return
        kv_heads, dev = k_cache.shape[1], k_cache.device
        try:
            # Inputs made as the model runner makes them, in inference mode: a kernel's guards
            # include grad mode and whether its inputs are inference tensors.
            with torch.inference_mode():
                q = torch.zeros(2, kv_heads, num_heads // kv_heads, head_dim, dtype=k_cache.dtype, device=dev)
                table = torch.zeros(2, 3, dtype=torch.long, device=dev)
                seq_lens = torch.ones(2, dtype=torch.int32, device=dev)
                # Unbacked sizes, with the hints Inductor plans loops with: with one row, the
                # threads split the blocks (with the default hint, 8,192 rows, one thread did all
                # the work of a lone row). Marks matter only when tracing.
                for t in (q, table, seq_lens):
                    mark_unbacked(t, 0, hint_override=1)
                mark_unbacked(table, 1, hint_override=64)
                for t in (k_cache, v_cache):  # any cache of this layout, whatever its size
                    mark_unbacked(t, 0)
                self._to_compile(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eagerly
            log.warning("decode attention runs eagerly (gather + SDPA): torch.compile failed: %s",
                        str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return
        self._fn = self._to_compile

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [D, H, Dh] -> [D, H, Dh]; see :func:`fused_decode` for the rest."""
        d, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[1]
        # Inputs with the strides of contiguous tensors, as at warm-up: strides are part of the
        # kernel's guards (a one-row slice of a wider block table is contiguous, yet keeps the
        # wider row stride).
        qg = q.contiguous().view(d, kv_heads, num_heads // kv_heads, head_dim)
        block_table = block_table.reshape(-1).view(block_table.shape)
        if self._fn is not None:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._fn(qg, k_cache, v_cache, block_table, seq_lens, scale).view(d, num_heads, head_dim)
            except RuntimeError as e:  # what dynamo raises for a recompile under this stance
                if not str(e).startswith("Detected recompile"):
                    raise
                self.fallbacks += 1
        return self.eager(qg, k_cache, v_cache, block_table, seq_lens, scale).view(d, num_heads, head_dim)

    def eager(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Same contract as :func:`fused_decode`: gathers the blocks (a copy), then one SDPA call
        with the G query heads of a KV head as G query rows, so each KV head's keys are read
        once there. SDPA's flash kernel builds its micro-kernels by block sizes, not by the
        number of rows: two batched matmuls instead made oneDNN build and keep a kernel pair
        per shape; SDPA with the H heads as heads and ``enable_gqa`` took ~10x longer in bf16."""
        d, width = block_table.shape
        keys, values = (c.index_select(0, block_table.reshape(-1)).unflatten(0, (d, width)).transpose(1, 2)
                        .flatten(2, 3) for c in (k_cache, v_cache))  # [D, KVH, W * BS, Dh]
        mask = self.masks(seq_lens, keys.shape[2])[:, None, None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
