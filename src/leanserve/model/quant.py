"""int8 weights for memory-bound steps (``--quantization int8``).

A decode step of a few sequences reads every weight once and does little arithmetic with it,
so its time is the weight bytes over memory bandwidth. For such steps each linear layer keeps a
weight-only int8 copy of its weight (symmetric, one scale per output channel) and multiplies
with PyTorch's int8-weight GEMM, activations staying in the model's dtype; steps with more rows
are compute-bound and use the model's own weights, which stay loaded. Measured here (AMD EPYC
with AVX512-BF16, 2 threads, bf16 activations), one row: 576 -> 3072 0.06 vs 0.16 ms, the
576 -> 49,152 output head 0.9 vs 4.4 ms; at 16 rows and more int8 loses (0.42 vs 0.33 ms), hence
the row limit. PyTorch's dynamically quantized int8 GEMM (int8 activations too) is faster still
but moved SmolLM2's logits by up to 14 and changed 28 % of its top-1 tokens: activation outliers.

Per-channel int8 of the checkpoint's weights is an approximation on top of the checkpoint's own
(GGUF) quantization; ``tests/test_model.py`` bounds how far it moves logits and greedy tokens.
A step's row count picks the weights, so with int8 on, a greedy output can depend on what else
was in the batch: batch invariance holds with the default (``none``).
The kernel is vectorised for bfloat16 activations only (with float32 ones it ran ~10x slower
than a float32 GEMM here), so int8 requires a bfloat16 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallBatchInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, max_rows: int = 4):
        super().__init__()
        self.weight, self.bias, self.max_rows = linear.weight, linear.bias, max_rows
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.to(linear.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(x, self.qweight, self.scale)  # scale is in x's dtype: bf16
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]}, int8 at <= {self.max_rows} rows"


QUANTIZATIONS = ("none", "int8", "gguf")


def check_quantization(quantization: str, dtype: torch.dtype) -> None:
    """``int8`` and ``gguf`` (:mod:`.int4`) need a bfloat16 model: their kernels are vectorised
    for bf16 activations (with float32 ones, int8 ran ~10x and int4 5-24x slower than a float32
    GEMM here, ``bench/results/int4.md``)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unsupported {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if quantization in ("int8", "gguf") and dtype != torch.bfloat16:
        raise ValueError(f"quantization: {quantization} needs a bfloat16 model (dtype is {dtype}); its kernel is "
                         "slow with float32 activations")


def quantize_linears(model: nn.Module) -> nn.Module:
    """Wraps every ``nn.Linear`` of ``model`` in a :class:`SmallBatchInt8Linear`, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, SmallBatchInt8Linear(child))
    return model
