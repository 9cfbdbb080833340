"""vLLM's ``--generation-config``: sampling defaults from a model's ``generation_config.json``.

``auto`` (the default, as in vLLM) reads the model directory's file, ``leanserve`` uses none,
any other value is a directory holding one. A request's own fields override these; a GGUF file
carries no such file, so ``auto`` finds nothing there.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("leanserve.server")

# generation_config.json key -> request field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_config: str, model_path: str) -> dict:
    if generation_config == "leanserve":
        return {}
    folder = model_path if generation_config == "auto" else generation_config
    if generation_config != "auto" and not os.path.isdir(folder):
        raise ValueError(f"--generation-config: {folder} is not a directory (nor auto or leanserve)")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        found = json.load(f)
    defaults = {field: found[key] for key, field in FIELDS.items() if found.get(key) is not None}
    if defaults:
        log.info("sampling defaults from %s (request fields override them): %s", path, defaults)
    return defaults
