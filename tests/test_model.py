"""The model against transformers on the same weights: logits and greedy tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.model import load_model
from leanserve.model.attention import AttentionMetadata

from .conftest import ARCHS

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def dense_logits(model, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through our paged attention path (one prefill)."""
    cfg = model.config
    block = 16
    blocks = -(-len(ids) // block) + 1
    kv = torch.zeros(cfg.num_layers, 2, blocks, block, cfg.num_kv_heads, cfg.head_dim)
    n = len(ids)
    meta = AttentionMetadata.build(torch.arange(block, block + n), None, None, [(0, n, n, None)])
    return model(torch.tensor(ids), torch.arange(n), kv, meta)


def hf_greedy(ref, ids, n=48) -> list[int]:
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def smollm_reference(default_model):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    d, f = os.path.split(default_model)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def test_default_model_logits_match_transformers(default_model, default_tokenizer, smollm_reference):
    ours = load_model(default_model, "float32")
    for text in PROMPTS:
        ids = default_tokenizer.encode(text).tolist()
        with torch.no_grad():
            ref = smollm_reference(torch.tensor([ids])).logits[0]
        assert (dense_logits(ours, ids) - ref).abs().max().item() < 1e-3


def test_default_model_greedy_matches_transformers(default_model, default_tokenizer, smollm_reference):
    prompts = [default_tokenizer.encode(t) for t in PROMPTS]
    with LLM(default_model, dtype="float32", kv_cache_memory=64 << 20) as llm:
        outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(smollm_reference, ids.tolist())


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_architectures_match_transformers(arch, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, "float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49000, size=n).tolist() for n in (5, 17, 40)]
    for ids in prompts:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([ids])).logits[0]
        assert (dense_logits(ours, ids) - ref_logits).abs().max().item() < 1e-3
    with LLM(path, dtype="float32", kv_cache_memory=16 << 20) as llm:
        outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
    ids=["llama3-rope", "tied-llama", "tied-qwen2"],
)
def test_config_variants_match_transformers(arch, overrides, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, "float32")
    ids = list(range(100, 300, 3))  # long enough for the llama3 scaling to matter
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    assert (dense_logits(ours, ids) - ref_logits).abs().max().item() < 1e-3


def test_sharded_safetensors_load(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    ref.save_pretrained(sharded, max_shard_size="2MB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    a, b = load_model(path, "float32"), load_model(sharded, "float32")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_bfloat16_greedy_is_sane(tiny_model_dir):
    """bf16 weights: the first greedy tokens agree with fp32 on a peaked tiny model."""
    path = tiny_model_dir("llama")
    ids = list(range(200, 230))
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(path, dtype="float32", kv_cache_memory=8 << 20) as a, LLM(path, dtype="bfloat16", kv_cache_memory=8 << 20) as b:
        assert a.generate([ids], p)[0].outputs[0].token_ids[:4] == b.generate([ids], p)[0].outputs[0].token_ids[:4]
