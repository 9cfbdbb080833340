#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
[ $rc -eq 5 ] && echo "no tests were collected" >&2
exit $rc
