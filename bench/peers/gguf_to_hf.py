"""A bf16 Hugging Face copy of a GGUF model, for the peers that have no GGUF loader (vLLM's CPU
build: its GGUF support is a CUDA plugin). transformers dequantizes the GGUF's weights (Q4_1 for
the default model) and writes config, safetensors, generation config and the tokenizer from the
GGUF's own metadata, so the peer serves the same weights (up to bf16 rounding of the
dequantized values) and the same tokenizer and chat template as the engines that read the GGUF.

    python bench/peers/gguf_to_hf.py MODEL.gguf OUT_DIR

Writes into OUT_DIR.tmp and renames it at the end, so OUT_DIR exists only when complete.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main() -> None:
    gguf, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True))
    # The weights are now plain bf16: without this the saved config would still claim GGUF
    # quantization, and vLLM would look for a GGUF loader it does not have.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"bf16 copy of {gguf.name} in {out}")


if __name__ == "__main__":
    main()
