#!/usr/bin/env bash
# Sets everything up and serves the default model: bash scripts/serve.sh [leanserve serve args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/leanserve serve "$@"
