"""The elementwise work of a decoder layer, in one place: RMS norm (alone, and with the residual
add before it), the rotary embedding, SiLU-and-multiply.

The model's modules call these for that work and nothing else, so it has one home and two
implementations side by side: PyTorch ops (every device) or leanserve's CPU kernels
(``kernels/layer_ops.cpp``), which :func:`use_cpu_kernels` switches on where they apply and
build. Eager PyTorch runs this work as ~60 small ops a layer; the kernels as 4 calls, each one
pass over its rows (why and what it buys: the .cpp's header). The two agree within one rounding
of the tensor's dtype, and the kernels round where transformers' modules do, which PyTorch's
fused ``F.rms_norm`` does not quite: it rounds a bf16 norm once, after the weight, where
transformers' RMSNorm also rounds before it (tests/test_layer_ops.py holds the kernels to both).
The kernels take what the model hands them: 2-D contiguous rows for the norm with the residual
and for SiLU-and-multiply, one dtype throughout.

Both keep a pre-norm decoder's residual stream the same way (vLLM's shape): a layer takes the
stream and the last sub-block's output and returns the next ones; the kernels add and normalise
in place, the PyTorch path returns new tensors, so callers always use what is returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels


class LayerOps:
    """One per model, shared by its modules (like its :class:`~.parallel.TensorParallel`)."""

    def __init__(self):
        self.kernels = None  # torch.ops.leanserve once use_cpu_kernels found them

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is None:
            return F.rms_norm(x, weight.shape, weight, eps)
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the next sub-block's input and the stream."""
        if self.kernels is None:
            residual = x + residual
            return self.rms_norm(residual, weight, eps), residual
        self.kernels.add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding, half-split (GPT-NeoX / Hugging Face) layout, of x [T, heads, D]
        (a view into the QKV output: the kernels rotate it in place); cos, sin [T, D/2]."""
        if self.kernels is None:
            cos, sin = cos[:, None], sin[:, None]
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        self.kernels.rotary_(x, cos, sin)
        return x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for ``gate_up`` = [gate | up] along its last dimension."""
        if self.kernels is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.kernels.silu_and_mul(gate_up)


def use_cpu_kernels(ops: LayerOps, device: torch.device, dtype: torch.dtype) -> bool:
    """Routes ``ops`` through leanserve's CPU kernels where they apply (the CPU; float32 or
    bfloat16) and build here, else through PyTorch; returns whether the kernels run."""
    applies = device.type == "cpu" and dtype in kernels.DTYPES
    ops.kernels = kernels.layer_ops() if applies else None
    return ops.kernels is not None
