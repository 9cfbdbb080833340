"""bf16 linear weights packed once (model/prepack.py): in oneDNN's layout the same products as
``F.linear``, bit for bit (past one 16-row tile on AMX, to within a rounding); in the layout of
oneDNN's brgemm micro-kernel (kernels/brgemm_linear.cpp), to within a rounding; left alone wherever
the runner does not pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanserve import LLM, SamplingParams
from leanserve.engine import model_runner
from leanserve.model import ModelSpec, kernels, load_model, loader
from leanserve.model.int4 import Int4Linear
from leanserve.model.prepack import (BrgemmLinear, PackedLinear, has_avx512_bf16, packs, prepack_linears, q4_layout,
                                     q8_layout, reads_gguf_blocks)

from .test_int4 import write_tiny_q4
from .test_model import dense_logits

CPU = torch.device("cpu")
PACKS = packs(CPU, torch.bfloat16)
AMX = torch.cpu._is_amx_tile_supported()
BRGEMM = PACKS and has_avx512_bf16()  # where prepack_linears packs for BrgemmLinear


def test_bf16_packs_on_this_cpu_exactly_where_onednn_has_bf16():
    assert PACKS == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not packs(CPU, torch.float32) and not packs(torch.device("cuda"), torch.bfloat16)


def test_prepack_picks_the_layout_of_this_cpu():
    """The brgemm layout on a CPU with AVX512-BF16 (a layer of an odd input width keeps oneDNN's), else
    oneDNN's where it has bf16, else nothing."""
    model = nn.Sequential(nn.Linear(64, 96, dtype=torch.bfloat16), nn.Linear(95, 64, dtype=torch.bfloat16))
    assert prepack_linears(model, CPU) == (2 if PACKS else 0)
    want = (BrgemmLinear if BRGEMM else PackedLinear, PackedLinear) if PACKS else (nn.Linear, nn.Linear)
    assert tuple(type(m) for m in model) == want


def test_without_the_brgemm_kernel_weights_are_packed_for_onednn(monkeypatch):
    """Where the brgemm kernel cannot be built (no compiler: its loader says so and returns None)."""
    monkeypatch.setattr(kernels, "brgemm_linear", lambda: None)
    model = nn.Sequential(nn.Linear(64, 96, dtype=torch.bfloat16))
    assert prepack_linears(model, CPU) == (1 if PACKS else 0)
    assert type(model[0]) is (PackedLinear if PACKS else nn.Linear)


@pytest.mark.skipif(not PACKS, reason="oneDNN has no bf16 on this CPU: nothing is packed")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_packed_products_are_f_linear_bit_for_bit(rows, bias):
    """oneDNN's packed weights (the layout on CPUs without AMX), the default model's shapes (a tall
    head among them) at decode and prefill row counts: the row counts where bf16 F.linear itself
    changes kernels are covered (its rows differ from the one-row result from 17 rows up on some
    CPUs). On a CPU with AMX, past one 16-row tile, oneDNN blocks its sums by the layout the
    weight was packed for: F.linear's weight, packed anew for each call's rows, and the weight
    packed once for one row give sums in another order (seen from 64 rows on a Xeon), each
    deterministic; there they agree to within a bf16 rounding of the products' magnitudes."""
    torch.manual_seed(rows)
    for k, n in ((576, 960), (1536, 576), (576, 4096)):
        lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        want = F.linear(x, lin.weight, lin.bias)
        packed = PackedLinear(lin)
        with torch.inference_mode():
            got = packed(x)
            assert torch.equal(packed(x), got)
        if AMX and rows > 16:
            assert ((got.float() - want.float()).abs() <= magnitudes(x, lin) * 2**-7).all()
        else:
            assert torch.equal(got, want)


def magnitudes(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """|x| |W|^T (+ |b|): the scale of each product's sum, which bounds its rounding errors."""
    out = x.float().abs() @ lin.weight.float().abs().T
    return out + lin.bias.float().abs() if lin.bias is not None else out


@pytest.mark.skipif(not BRGEMM, reason="the brgemm layout is packed on CPUs with AVX512-BF16 only")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 32, 33, 64, 300, 600, 700, 1900])
def test_brgemm_products_are_f_linear_to_within_a_rounding(rows, bias):
    """kernels/brgemm_linear.cpp: one row in its own loop, more in AMX's tiles where the CPU has them
    (bands of 32 rows, the last padded: 2, 3, 17, 33, 300's last 12, 600's 24; inputs in chunks of
    256: 576 is 256, 256 and 64), else and for 70 features in oneDNN's brgemm micro-kernel (17: 16
    rows and a remainder; 600: 256, 256, 80 and 8 rows), against float64 and F.linear; inputs past
    L2's 2 MB taken in groups of 256-row chunks (700 rows of 1,536 features: a chunk a group; 1,900
    of 576: three chunks a group, the last group two). The shapes: the default model's
    (a tall head among them), a width that is not a multiple of the 32-feature blocks, an odd
    number of input pairs (70 features) for the one-row loop's tail, last blocks of 4, 8, 16 and 18
    features (both halves of the masked store)."""
    torch.manual_seed(rows)
    for k, n in ((576, 960), (1536, 576), (576, 4096), (576, 100), (70, 40), (64, 48), (64, 50)):
        lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        ref = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
        want = F.linear(x, lin.weight, lin.bias)
        layer = BrgemmLinear(lin, kernels.brgemm_linear())
        with torch.inference_mode():
            got = layer(x)
            assert torch.equal(layer(x), got)
        scale = magnitudes(x, lin)
        # One rounding to bf16 (half a unit in the last of its 8 bits) plus float32 sums of k terms.
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-8 + scale * k * 2**-23).all()
        assert ((got.float() - want.float()).abs() <= scale * 2**-7).all()


