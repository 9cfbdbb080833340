"""Tokenizer, chat template and incremental detokenizer against transformers on the same GGUF."""

from __future__ import annotations

import os

import pytest

from leanserve.tokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,   runs of   spaces\n\n\nand\ttabs\t\t",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", a[i]); }',
    "emoji 🤗🚀👩‍👩‍👧 and flags 🇫🇷",
    "CJK 你好，世界。日本語のテキスト 한국어",
    "numbers 12345, 3.14159, 1e-9 and 2026-12-02",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special in text: a<|endoftext|>b <repo_name> c",
    "café naïve résumé Ünïcödé",
    "It's we'll they're I'd you've",
    "",
    " ",
    "\n",
    "   \n  \n",
    "https://example.com/path?q=1&r=2#frag",
    "Ωμέγα Привет мир مرحبا",
]


@pytest.fixture(scope="module")
def reference(default_model):
    from transformers import AutoTokenizer

    d, f = os.path.split(default_model)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(text, default_tokenizer, reference):
    assert default_tokenizer.encode(text).tolist() == reference(text)["input_ids"]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(skip, default_tokenizer, reference):
    for text in CORPUS:
        ids = reference(text)["input_ids"]
        assert default_tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔"},
    ],
    [
        {"role": "user", "content": "First"},
        {"role": "assistant", "content": "Second"},
        {"role": "user", "content": "Third"},
    ],
]


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(conv, add_generation_prompt, default_tokenizer, reference):
    ours = default_tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
    ref = reference.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref


def stream_text(tok, ids, **kw) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.add([i]) for i in ids]
    deltas.append(d.flush())
    return deltas, d.text


@pytest.mark.parametrize("text", CORPUS)
def test_incremental_detokenization_matches_full_decode(text, default_tokenizer):
    ids = default_tokenizer.encode(text).tolist()
    deltas, joined = stream_text(default_tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) == joined == default_tokenizer.decode(ids, skip_special_tokens=False)


def test_multibyte_character_never_split(default_tokenizer):
    ids = default_tokenizer.encode("🤗🚀你好").tolist()
    assert len(ids) > 4  # the characters span several byte-level tokens
    deltas, _ = stream_text(default_tokenizer, ids)
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # whole characters only


def test_special_tokens_skipped_unless_asked(default_tokenizer):
    ids = default_tokenizer.encode("<|im_start|>hello<|im_end|>").tolist()
    assert stream_text(default_tokenizer, ids)[1] == "hello"
    assert stream_text(default_tokenizer, ids, skip_special_tokens=False)[1] == "<|im_start|>hello<|im_end|>"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(default_tokenizer, include):
    ids = default_tokenizer.encode("alpha beta STOP gamma delta").tolist()
    deltas, text = stream_text(default_tokenizer, ids, stop=["ST" + "OP"], include_stop_str_in_output=include)
    assert text == ("alpha beta STOP" if include else "alpha beta ")
    assert "".join(deltas) == text


def test_stop_string_never_leaks_partially(default_tokenizer):
    ids = default_tokenizer.encode("one two three").tolist()
    deltas, text = stream_text(default_tokenizer, ids, stop=["two thr"])
    assert text == "one " and "".join(deltas) == "one "


@pytest.fixture(scope="module")
def sentencepiece_pair(tmp_path_factory):
    """(ours, transformers') tokenizers of one SentencePiece-vocabulary GGUF file."""
    from transformers import AutoTokenizer

    from leanserve.tokenizer import Tokenizer

    from .gguf_util import write_sentencepiece_gguf

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_sentencepiece_gguf(str(path))
    return Tokenizer.from_pretrained(str(path)), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", CORPUS + ["  two spaces", " lead", "trail  ", "a\n\nb", "<s>x</s>"])
def test_sentencepiece_gguf_matches_transformers(text, sentencepiece_pair):
    ours, ref = sentencepiece_pair
    ids = ours.encode(text).tolist()
    assert ids == ref(text)["input_ids"]
    assert ids[0] == 1  # add_bos_token
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    deltas, joined = stream_text(ours, ids)
    assert "".join(deltas) == joined == ours.decode(ids)
