"""bf16 linear weights packed once, in the CPU GEMM's own layout.

On the CPU a bf16 ``F.linear`` runs oneDNN's matmul, which wants the weight in a blocked (VNNI)
layout and reorders the plain ``[out, in]`` tensor into it on every call: a step that reads each
weight once to multiply it by a few rows reads and writes it once more before that. Packing each
weight at start-up (``torch.ops.mkldnn._reorder_linear_weight``) and multiplying with
``torch.ops.mkldnn._linear_pointwise`` skips the reorder; it is what Inductor's weight
prepacking calls when it freezes a model, used here in eager mode. The kernel is the same, so
the products are bitwise those of ``F.linear`` at every row count on a CPU without AMX, and up
to one 16-row tile on one with AMX; past it oneDNN blocks its sums by the layout the weight was
packed for (F.linear's is packed anew for each call's rows), so there the two agree to within a
bf16 rounding, each deterministic (``tests/test_prepack.py`` checks which holds on the machine
it runs on). Batch invariance is what it was: a bf16 row's result depends on the rows beside it
in either.

Measured here (AMD EPYC, AVX512-BF16, 2 threads, the default model's shapes, weights cycled so
they come from memory): 1.24-1.59x faster at one row (the 576 -> 49,152 output head 3.44 -> 2.29
ms), 1.7-1.8x at 8 rows, 1.22-1.41x at 64, ~1.05-1.1x at 512-2,048. On a 2-core Xeon with AMX
(weights in the caches): 1.6x at one row (the head 1.88 -> 1.12 ms), 1.6-2.2x at 8-64 rows,
1.0-1.4x at 192-512.

On a CPU with AVX512-BF16 (every one with AMX has it) the weights are packed instead in the
layout of oneDNN's brgemm micro-kernel, one that is not opaque (:class:`BrgemmLinear`,
``kernels/brgemm_linear.cpp``): one row, a batch-1 decode step, runs in leanserve's own loop, a
prefetched stream over the weights, and more rows on a CPU with AMX in its own loop over AMX's
tiles (32 rows x 32 features at a time, in chunks of 256 inputs: 1.07-1.18x the micro-kernel at
64-512 rows, the same bits), else in that micro-kernel (``at::native::cpublas::brgemm``, in
AVX512-BF16 instructions). The default model's 121 GEMMs of a step, in a step's order, on a 2-core Xeon with
AMX: 1.48x oneDNN's matmul at one row (its weights streamed at ~18 GB/s, the loop's at 26, a
plain read of the same bytes at 27), 1.27-1.30x at 2-64 rows (the micro-kernel without the
matmul's per-call work), 1.12x at 192, 0.97x at 512. Served at concurrency 1 (128-token
prompts): 49.1 -> 68.7 output tok/s, TPOT 19.9 -> 14.2 ms; 1.08x at 64
(``bench/results/amx_linear_serve.md``). On the 2-core AMD EPYC without AMX, the model's whole
forward (``bench/results/brgemm_on_epyc.md``): a batch-1 decode step 16.4 -> 11.4 ms (9.3 with
the GGUF blocks below), 1.2-1.4x at 2-8 rows, level from 16 rows to a 512-token prefill. Its
sums are in another order than F.linear's: the same to within a bf16 rounding. Where the kernel
cannot be built, oneDNN's packing as above; CPUs without AVX512-BF16 keep it too (the one-row
loop is made of its dot products of bf16 pairs).

A batch-1 step is bound by reading the weights, and a GGUF file holds them in 5 bits (Q4_0,
Q4_1) or 8.5 (Q8_0) instead of bf16's 16. So where such a model is loaded in bf16 for the
brgemm layout, the loader keeps each such layer's blocks beside its bf16 weight
(``Transformer.gguf_blocks``, in :func:`q4_layout`'s or :func:`q8_layout`'s order: +31 % or +53 %
of the layer's bytes), and the one-row loop reads those: it computes every weight as gguf-py's
dequantization does and rounds it to bf16 as the load did, so its products are those of the bf16
loop, bit for bit; a model is the same model at every row count. More rows keep to the bf16
copy. The default model's 120 Q4 layers of a step: 9.4 -> 6.1 ms on the 2-core Xeon, a batch-1
step 16.2 -> 12.5 ms; its Q8_0 output head (the embedding's table) read as Q8_0 too, in another,
noisier run a step 14.85 -> 14.21 ms more (the head alone, its weights left in the caches by the
call before: 1.20 ms either way, where the loop is bound by the dequantization).

Only where the packed op exists for the weights' dtype: bf16 on a CPU with oneDNN bf16 support.
float32 stays on ``F.linear``: its packed kernels (MKL's or oneDNN's) differ from it in the last
bits at one row, so packing it would change the model's numbers. CUDA never packs: cuBLAS takes
the plain layout. A packed weight is opaque (no slicing, no ``state_dict``): models are packed by
the runner that executes them, after loading, and keep nothing else of the plain weight unless
another module shares it (a tied output head keeps the embedding's table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`prepack_linears` packs the linear layers of a ``dtype`` model on ``device``."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``nn.Linear``'s product with its weight in oneDNN's layout (see the module docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The batch-size hint only steers which blocked layout is chosen (a call of another size
        # still works and gives the same numbers); one row, the step that reads weights the most
        # per row computed, is the case to get right.
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, weight packed for oneDNN"


class BrgemmLinear(nn.Module):
    """``nn.Linear``'s product on a CPU with AVX512-BF16, its weight packed once for oneDNN's
    brgemm micro-kernel: ``[N / 32, K / 2, 32, 2]``, pairs of input features interleaved in blocks of 32
    output features, the last block padded with zeros. ``kernels/brgemm_linear.cpp`` computes one row
    with its own prefetched loop and more in AMX's tiles or the micro-kernel, all over this one copy; given
    the weight's GGUF blocks (``gguf_blocks``: :func:`q4_layout`'s or :func:`q8_layout`'s codes
    and scales), one row reads those instead and computes the same bf16 weights from them, bit for
    bit."""

    BLOCK = 32

    def __init__(self, linear: nn.Linear, op, gguf_blocks: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.op = op
        packed = _pairs(linear.weight.detach(), self.out_features).contiguous()
        blocks = packed.shape[0]
        self.register_buffer("packed", packed, persistent=False)
        # float32, as the kernel adds it before its one rounding to bf16 (oneDNN does the same)
        padding = blocks * self.BLOCK - self.out_features
        bias = None if linear.bias is None else F.pad(linear.bias.detach().float(), (0, padding))
        self.register_buffer("bias", bias, persistent=False)
        codes, scales = gguf_blocks or (None, None)
        if codes is not None and codes.shape[:2] != packed.shape[:2]:
            raise ValueError(f"blocks: codes {tuple(codes.shape)} do not match the weight's {blocks} blocks of "
                             f"{self.in_features // 2} input pairs")
        self.register_buffer("block_codes", codes, persistent=False)
        self.register_buffer("block_scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.packed, self.bias, self.out_features, self.block_codes, self.block_scales)

    def extra_repr(self) -> str:
        blocks = "" if self.block_codes is None else \
            f", one row from its {'Q4' if self.block_codes.dtype == torch.uint8 else 'Q8_0'} blocks"
        return f"{self.in_features} -> {self.out_features}, weight packed for brgemm{blocks}"


def has_amx() -> bool:
    """A CPU with AMX whose tile unit torch's oneDNN may use (not turned off)."""
    return torch.cpu._is_amx_tile_supported() and torch.backends.mkldnn.enabled


