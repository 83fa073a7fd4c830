#!/usr/bin/env bash
# Run the test suite in the project environment (created on first use by scripts/setup_env.sh).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh tests/test_word_kd.py -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests}"
