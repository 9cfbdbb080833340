"""bf16 linear weights packed in oneDNN's layout (model/prepack.py): the same products as
``F.linear``, bit for bit, wherever the runner packs them; left alone wherever it does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanserve import LLM, SamplingParams
from leanserve.engine import model_runner
from leanserve.model import ModelSpec, load_model
from leanserve.model.int4 import Int4Linear
from leanserve.model.prepack import PackedLinear, packs, prepack_linears

from .test_int4 import write_tiny_q4
from .test_model import dense_logits

CPU = torch.device("cpu")
PACKS = packs(CPU, torch.bfloat16)
AMX = torch.cpu._is_amx_tile_supported()


def test_bf16_packs_on_this_cpu_exactly_where_onednn_has_bf16():
    assert PACKS == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not packs(CPU, torch.float32) and not packs(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_packed_products_are_f_linear_bit_for_bit(rows, bias):
    """The default model's shapes (a tall head among them) at decode and prefill row counts: the
    row counts where bf16 F.linear itself changes kernels are covered (its rows differ from the
    one-row result from 17 rows up on some CPUs). On a CPU with AMX, past one 16-row tile,
    oneDNN blocks its sums by the layout the weight was packed for: F.linear's weight, packed
    anew for each call's rows, and the weight packed once for one row give sums in another
    order (seen from 64 rows on a Xeon), each deterministic; there they agree to within a bf16
    rounding of the products' magnitudes."""
    torch.manual_seed(rows)
    for k, n in ((576, 960), (1536, 576), (576, 4096)):
        lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        model = nn.Sequential(lin)
        want = F.linear(x, lin.weight, lin.bias)
        assert prepack_linears(model, CPU) == (1 if PACKS else 0)
        assert isinstance(model[0], PackedLinear if PACKS else nn.Linear)
        with torch.inference_mode():
            got = model(x)
            assert torch.equal(model(x), got)
        if AMX and PACKS and rows > 16:
            magnitude = x.float().abs() @ lin.weight.float().abs().T
            if bias:
                magnitude += lin.bias.float().abs()
            assert ((got.float() - want.float()).abs() <= magnitude * 2**-7).all()
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])  # qwen2: q/k/v biases
def test_a_packed_model_gives_the_same_logits(tiny_model_dir, arch, tied):
    path = tiny_model_dir(arch, tie_word_embeddings=tied)
    model = load_model(ModelSpec.resolve(path, "bfloat16"))
    ids = list(range(5, 45))
    want = dense_logits(model, ids)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model, CPU) == (linears if PACKS else 0)
    assert torch.equal(dense_logits(model, ids), want)
    if tied:  # the embedding keeps its table; the head multiplies with its own packed copy
        assert model.embed_tokens.weight.shape == (model.config.vocab_size, model.config.hidden_size)


def test_float32_and_int4_layers_are_left_alone(tiny_model_dir, tmp_path, default_model):
    fp32 = load_model(ModelSpec.resolve(tiny_model_dir("llama"), "float32"))
    assert prepack_linears(fp32, CPU) == 0
    q4 = load_model(ModelSpec.resolve(write_tiny_q4(str(tmp_path / "q4.gguf"), default_model, tied=False),
                                      "bfloat16", quantization="gguf"))
    int4 = sum(isinstance(m, Int4Linear) for m in q4.modules())
    prepack_linears(q4, CPU)
    assert sum(isinstance(m, Int4Linear) for m in q4.modules()) == int4 > 0


def test_the_engine_packs_its_bf16_model_and_decodes_as_it_would_unpacked(tiny_model_dir, monkeypatch):
    """Greedy tokens and their logprobs through the engine, packed (its default) and with packing
    turned off, are the same: prefill and decode steps of several sequences together."""
    path = tiny_model_dir("llama")
    prompts = [list(range(7, 7 + n)) for n in (3, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run() -> tuple[bool, list]:
        with LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20) as llm:
            packed = any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
            outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return packed, [(list(o.token_ids), o.logprobs) for o in outs]

    packed, got = run()
    monkeypatch.setattr(model_runner, "prepack_linears", lambda model, device: 0)
    unpacked, want = run()
    assert (packed, unpacked) == (PACKS, False)
    assert got == want