def has_avx512_bf16() -> bool:
    """A CPU with AVX512-BF16, whose dot products of bf16 pairs the one-row loop of
    :class:`BrgemmLinear` is made of, and torch's oneDNN on (the micro-kernel is oneDNN's)."""
    return torch.cpu._is_avx512_bf16_supported() and torch.backends.mkldnn.enabled


def reads_gguf_blocks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of ``dtype`` on ``device`` would be packed for :class:`BrgemmLinear`, whose
    one-row loop reads a GGUF file's Q4_0, Q4_1 and Q8_0 blocks where the loader keeps them."""
    return packs(device, dtype) and has_avx512_bf16()


def _blocked(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t``'s rows [n, ...] padded with zeros to ``rows`` (at least n) rounded up to whole blocks
    of 32, and split: [blocks, 32, ...]."""
    blocks = -(-rows // BrgemmLinear.BLOCK)
    padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, blocks * BrgemmLinear.BLOCK - t.shape[0]))
    return padded.view(blocks, BrgemmLinear.BLOCK, *t.shape[1:])


def _pairs(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight-shaped [n, K] tensor in the packed weight's order, a view: [blocks, K / 2, 32, 2]
    (see :func:`_blocked`)."""
    return _blocked(t, rows).view(-1, BrgemmLinear.BLOCK, t.shape[1] // 2, 2).transpose(1, 2)


def _fp16(scales: torch.Tensor) -> torch.Tensor | None:
    half = scales.half()
    return half.contiguous() if torch.equal(half.float(), scales) else None


def q4_layout(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GGUF Q4 weight (``w = codes * scale + minimum`` per group of 32 inputs: codes uint8
    [N, K], scale and minimum [N, K / 32], fp16 values) in the order of :class:`BrgemmLinear`'s
    packed weight: codes [N / 32, K / 2, 32], a byte per pair of inputs (the first's code in the
    low nibble), and scales and minimums fp16 [N / 32, K / 32, 2, 32]; padded with zeros to
    ``rows`` (default N: the last block) rounded up to a block. None where a scale or minimum is
    not an fp16 value (Q4_0's ``-8 d`` past fp16's range)."""
    rows = rows or codes.shape[0]
    pairs = _pairs(codes, rows)
    scales = _fp16(torch.stack([_blocked(t, rows).transpose(1, 2) for t in (scale, minimum)], dim=2))
    return None if scales is None else ((pairs[..., 0] | pairs[..., 1] << 4).contiguous(), scales)


def q8_layout(codes: torch.Tensor, scale: torch.Tensor,
              rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GGUF Q8_0 weight (``w = codes * scale`` per group of 32 inputs: codes int8 [N, K], scale
    [N, K / 32], fp16 values) in the order of :class:`BrgemmLinear`'s packed weight: codes int8
    [N / 32, K / 2, 32, 2], scales fp16 [N / 32, K / 32, 32]; padded as :func:`q4_layout` pads."""
    rows = rows or codes.shape[0]
    scales = _fp16(_blocked(scale, rows).transpose(1, 2))
    return None if scales is None else (_pairs(codes, rows).contiguous(), scales)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def packs_for_brgemm(model: nn.Module, device: torch.device) -> bool:
    """Whether :func:`prepack_linears` packs ``model``'s linear layers for :class:`BrgemmLinear`:
    bf16 on a CPU with AVX512-BF16 (where the kernel builds: the runner builds it beside the
    others first)."""
    return has_avx512_bf16() and any(packs(device, linear.weight.dtype) for _, _, linear in _linears(model))


def prepack_linears(model: nn.Module, device: torch.device) -> int:
    """Replaces every ``nn.Linear`` of ``model`` by a :class:`BrgemmLinear` on a CPU with
    AVX512-BF16 (a layer of an odd input width excepted), else a :class:`PackedLinear`, where :func:`packs`;
    returns how many it replaced (0 elsewhere). Quantized layers (int8, int4) are left alone."""
    linears = [entry for entry in _linears(model) if packs(device, entry[2].weight.dtype)]
    brgemm = kernels.brgemm_linear() if linears and packs_for_brgemm(model, device) else None
    gguf_blocks = getattr(model, "gguf_blocks", {})
    replaced = len(linears)
    while linears:  # each plain weight dropped as its packed copy is made, not all at the end
        parent, name, child = linears.pop()
        setattr(parent, name, BrgemmLinear(child, brgemm, gguf_blocks.pop(child, None))
                if brgemm is not None and child.in_features % 2 == 0 else PackedLinear(child))
        del child
    gguf_blocks.clear()  # none left unread where nothing was packed for brgemm
    return replaced
