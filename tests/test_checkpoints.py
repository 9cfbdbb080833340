"""GGUF quantization types against transformers' own dequantizer, and bad checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch

from leanserve.model import ModelLoadError, ModelSpec, load_model
from leanserve.tokenizer import Tokenizer

from .gguf_util import tiny_llama, write_llama_gguf
from .test_model import dense_logits

Q = gguf.GGMLQuantizationType
ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, default_model):
    """One file whose weight matrices use every required quantization type."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf")
    model = tiny_llama(hidden=256, layers=2)
    write_llama_gguf(path, model, default_model, ALL_TYPES)
    return path


def test_every_quant_type_matches_transformers(mixed_gguf):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    d, f = os.path.split(mixed_gguf)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    ours = load_model(ModelSpec.resolve(mixed_gguf, "float32"))
    ids = list(range(500, 540))
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    got = dense_logits(ours, ids)
    assert torch.isfinite(got).all()
    assert (got - ref_logits).abs().max().item() < 1e-3


def test_gguf_file_tokenizer_matches_source(mixed_gguf, default_tokenizer):
    tok = Tokenizer.from_pretrained(mixed_gguf)
    text = "GGUF round trip: 123 héllo <|im_start|>"
    assert tok.encode(text).tolist() == default_tokenizer.encode(text).tolist()


# ------------------------------------------------------------------------------ bad input


def one_line(err: Exception) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


def test_missing_path():
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve("/nonexistent/model.gguf"))
    assert "does not exist" in one_line(e.value)


def test_not_a_model_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve(str(p)))
    assert "neither a GGUF file" in one_line(e.value)


def test_truncated_gguf(tmp_path, mixed_gguf):
    p = tmp_path / "truncated.gguf"
    with open(mixed_gguf, "rb") as src:
        p.write_bytes(src.read(os.path.getsize(mixed_gguf) // 2))
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve(str(p)))
    assert "truncated or invalid GGUF" in one_line(e.value)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_architecture(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"] = "gpt_neox"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve(path))
    assert "unsupported architecture 'gpt_neox'" in one_line(e.value)


def _rewrite_safetensors(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    _rewrite_safetensors(path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve(path))
    assert "missing tensor model.layers.1.mlp.down_proj.weight" in one_line(e.value)


def test_wrong_shape(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")

    def shrink(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :10].contiguous()

    _rewrite_safetensors(path, shrink)
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve(path))
    assert "model.layers.0.self_attn.o_proj.weight has shape (64, 10), expected (64, 64)" in one_line(e.value)


def test_truncated_safetensors(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec.resolve(path))
    assert "unreadable safetensors" in one_line(e.value)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model(ModelSpec.resolve(None, dtype="int3"))
