"""4-bit weights kept as the checkpoint stores them (``--quantization gguf``).

A GGUF Q4_0 or Q4_1 block holds 32 weights of one row as 4-bit codes ``q`` with an fp16 scale
``d`` (and, for Q4_1, an fp16 minimum ``m``): ``w = d * q + m`` (Q4_0: ``w = d * (q - 8)``).
PyTorch's int4 GEMM computes with ``w = (q - 8) * scale + zero`` per group of 32 inputs (checked
against a float reference in ``tests/test_int4.py``), so a block maps onto a group exactly with
``scale = d``, ``zero = m + 8 d`` (Q4_0: ``zero = 0``); only the rounding of ``d`` and ``zero``
to bfloat16 is lost. A step reads 5 bits per weight (the code, and two 16-bit numbers per 32)
instead of bf16's 16.

Measured here (2-core Xeon with AMX, bf16 activations, ``bench/results/int4.md``): at 1-4 rows
the int4 kernel takes 0.4-0.8x the time of a bf16 ``F.linear`` on the default model's layer
shapes; at 16 rows 1.7-2.5x, at 64 rows ~5x, at 512 rows ~10x, where bf16 runs on AMX and the
int4 kernel dequantizes in AVX-512 registers. Within a model the kernel is used at every row
count: switching by row count would make a sequence's numbers depend on how many others share
its step, while this kernel's output for a row is bitwise the same at every row count (bf16
``F.linear``'s is not, from 33 rows up). That makes it a small-batch format: a batch-1 decode
step of the default model 2x faster, a 512-token prefill ~5x slower, so it is opt-in.

The packed layout differs by device (CPU: ``_convert_weight_to_int4pack_for_cpu`` from int32
codes; CUDA: ``_convert_weight_to_int4pack`` from two codes per byte; both take the scales and
zeros as [in / 32, out, 2]), so a module is built on the device it runs on and is not moved
afterwards. The CUDA branch is written to that op's contract but untested here (no GPU).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

GROUP = 32  # GGUF's Q4 block size, one of the group sizes the kernels take
Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
Q8_TYPES = (GGMLQuantizationType.Q8_0,)  # read only by BrgemmLinear's one-row loop (model/prepack.py)
# The CPU packing works on blocks of 64 output rows: packing 64-row-aligned slices one at a time
# gives the same bytes (tests/test_int4.py) and bounds the int32 copy of the codes it needs.
PACK_ROWS = 4096


def packable(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Shapes both kernels take: out % 16 == 0 (CPU; CUDA needs % 8) and whole groups of 32."""
    return qtype in Q4_TYPES and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % GROUP == 0


class Int4Linear(nn.Module):
    """``y = x @ w.T + bias`` with ``w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``,
    computed in the dtype the module was built for (bfloat16: see :mod:`.quant`)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None):
        """``codes``: uint8 [out, in] in 0..15; ``scale``, ``zero``: [out, in / 32]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.cuda_kernel = codes.device.type == "cuda"
        self.register_buffer("packed", _pack(codes, self.cuda_kernel), persistent=False)
        self.register_buffer("scale_and_zeros", torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous(),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()  # the CPU kernel wants a contiguous input
        mm = torch.ops.aten._weight_int4pack_mm if self.cuda_kernel else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(x, self.packed, GROUP, self.scale_and_zeros).view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int4 groups of {GROUP}"


def _pack(codes: torch.Tensor, cuda: bool) -> torch.Tensor:
    if cuda:
        return torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), 2)
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    parts = [pack(codes[i : i + PACK_ROWS].to(torch.int32), 2) for i in range(0, codes.shape[0], PACK_ROWS)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gguf_q4(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1 blocks [rows, bytes] -> (codes uint8 [rows, cols], scale, minimum float32
    [rows, cols / 32]) with ``w = codes * scale + minimum`` per group of 32, the block's own
    numbers (fp16 values; Q4_0's minimum is ``-8 d``). :class:`Int4Linear` takes
    ``zero = minimum + 8 * scale``."""
    size = 18 if qtype == GGMLQuantizationType.Q4_0 else 20
    blocks = raw.reshape(raw.shape[0], -1, size)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0] if size == 20 else -8 * d
    qs = blocks[..., size - 16 :]  # byte j: weight j in the low nibble, weight j + 16 in the high one
    return np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(raw.shape[0], -1), d, m


def gguf_q8(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks [rows, bytes] -> (codes int8 [rows, cols], scale float32 [rows, cols / 32])
    with ``w = codes * scale`` per group of 32, the block's own numbers (fp16 scales)."""
    assert qtype in Q8_TYPES, qtype
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    return blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1), d
