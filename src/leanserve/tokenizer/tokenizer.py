"""A `tokenizers` tokenizer built from a checkpoint: GGUF metadata or a Hugging Face directory.

GGUF files carry no tokenizer.json, only llama.cpp's description of one (vocabulary, merges,
token types, the pre-tokenizer by name). We rebuild the equivalent `tokenizers` pipeline:
byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the split regex llama.cpp uses for
``tokenizer.ggml.pre``, or SentencePiece BPE (``"llama"``) with byte fallback.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..model.config import ModelLoadError
from ..model.gguf_file import GGUFFile
from .chat_template import ChatTemplate

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), by tokenizer.ggml.pre.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "default": [_GPT2],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
}
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Encoding, decoding, special tokens and the chat template of one checkpoint."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = None
        if chat_template:
            self.set_chat_template(chat_template)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        if os.path.isdir(path):
            return cls._from_hf_dir(path)
        return cls._from_gguf_metadata(GGUFFile(path).metadata)

    @classmethod
    def _from_hf_dir(cls, path: str) -> "Tokenizer":
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise ModelLoadError(f"{path}: no tokenizer.json")
        backend = HFTokenizer.from_file(file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        gen_cfg = _read_json(os.path.join(path, "generation_config.json"))

        def token_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if value else None

        eos = gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not eos_ids and token_id(cfg.get("eos_token")) is not None:
            eos_ids = [token_id(cfg.get("eos_token"))]
        template = cfg.get("chat_template")
        if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()
        return cls(
            backend,
            bos_token_id=token_id(cfg.get("bos_token")),
            eos_token_ids=tuple(eos_ids),
            chat_template=template,
        )

    @classmethod
    def _from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), meta)
        else:
            raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        if add_bos and bos is not None:
            bos_tok = tokens[bos]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)]
            )
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=(eos,) if eos is not None else (),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ---------------------------------------------------------------- use
    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids as int32: the compact form the engine holds, converted once here."""
        return np.asarray(self.backend.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        encs = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (special tokens included): text longer than
        ``n * max_token_chars`` has more than ``n`` tokens, which bounds a prompt's length before
        tokenizing it. Doubled, so a normalizer that merges characters cannot undercut it."""
        pieces = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return 2 * max(1, max(map(len, pieces)))

    def set_chat_template(self, source: str) -> None:
        """Replaces the checkpoint's chat template (``--chat-template``); raises ValueError for
        a template that does not parse."""
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        self.chat_template = ChatTemplate(source, bos_token=bos or "", eos_token=eos or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.chat_template is None:
            raise ValueError("messages: this model has no chat template; use the completions API")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    splits = _SPLITS.get(pre or "default", _SPLITS["default"])
    if pre in (None, "default", "gpt2"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores, meta: dict) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp's "llama" vocabulary: merges ranked by the pieces' scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(vocab, scores or [0.0] * len(tokens))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=pairs, unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True, byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # Spaces become "▁"; the word-initial "▁" is added only where the text does not already
    # start with one (transformers' Llama tokenizer behaves the same).
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tok


def _merges_from_scores(vocab: dict[str, int], scores) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scoring result first."""
    found = []
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                found.append((scores[pid], vocab[left], vocab[right], left, right))
    found.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(m[3], m[4]) for m in found]
