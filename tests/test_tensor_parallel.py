"""Tensor parallelism: each rank's share of the checkpoint, and the split model against the
whole one (logits), its ranks as threads of this process over gloo."""

from __future__ import annotations

import threading

import gguf
import pytest
import torch

from leanserve.engine.distributed.group import DistributedGroup, open_store
from leanserve.model import ModelSpec, load_model
from leanserve.model.attention import AttentionMetadata
from leanserve.model.parallel import TensorParallel

from .gguf_util import tiny_llama, write_llama_gguf
from .test_checkpoints import ALL_TYPES
from .test_engine import prompts_of
from .test_int4 import write_tiny_q4


class Share(TensorParallel):
    """A rank's place without a group: enough to load its share."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


# ------------------------------------------------------------------------------ loading shares


def _whole_and_shares(spec: ModelSpec, size: int = 2):
    return load_model(spec), [load_model(spec, Share(r, size)) for r in range(size)]


def _check_shares(whole, shares) -> None:
    """Every rank holds exactly its Megatron share of every weight of ``whole``."""
    cfg, size = whole.config, len(shares)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    vocab_rows = -(-cfg.vocab_size // size)
    for r, part in enumerate(shares):
        rows = lambda n: slice(r * n // size, (r + 1) * n // size)  # noqa: E731
        vocab = whole.embed_tokens.weight[r * vocab_rows : (r + 1) * vocab_rows]
        assert torch.equal(part.embed_tokens.weight[: len(vocab)], vocab)
        assert not part.embed_tokens.weight[len(vocab) :].any()  # the last rank's padding
        if not cfg.tie_word_embeddings:
            assert torch.equal(part.lm_head.weight[: len(vocab)], whole.lm_head.weight[r * vocab_rows : (r + 1) * vocab_rows])
        for a, b in zip(whole.layers, part.layers):
            qw, kw, vw = a.self_attn.qkv_proj.weight.split([q, kv, kv])
            assert torch.equal(b.self_attn.qkv_proj.weight, torch.cat((qw[rows(q)], kw[rows(kv)], vw[rows(kv)])))
            if a.self_attn.qkv_proj.bias is not None:
                qb, kb, vb = a.self_attn.qkv_proj.bias.split([q, kv, kv])
                assert torch.equal(b.self_attn.qkv_proj.bias, torch.cat((qb[rows(q)], kb[rows(kv)], vb[rows(kv)])))
            assert torch.equal(b.self_attn.o_proj.weight, a.self_attn.o_proj.weight[:, rows(q)])
            gate, up = a.mlp.gate_up_proj.weight.split([inter, inter])
            assert torch.equal(b.mlp.gate_up_proj.weight, torch.cat((gate[rows(inter)], up[rows(inter)])))
            assert torch.equal(b.mlp.down_proj.weight, a.mlp.down_proj.weight[:, rows(inter)])
            assert torch.equal(b.input_layernorm.weight, a.input_layernorm.weight)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}),
                                             ("llama", {"vocab_size": 49153})],
                         ids=["llama", "tied-qwen2-bias", "qwen3-qk-norm", "odd-vocab"])
def test_safetensors_shares(arch, overrides, tiny_model_dir):
    _check_shares(*_whole_and_shares(ModelSpec.resolve(tiny_model_dir(arch, **overrides), "float32")))


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, default_model):
    """Every quantization type, Q and K rows permuted as llama.cpp writes them. Matrices take the
    types in turn (embedding, then q, k, v, o, gate, up, down per layer): layer 0's o_proj is
    Q4_K, whose 256-column blocks straddle its row-parallel split (128 | 128), its down_proj
    Q4_K split on a block boundary (256 | 256)."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf")
    q = gguf.GGMLQuantizationType
    types = [q.F32, q.Q8_0, q.Q4_0, q.Q4_1, q.Q4_K, q.Q5_K, q.Q6_K, q.Q4_K, q.F16, q.BF16]
    assert set(types) == set(ALL_TYPES)
    write_llama_gguf(path, tiny_llama(hidden=256, layers=2), default_model, types)
    return path


