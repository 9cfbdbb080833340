"""Shared fixtures: the default model, and tiny random models of every supported architecture
written by transformers' own ``save_pretrained`` (the reference implementation), and a
Ray cluster on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from leanserve.model import default_model_path
from leanserve.tokenizer import Tokenizer

from .server_util import free_port

torch.set_num_threads(2)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
TINY_VOCAB = 49152  # the default model's vocabulary, so its tokenizer serves the tiny models too


def tiny_hf_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        # Larger weights than the default init: peaked logits, so greedy choices are not near-ties
        # that rounding differences between two correct implementations could flip.
        initializer_range=0.3,
    )
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    return cls(**common)


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_pretrained(default_model)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer):
    """make(arch, **config) -> directory of a tiny random HF model (cached per arguments)."""
    import transformers

    made = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = repr((arch, sorted(overrides.items())))
        if key in made:
            return made[key]
        torch.manual_seed(0)
        cfg = tiny_hf_config(arch, **overrides)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        model.save_pretrained(path)
        default_tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
        made[key] = path
        return path

    return make


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_model_dir, default_model, tmp_path_factory) -> str:
    """A tiny random llama with the default model's tokenizer and chat template: a server on it
    starts in seconds and generates fast, for tests of the server rather than of the model."""
    from leanserve.model.gguf_file import GGUFFile

    from .server_util import write_chat_template

    path = str(tmp_path_factory.mktemp("tinychat") / "m")
    shutil.copytree(tiny_model_dir("llama"), path)
    write_chat_template(path, GGUFFile(default_model).metadata["tokenizer.chat_template"])
    return path


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A one-node Ray cluster on this machine, started as a user would (``ray start --head``),
    stopped with its process group; its address, for ``RAY_ADDRESS``. One per test module that
    uses it (~10 s to start): it is not left running through the rest of the suite."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'leanserve[ray]'")
    port = free_port()
    log = tmp_path_factory.mktemp("raylog") / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={port}", "--num-cpus=8", "--object-store-memory=80000000", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={tmp_path_factory.mktemp('ray')}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        ray.shutdown()
        os.killpg(head.pid, signal.SIGTERM)
        try:  # the raylet goes at once; the GCS may linger 20 s and more, holding nothing a test needs
            head.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
