"""int8 weights (``--quantization int8``): every linear layer computes with a weight-only int8
copy of its weight (symmetric, one scale per output channel) through PyTorch's int8-weight GEMM,
activations staying in the model's dtype; the float weight is dropped.

At every row count, so one weight format whatever the batch: a row's result does not depend on
the other rows of its step, and a request's greedy output not on its neighbours (it used to take
the int8 copy only for steps of at most 4 rows and the bf16 weights above, so an answer could
change with the load). The price is speed on large steps: the kernel is a weight-streaming GEMV
at heart. Measured here (AMD EPYC with AVX512-BF16, 2 threads, 576 -> 1536, bf16 activations),
GFLOP/s at 1 / 8 / 32 / 128 / 512 rows: int8 62 / 126 / 146 / 148 / 147, packed bf16 (the
default, ``prepack.py``) 38 / 212 / 343 / 409 / 432 (``bench/results/model.md``): int8 wins at
one row (a batch-1 decode step ~23 -> ~18 ms) and loses from 8 on, and it halves the weights'
memory. PyTorch's dynamically quantized int8 GEMM (int8 activations too) is faster still but
moved SmolLM2's logits by up to 14 and changed 28 % of its top-1 tokens: activation outliers.

Per-channel int8 of the checkpoint's weights is an approximation on top of the checkpoint's own
(GGUF) quantization; ``tests/test_model.py`` bounds how far it moves logits and greedy tokens.
The kernel is vectorised for bfloat16 activations only (with float32 ones it ran ~10x slower
than a float32 GEMM here), so int8 requires a bfloat16 model.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.to(linear.weight.dtype), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x, self.qweight, self.scale)  # scale is in x's dtype: bf16
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8 weights"


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
    """Replaces every ``nn.Linear`` of ``model`` by an :class:`Int8Linear`, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return model
