"""The elementwise ops of a decoder layer (model/layer_ops.py): leanserve's CPU kernels against
the PyTorch path they replace, which the model tests hold to transformers."""

from __future__ import annotations

import pytest
import torch

from leanserve.model.layer_ops import LayerOps, use_cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def both():
    """(PyTorch ops, CPU kernel ops)."""
    fast = LayerOps()
    assert use_cpu_kernels(fast, torch.device("cpu"), torch.bfloat16), "the kernels did not build here (see the log)"
    return LayerOps(), fast


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_close(got, want, dtype):
    # bf16: within one bf16 step (2^-8 relative): a sum in another order, or a rounding in another
    # place (F.rms_norm rounds once, after the weight; transformers' module before it too).
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)


def transformers_rms_norm(x, weight, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps)
    norm.weight.data = weight.clone()
    with torch.no_grad():
        return norm(x)


def assert_like_transformers(got, x, weight, eps, dtype):
    """The kernel rounds where transformers' module rounds: float32 to its last bits, bf16 on all
    but a few elements (a sum of squares in another order can move a rounding)."""
    want = transformers_rms_norm(x, weight, eps)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    else:
        assert_close(got, want, dtype)
        assert (got != want).sum().item() <= 1e-3 * got.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 300])  # 300 x 576: spread over the threads
@pytest.mark.parametrize("scale", [4.0, 1e-3])  # 1e-3: eps (1e-5) outweighs the mean square
def test_rms_norm_and_the_residual_add(both, dtype, rows, scale):
    ref, fast = both
    x, residual = randn(rows, 576, dtype=dtype, scale=scale), randn(rows, 576, dtype=dtype, seed=1, scale=scale)
    weight, eps = randn(576, dtype=dtype, seed=2), 1e-5
    got = fast.rms_norm(x, weight, eps)
    assert_close(got, ref.rms_norm(x, weight, eps), dtype)
    assert_like_transformers(got, x, weight, eps, dtype)

    want_h, want_res = ref.add_rms_norm(x.clone(), residual.clone(), weight, eps)
    x_in, res_in = x.clone(), residual.clone()
    got_h, got_res = fast.add_rms_norm(x_in, res_in, weight, eps)
    assert got_h is x_in and got_res is res_in  # in place: the stream never copied
    assert torch.equal(got_res, want_res)  # the add rounds as torch's does, bit for bit
    assert_close(got_h, want_h, dtype)
    assert_like_transformers(got_h, want_res, weight, eps, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_strided_view(both, dtype):
    """q/k norms (Qwen3) normalise the heads inside the fused QKV output: a view, not a tensor."""
    ref, fast = both
    qkv = randn(5, 9 * 64 + 2 * 3 * 64, dtype=dtype)
    heads = qkv[:, : 12 * 64].view(5, 12, 64)[:, :9]
    weight = randn(64, dtype=dtype, seed=3)
    got = fast.rms_norm(heads, weight, 1e-6)
    assert got.shape == (5, 9, 64)
    assert_close(got, ref.rms_norm(heads, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
def test_rotary_in_place_inside_the_qkv_output(both, dtype, rows):
    """Rotating q and k heads where the QKV GEMM left them: bitwise the PyTorch rotation, and
    the value heads beside them untouched."""
    ref, fast = both
    heads, kv_heads, dim = 9, 3, 64
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.rand(rows, dim // 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    want = ref.rotate(qk.clone(), cos, sin)
    values = qkv[:, (heads + kv_heads) * dim :].clone()
    got = fast.rotate(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_silu_and_mul(both, dtype, rows):
    ref, fast = both
    gate_up = randn(rows, 2 * 1536, dtype=dtype, scale=6.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, float("inf"), 1e-30]).to(dtype)
    got = fast.silu_and_mul(gate_up)
    assert got.shape == (rows, 1536)
    assert_close(got, ref.silu_and_mul(gate_up), dtype)
    for g in (float("nan"), float("-inf")):  # NaN in, NaN out; -inf * sigmoid(-inf) is NaN in torch too
        assert torch.isnan(fast.silu_and_mul(torch.tensor([[g, 1.0]], dtype=dtype))).all()
        assert torch.isnan(ref.silu_and_mul(torch.tensor([[g, 1.0]], dtype=dtype))).all()


def test_bad_arguments(both):
    _, fast = both
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fast.rms_norm(x.half(), torch.ones(64).half(), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        fast.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        fast.add_rms_norm(x, torch.randn(4, 64).bfloat16(), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        fast.rotate(x.view(4, 1, 64), torch.ones(4, 16), torch.ones(4, 16))
    with pytest.raises(RuntimeError, match="gate_up"):
        fast.silu_and_mul(torch.randn(4, 7))


def test_the_kernels_apply_on_the_cpu_in_float32_and_bfloat16_only():
    ops = LayerOps()
    for device, dtype in ((torch.device("cpu"), torch.float16), (torch.device("meta"), torch.float32)):
        assert not use_cpu_kernels(ops, device, dtype) and ops.kernels is None
