#!/usr/bin/env bash
# Run the test suite in the project environment (created on first use by scripts/setup_env.sh).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh tests/test_word_kd.py -x
# The suite's training runs are single-threaded subprocesses, so it runs one pytest worker per core
# (pytest-xdist; FAIRSEQ_KD_TEST_WORKERS overrides the count, 1 runs it serially), each test file
# whole on one worker (--dist loadfile: a file's module fixtures are made once), the longest files
# first (tests/conftest.py, LONGEST_FILES).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
PY="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin/python"
WORKERS="${FAIRSEQ_KD_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
parallel=()
if [[ "$WORKERS" -gt 1 ]] && "$PY" -c "import xdist" 2>/dev/null; then
    parallel=(-n "$WORKERS" --dist loadfile)
    # pytest-xdist otherwise hands out the files with the most tests first (--loadscope-reorder,
    # its default), not conftest's LONGEST_FILES order: the short demo, a few long tests, started last
    if "$PY" -c "import inspect, sys, xdist.plugin; sys.exit('--no-loadscope-reorder' not in inspect.getsource(xdist.plugin))" 2>/dev/null; then
        parallel+=(--no-loadscope-reorder)
    fi
fi
exec "$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" "${@:-tests}"