@pytest.mark.skipif(not BRGEMM, reason="the brgemm layout is packed on CPUs with AVX512-BF16 only")
def test_brgemm_linear_takes_any_leading_shape_and_strided_rows():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True, dtype=torch.bfloat16)
    layer = BrgemmLinear(lin, kernels.brgemm_linear())
    qkv = torch.randn(2, 5, 3 * 64, dtype=torch.bfloat16)
    x = qkv[..., 64:128]  # a strided view, as a slice of a fused projection is
    with torch.inference_mode():
        got = layer(x)
        assert got.shape == (2, 5, 96)
        assert torch.equal(got, layer(x.contiguous()))
        assert ((got.float() - F.linear(x, lin.weight, lin.bias).float()).abs() <= magnitudes(x, lin) * 2**-7).all()
        assert layer(x[:, :0]).shape == (2, 0, 96)
        assert torch.equal(layer(x[1, 3]), got[1, 3])  # one dimension: a single row


@pytest.mark.skipif(not BRGEMM, reason="the brgemm layout is packed on CPUs with AVX512-BF16 only")
def test_brgemm_linear_refuses_what_it_cannot_compute():
    lin = nn.Linear(64, 40, bias=True, dtype=torch.bfloat16)
    layer = BrgemmLinear(lin, kernels.brgemm_linear())
    op, x = kernels.brgemm_linear(), torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="brgemm_linear: bfloat16 input and weight"):
        op(x.float(), layer.packed, layer.bias, 40)
    with pytest.raises(RuntimeError, match=r"brgemm_linear: weight packed as \[N / 32, K / 2, 32, 2\] for an input of 62"):
        op(x[:, :62], layer.packed, layer.bias, 40)
    with pytest.raises(RuntimeError, match="brgemm_linear: 65 output features do not fit 2 blocks of 32"):
        op(x, layer.packed, layer.bias, 65)
    with pytest.raises(RuntimeError, match="brgemm_linear: bias float32, padded to the blocks' 64 features"):
        op(x, layer.packed, lin.bias, 40)
    with pytest.raises(RuntimeError, match="brgemm_linear: an input of at least one dimension"):
        op(x[0, 0], layer.packed, layer.bias, 40)
    codes, scales = q4_layout(*q4_blocks(40, 64))
    with pytest.raises(RuntimeError, match="codes and scales go together"):
        op(x, layer.packed, layer.bias, 40, codes)
    with pytest.raises(RuntimeError, match=r"Q4 codes uint8 \[N / 32, K / 2, 32\] with scales"):
        op(x, layer.packed, layer.bias, 40, codes[:, :16].contiguous(), scales)
    codes8, scales8 = q8_layout(*q8_blocks(40, 64))
    op(x[:1], layer.packed, layer.bias, 40, codes8, scales8)
    for bad in ((codes8, scales), (codes8.short(), scales8), (codes, scales8)):
        with pytest.raises(RuntimeError, match=r"or Q8_0 codes int8 \[N / 32, K / 2, 32, 2\]"):
            op(x, layer.packed, layer.bias, 40, *bad)
    with pytest.raises(ValueError, match="blocks: codes .* do not match the weight's 2 blocks"):
        BrgemmLinear(lin, op, q8_layout(*q8_blocks(96, 64)))
    with pytest.raises(RuntimeError, match="float16 scales"):
        op(x, layer.packed, layer.bias, 40, codes, scales.float())


