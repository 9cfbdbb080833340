"""Writing small GGUF files in tests, laid out as llama.cpp's converter lays them out."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from leanserve.model.gguf_file import GGUFFile

# Byte layouts of the K-quant blocks (ggml-common.h): offsets of the fp16 scale fields, which
# we set so random payloads dequantize to finite, moderate weights: 0.0002 gives Q4_K weights of
# ~0.04 mean and ~0.06 rms (0.002 gave ~0.4, and logits of ~200 that a change in the last bit of
# every weight moved by 2e-3: twice what a test of them against transformers allows).
_K_SCALE_OFFSETS = {
    gguf.GGMLQuantizationType.Q4_K: (0, 2),  # d, dmin
    gguf.GGMLQuantizationType.Q5_K: (0, 2),
    gguf.GGMLQuantizationType.Q6_K: (208,),  # d at the end of the 210-byte block
}
K_SCALE = 0.0002


def encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16)
    if qtype in _K_SCALE_OFFSETS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in _K_SCALE_OFFSETS[qtype]:
            raw[:, :, off : off + 2] = np.frombuffer(np.float16(K_SCALE).tobytes(), np.uint8)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: str, hf_model, tokenizer_source: str, qtypes: list, seed: int = 0) -> None:
    """Writes a transformers Llama model as GGUF; weight matrices cycle through ``qtypes``."""
    cfg = hf_model.config
    rng = np.random.default_rng(seed)
    src = GGUFFile(tokenizer_source).metadata
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src["tokenizer.ggml.pre"])
    w.add_token_list(src["tokenizer.ggml.tokens"])
    w.add_token_types(src["tokenizer.ggml.token_type"])
    w.add_token_merges(src["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    i = 0
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        if name in names:
            gname = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{layer_names[rest]}"
        if gname.endswith("attn_q.weight"):
            t = llama_permute(t, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            t = llama_permute(t, cfg.num_key_value_heads)
        if t.ndim == 1:
            w.add_tensor(gname, t.astype(np.float32))
            continue
        qtype = qtypes[i % len(qtypes)]
        i += 1
        data = encode(t, qtype, rng)
        w.add_tensor(gname, data, raw_shape=data.shape if qtype in (gguf.GGMLQuantizationType.F32,
                     gguf.GGMLQuantizationType.F16) else None, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_llama(hidden: int = 256, layers: int = 1, vocab: int = 49152, tied: bool = False):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, initializer_range=0.3,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?",
    "def f(x):\n    return x * 2", "Numbers 12345 and 3.14159", "café naïve résumé",
]


def write_sentencepiece_gguf(path: str) -> None:
    """A GGUF whose vocabulary is a SentencePiece BPE model (tokenizer.ggml.model = "llama"),
    trained here on a small corpus, with scores and token types as llama.cpp writes them."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 200), model_writer=proto, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    # llama.cpp token types: 1 normal, 2 unknown, 3 control, 6 byte
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(sp.get_piece_size())]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
