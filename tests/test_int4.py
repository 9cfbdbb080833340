"""``--quantization gguf``: a GGUF file's Q4_0/Q4_1 linear layers computed on their own 4-bit
blocks (model/int4.py), checked against the blocks dequantized by the ``gguf`` package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from leanserve.engine.config import EngineConfig
from leanserve.model import ModelSpec, int4, load_model
from leanserve.model.int4 import Int4Linear, gguf_q4

from .gguf_util import tiny_llama, write_llama_gguf
from .test_model import assert_greedy_alone_equals_in_a_batch_of_16, dense_logits

Q4 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


def q4_weight(qtype, rows=48, cols=96, seed=0):
    """Blocks of a random weight (rows with an offset, so Q4_1's minimum matters) and their
    dequantized values."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(rows, cols)) * 0.1 + rng.normal(size=(rows, 1)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype))


def to_torch(arrays):
    """gguf_q4's (codes, scale, minimum) as Int4Linear's (codes, scale, zero)."""
    codes, scale, minimum = (torch.from_numpy(a) for a in arrays)
    return codes, scale, minimum + 8 * scale


@pytest.mark.parametrize("qtype", Q4)
def test_int4_linear_is_the_dequantized_matmul(qtype):
    raw, w = q4_weight(qtype)
    x = torch.randn(5, w.shape[1])
    # float32 activations and scales: nothing is rounded, so this pins the kernel's zero-point
    # convention, (q - 8) * scale + zero, to the block's d * q + m.
    torch.testing.assert_close(Int4Linear(*to_torch(gguf_q4(raw, qtype)), torch.float32)(x), x @ w.T,
                               rtol=1e-5, atol=1e-5)
    # bfloat16, as served: scale and zero rounded to bf16, output rounded to bf16.
    xb = x.bfloat16()
    got = Int4Linear(*to_torch(gguf_q4(raw, qtype)), torch.bfloat16)(xb).float()
    torch.testing.assert_close(got, xb.float() @ w.T, rtol=1e-2, atol=1e-2)


def test_int4_rows_do_not_depend_on_the_batch():
    """What makes one format for every batch size batch-invariant: a row's output is bitwise the
    same whatever the number of rows (bf16 F.linear's changes from 33 rows up)."""
    raw, _ = q4_weight(Q4[1], rows=64, cols=128)
    lin = Int4Linear(*to_torch(gguf_q4(raw, Q4[1])), torch.bfloat16)
    x = torch.randn(70, 128, dtype=torch.bfloat16)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    for rows in (4, 16, 33, 64, 70):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows


def test_packing_in_row_slices_gives_the_same_bytes(monkeypatch):
    codes = torch.randint(0, 16, (64 * 5 + 48, 64), dtype=torch.uint8)
    whole = int4._pack(codes, cuda=False)
    monkeypatch.setattr(int4, "PACK_ROWS", 128)
    assert torch.equal(int4._pack(codes, cuda=False), whole)


def write_tiny_q4(path: str, default_model: str, tied: bool) -> str:
    """A tiny random Llama whose every weight matrix is Q4_0 or Q4_1, the head included."""
    write_llama_gguf(path, tiny_llama(hidden=256, layers=2, tied=tied), default_model, list(Q4))
    return path


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory, default_model):
    return write_tiny_q4(str(tmp_path_factory.mktemp("q4") / "tiny-q4.gguf"), default_model, tied=False)


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_q4_model_computes_on_its_blocks(tied, tiny_q4, tmp_path, default_model):
    """Every linear layer (the head too, tied to the embedding or not) is int4, and the logits
    are as close to the float32 model's as bf16 with dequantized weights gets (relative error
    0.04-0.05 on this random model; a wrong layout or zero point gives ~1)."""
    path = write_tiny_q4(str(tmp_path / "tied.gguf"), default_model, tied=True) if tied else tiny_q4
    ours = load_model(ModelSpec.resolve(path, "bfloat16", quantization="gguf"))
    assert ours.config.tie_word_embeddings == tied
    linears = [m for m in ours.modules() if isinstance(m, (nn.Linear, Int4Linear))]
    assert linears and all(isinstance(m, Int4Linear) for m in linears)
    ids = list(range(300, 340))
    want = dense_logits(load_model(ModelSpec.resolve(path, "float32", quantization="none")), ids)
    bf16 = dense_logits(load_model(ModelSpec.resolve(path, "bfloat16", quantization="none")), ids)
    err = ((dense_logits(ours, ids) - want).norm() / want.norm()).item()
    assert err < 0.1 and err < 2 * ((bf16 - want).norm() / want.norm()).item(), err


def test_float_weights_stay_the_default(tiny_q4):
    assert isinstance(load_model(ModelSpec.resolve(tiny_q4, "bfloat16")).layers[0].mlp.down_proj, nn.Linear)


def test_greedy_is_the_same_alone_and_in_a_batch_of_16(tiny_q4):
    assert_greedy_alone_equals_in_a_batch_of_16(tiny_q4, "gguf")


def test_bad_combinations_name_the_field(tiny_q4, tiny_model_dir):
    with pytest.raises(ValueError, match="quantization: gguf needs a bfloat16 model"):
        load_model(ModelSpec.resolve(tiny_q4, "float32", quantization="gguf"))
    with pytest.raises(ValueError, match="quantization: gguf needs a bfloat16 model"):
        EngineConfig(model=tiny_q4, dtype="float32", quantization="gguf").resolve()
    with pytest.raises(ValueError, match="quantization: gguf needs a GGUF file"):
        load_model(ModelSpec.resolve(tiny_model_dir("llama"), "bfloat16", quantization="gguf"))


TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes "
    "along the Seine.",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]\n"
    "    return quicksort([x for x in arr[1:] if x < pivot]) + [pivot]",
    "Once upon a time, in a small village, there lived an old woman who kept a garden full of roses and a "
    "cat named Tom.",
]


def test_default_model_stays_close_to_float32(default_model, default_tokenizer):
    """The default model with its Q4_1 layers int4 against the float32 model (which
    tests/test_model.py checks against transformers), teacher-forced along three texts: top-1
    agreement and logit gaps as with dequantized bf16 weights. Measured: 0.97 / 1.00 / 0.96, max
    |diff| 1.78 (bf16 weights: 1.00 / 1.00 / 0.96, 2.51)."""
    ours, ref = load_model(ModelSpec.resolve(default_model, "bfloat16", quantization="gguf")), load_model(ModelSpec.resolve(default_model, "float32"))
    assert isinstance(ours.layers[0].mlp.gate_up_proj, Int4Linear)
    for text in TEXTS:
        ids = default_tokenizer.encode(text).tolist()
        got, want = dense_logits(ours, ids), dense_logits(ref, ids)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9, text
        assert (got - want).abs().max() < 3.0, text