def q4_blocks(n: int, k: int, q4_0: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random GGUF Q4 weight as gguf_q4 gives one: codes, and per group of 32 inputs a scale
    and a minimum of fp16 values (Q4_0: the minimum is -8 times the scale)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = ((torch.rand(n, k // 32, generator=g) - 0.2) / 40).half().float()  # some negative, as in files
    minimum = -8 * scale if q4_0 else (torch.randn(n, k // 32, generator=g) / 10).half().float()
    return codes, scale, minimum


def q8_blocks(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random GGUF Q8_0 weight as gguf_q8 gives one: int8 codes and fp16 scales per 32 inputs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return codes, ((torch.rand(n, k // 32, generator=g) - 0.2) / 100).half().float()


def blocks_linear(codes, scale, minimum=None, bias: bool = False) -> nn.Linear:
    """The bf16 layer a dequantized load gives: codes * scale (+ minimum) in float32, then bf16."""
    n, k = codes.shape
    lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    w = codes.float() * scale.repeat_interleave(32, 1)
    lin.weight.data.copy_(w if minimum is None else w + minimum.repeat_interleave(32, 1))
    return lin


@pytest.mark.skipif(not BRGEMM, reason="the brgemm layout is packed on CPUs with AVX512-BF16 only")
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_one_row_from_gguf_blocks_is_the_bf16_weights_product_bit_for_bit(kind):
    """The one-row loop over a layer's GGUF blocks (model/prepack.py's q4_layout, q8_layout)
    computes what it computes over the dequantized bf16 weights, bit for bit: the default model's
    shapes (the output head's too), a last block of 18 features and one of 50 output features; a
    row of the identity gives a column of the weight itself; more rows read the bf16 copy, as
    without the blocks."""
    shapes = ((960, 576), (576, 1536), (3072, 576), (50, 64), (18, 96), (40, 64)) + ((49152, 576),) * (kind == "Q8_0")
    for (n, k), bias in zip(shapes, (False, True, False, True, True, False, False)):
        if kind == "Q8_0":
            arrays = q8_blocks(n, k, seed=n)
            lin, blocks = blocks_linear(*arrays, bias=bias), q8_layout(*arrays)
        else:
            arrays = q4_blocks(n, k, kind == "Q4_0", seed=n)
            lin, blocks = blocks_linear(*arrays, bias=bias), q4_layout(*arrays)
        plain, read = BrgemmLinear(lin, kernels.brgemm_linear()), BrgemmLinear(lin, kernels.brgemm_linear(), blocks)
        with torch.inference_mode():
            for rows in (1, 1, 2, 17):
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                assert torch.equal(read(x), plain(x)), (n, k, rows)
            if not bias:  # a row of the identity: a column of the weight itself
                eye = torch.eye(k, dtype=torch.bfloat16)
                for i in range(0, k, 5):
                    assert torch.equal(read(eye[i]), lin.weight[:, i])


def test_block_layouts_pad_the_last_block_and_refuse_what_fp16_cannot_hold():
    codes, scale, minimum = q4_blocks(50, 64)
    packed, dm = q4_layout(codes, scale, minimum)
    assert packed.shape == (2, 32, 32) and packed.dtype == torch.uint8
    assert dm.shape == (2, 2, 2, 32) and dm.dtype == torch.float16
    # block 0, pair 3, feature 5: inputs 6 and 7 of row 5, the first in the low nibble
    assert packed[0, 3, 5] == codes[5, 6] | codes[5, 7] << 4
    assert packed[1, 0, 18:].eq(0).all() and dm[1, :, :, 18:].eq(0).all()  # rows 50-63: padding
    assert dm[1, 1, 0, 3] == scale[35, 1] and dm[1, 1, 1, 3] == minimum[35, 1]
    assert q4_layout(codes, scale, minimum * 1e6) is None  # past fp16's range
    # padded to a layer's rows (a tensor-parallel rank's head: its share shorter than its rows)
    padded, padded_dm = q4_layout(codes, scale, minimum, rows=70)
    assert padded.shape == (3, 32, 32) and torch.equal(padded[:2], packed) and not padded[2].any()
    assert torch.equal(padded_dm[:2], dm) and not padded_dm[2].any()
    codes8, scale8 = q8_blocks(50, 64)
    packed8, scales8 = q8_layout(codes8, scale8)
    assert packed8.shape == (2, 32, 32, 2) and packed8.dtype == torch.int8 and scales8.shape == (2, 2, 32)
    assert packed8[0, 3, 5, 1] == codes8[5, 7] and scales8[1, 1, 3] == scale8[35, 1]
    assert packed8[1, :, 18:].eq(0).all() and scales8[1, :, 18:].eq(0).all()
    assert q8_layout(codes8, scale8, rows=70)[0].shape == (3, 32, 32, 2)


@pytest.mark.skipif(not BRGEMM, reason="the brgemm layout is packed on CPUs with AVX512-BF16 only")
def test_with_onednn_disabled_weights_are_packed_for_it_and_the_kernel_says_why_not(monkeypatch):
    """torch.backends.mkldnn.enabled = False turns off oneDNN's micro-kernel too (torch's CPUBlas
    asks it): the runner then keeps oneDNN's packing, and the op refuses more than one row where
    it needs that micro-kernel (inputs not a multiple of 32, or no AMX); on a CPU with AMX its own
    tile loop computes 32 inputs at a time without oneDNN, the same bits as with it on."""
    torch.manual_seed(0)
    narrow = BrgemmLinear(nn.Linear(62, 40, dtype=torch.bfloat16), kernels.brgemm_linear())
    layer = BrgemmLinear(nn.Linear(64, 40, dtype=torch.bfloat16), kernels.brgemm_linear())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = layer(x)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    model = nn.Sequential(nn.Linear(64, 96, dtype=torch.bfloat16))
    assert prepack_linears(model, CPU) == 1 and type(model[0]) is PackedLinear
    with torch.inference_mode():
        layer(x[:1])
        with pytest.raises(RuntimeError, match="torch.backends.mkldnn is disabled"):
            narrow(x[:, :62])
        if torch.cpu._is_amx_tile_supported():
            assert torch.equal(layer(x), want)
        else:
            with pytest.raises(RuntimeError, match="torch.backends.mkldnn is disabled"):
                layer(x)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])  # qwen2: q/k/v biases
def test_a_packed_model_gives_the_same_logits(tiny_model_dir, arch, tied):
    path = tiny_model_dir(arch, tie_word_embeddings=tied)
    model = load_model(ModelSpec.resolve(path, "bfloat16"))
    ids = list(range(5, 45))
    want = dense_logits(model, ids)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model, CPU) == (linears if PACKS else 0)
    got = dense_logits(model, ids)
    if BRGEMM:  # sums in another order: to within the roundings of a bf16 forward
        assert (got.argmax(-1) == want.argmax(-1)).all()
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    else:
        assert torch.equal(got, want)
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


def test_gguf_blocks_are_kept_only_where_brgemm_reads_them(tmp_path, default_model):
    """A GGUF file's Q4 and Q8_0 blocks are kept beside the bf16 weights only for a bf16 model
    (no quantization) on a CPU whose packing reads them, and packing takes them all: the tiny Q4
    model's every layer, the default model's 120 Q4 layers and its Q8_0 head."""
    path = write_tiny_q4(str(tmp_path / "q4.gguf"), default_model, tied=True)
    reads = reads_gguf_blocks(CPU, torch.bfloat16)
    for file, kinds in ((path, {torch.uint8}), (default_model, {torch.uint8, torch.int8})):
        bf16 = load_model(ModelSpec.resolve(file, "bfloat16"))
        linears = sum(type(m) is nn.Linear for m in bf16.modules())
        assert len(bf16.gguf_blocks) == (linears if reads else 0)
        assert {codes.dtype for codes, _ in bf16.gguf_blocks.values()} == (kinds if reads else set())
        prepack_linears(bf16, CPU)
        assert not bf16.gguf_blocks
        assert sum(isinstance(m, BrgemmLinear) and m.block_codes is not None for m in bf16.modules()) == \
            (linears if BRGEMM else 0)
    for variant in (dict(dtype="float32"), dict(dtype="bfloat16", quantization="int8"),
                    dict(dtype="bfloat16", quantization="gguf")):
        assert not load_model(ModelSpec.resolve(path, **variant)).gguf_blocks, variant


@pytest.mark.skipif(not BRGEMM, reason="the brgemm layout is packed on CPUs with AVX512-BF16 only")
@pytest.mark.parametrize("file", ["tiny Q4", "default"])
def test_the_engine_decodes_a_gguf_file_from_its_blocks_as_from_its_bf16_weights(file, tmp_path, default_model,
                                                                               monkeypatch):
    """Through the engine, with a GGUF model's blocks read at one row (the default on AVX512-BF16) and
    without: the same greedy tokens and logprobs, bit for bit, over prefill and decode at 3, 2 and
    1 rows (the one-row steps read the blocks); so the blocks give exactly the weights gguf-py's
    dequantization gives. A tiny model whose every layer is Q4_0 or Q4_1, and the default model
    (Q4_1 layers, a Q8_0 head)."""
    path = write_tiny_q4(str(tmp_path / "q4.gguf"), default_model, tied=False) if file == "tiny Q4" else default_model
    prompts = [list(range(7, 7 + n)) for n in (3, 23, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (8, 16, 24)]

    def run() -> tuple[list[bool], list]:
        with LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20) as llm:
            model = llm.engine.runner.model
            read = [m.block_codes is not None for m in model.modules() if isinstance(m, BrgemmLinear)]
            outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return read, [(list(o.token_ids), o.logprobs) for o in outs]

    read, got = run()
    monkeypatch.setattr(loader, "reads_gguf_blocks", lambda device, dtype: False)
    unread, want = run()
    assert read and all(read) and not any(unread)  # every layer, the head included
    assert got == want


def test_the_engine_packs_its_bf16_model_and_decodes_as_it_would_unpacked(tiny_model_dir, monkeypatch):
    """Greedy tokens and their logprobs through the engine, packed (its default) and with packing
    turned off: prefill and decode steps of several sequences together, then of two, then of one
    (they stop at 8, 16 and 24 tokens). oneDNN's packing gives the same numbers, bit for bit; the
    brgemm layout (on a CPU with AVX512-BF16) the same tokens and logprobs to within a bf16 forward's rounding."""
    path = tiny_model_dir("llama")
    prompts = [list(range(7, 7 + n)) for n in (3, 23, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (8, 16, 24)]

    def run() -> tuple[set, list]:
        with LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20) as llm:
            kinds = {type(m) for m in llm.engine.runner.model.modules()} & {PackedLinear, BrgemmLinear, nn.Linear}
            outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return kinds, [(list(o.token_ids), o.logprobs) for o in outs]

    packed, got = run()
    monkeypatch.setattr(model_runner, "prepack_linears", lambda model, device: 0)
    unpacked, want = run()
    assert (packed, unpacked) == ({BrgemmLinear if BRGEMM else PackedLinear if PACKS else nn.Linear}, {nn.Linear})
    if not BRGEMM:
        assert got == want
        return
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, lps), (_, ref) in zip(got, want):
        for a, b in zip(lps, ref):
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 0.05
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