def test_gguf_shares_read_only_their_blocks(mixed_gguf):
    _check_shares(*_whole_and_shares(ModelSpec.resolve(mixed_gguf, "float32")))


def test_int4_shares(tmp_path, default_model):
    """``--quantization gguf``: each rank's 4-bit blocks, from the same file, give the same
    products as the whole layer's rows (column-parallel) or partial sums (row-parallel)."""
    spec = ModelSpec.resolve(write_tiny_q4(str(tmp_path / "q4.gguf"), default_model, tied=False), "bfloat16",
                             quantization="gguf")
    whole, shares = _whole_and_shares(spec)
    x = torch.randn(3, whole.config.hidden_size, dtype=torch.bfloat16)
    full = whole.layers[0].self_attn.qkv_proj(x)
    q = whole.config.num_heads * whole.config.head_dim
    assert torch.equal(shares[0].layers[0].self_attn.qkv_proj(x)[:, : q // 2], full[:, : q // 2])
    inter = whole.config.intermediate_size
    h = torch.randn(3, inter, dtype=torch.bfloat16)
    parts = [s.layers[0].mlp.down_proj(h[:, r * inter // 2 : (r + 1) * inter // 2]) for r, s in enumerate(shares)]
    want = whole.layers[0].mlp.down_proj(h).float()
    # Each partial sum is rounded to bf16 on its own: agreement to bf16's precision of the output.
    torch.testing.assert_close(parts[0].float() + parts[1].float(), want, rtol=0, atol=1e-2 * want.abs().max().item())


# ------------------------------------------------------------------------------ the split model


def _logits(model, ids: list[int]) -> torch.Tensor | None:
    """All-position logits of one prompt (one prefill), through the paged attention path."""
    cfg = model.config
    block, n = 16, len(ids)
    kv = torch.zeros(cfg.num_layers, 2, -(-n // block) + 1, block, cfg.num_kv_heads // model.tp.size, cfg.head_dim)
    meta = AttentionMetadata.build(torch.arange(block, block + n), None, None, 0, [(0, n, n, None)])
    return model(torch.tensor(ids), torch.arange(n), kv, meta)


def split_logits(spec: ModelSpec, ids: list[int], size: int = 2) -> torch.Tensor:
    """Rank 0's logits of a model split over ``size`` gloo ranks, here as threads of this process
    (each rank its own group object over one store, as in separate processes)."""
    store, rdv = open_store("127.0.0.1", size)
    out = {}

    def rank(r):
        from torch.distributed import TCPStore

        s = store if r == 0 else TCPStore(rdv.host, rdv.port, size, is_master=False)
        group = DistributedGroup(s, r, size, torch.device("cpu"), "127.0.0.1")
        out[r] = _logits(load_model(spec, group), ids)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[1] is None
    return out[0]


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}),
                                             ("llama", {"vocab_size": 49153})],
                         ids=["llama", "tied-qwen2-bias", "qwen3-qk-norm", "odd-vocab"])
def test_split_model_logits_equal_the_whole(arch, overrides, tiny_model_dir):
    spec = ModelSpec.resolve(tiny_model_dir(arch, **overrides), "float32")
    ids = prompts_of([37])[0].tolist()
    assert_logits_close(split_logits(spec, ids), _logits(load_model(spec), ids))


def test_split_gguf_model_logits_equal_the_whole(mixed_gguf):
    spec = ModelSpec.resolve(mixed_gguf, "float32")
    ids = prompts_of([21])[0].tolist()
    assert_logits_close(split_logits(spec, ids), _logits(load_model(spec), ids))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: the split changes only the order of the sums over the split dimensions, so the
    logits agree to a few float32 ulps of their own scale (these random models' reach ~100)."""
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
