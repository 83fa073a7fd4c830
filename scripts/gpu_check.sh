#!/usr/bin/env bash
# The GPU check (fairseq_kd_recipes.gpu_check) on a lent GPU machine, from the kit that
# scripts/gpu_kit.sh gathered: its wheels installed into /tmp, fairseq-fixed built there from its
# sdist (only the C++/Cython extensions fairseq-kd imports), then the check on the kit's corpus,
# given what is left of GPU_CHECK_SECONDS (default 540: the check's 9 minutes, install included).
#
#   bash scripts/gpu_check.sh OUT [gpu_check flags]      # on the GPU machine (Python 3.12, CUDA torch)
#   bash scripts/gpu_check.sh OUT --cpu [flags]          # here, in .venv: the dry run on tiny models
#
# docs/DEVELOPING.md ("The GPU check") gives the device call. OUT gets gpu_check.md and .json.
set -euo pipefail
START=$SECONDS
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: bash scripts/gpu_check.sh OUT [flags of python -m fairseq_kd_recipes.gpu_check]}"
shift
KIT="${GPU_KIT:-$ROOT/.gpu_kit}"
BUDGET="${GPU_CHECK_SECONDS:-540}"
mkdir -p "$OUT"
[[ -f "$KIT/data-bin/prepare.json" ]] || { echo "gpu_check.sh: no kit in $KIT: run bash scripts/gpu_kit.sh first" >&2; exit 2; }

if [[ " $* " == *" --cpu "* ]]; then
    PY="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin/python"
    [[ -x "$PY" ]] || "$ROOT/scripts/setup_env.sh"  # an existing environment is used as it is
else
    PY="${PYTHON:-python3}"
    SITE=/tmp/fairseq_kd_site
    SOURCE=/tmp/fairseq_kd_fairseq
    if ! PYTHONPATH="$SITE:$SOURCE" "$PY" -c "import fairseq.data.data_utils_fast, fairseq.data.token_block_utils_fast, fairseq.libbleu, hydra, sacremoses" 2>/dev/null; then
        echo "[gpu_check.sh] installing the kit's wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
            --target "$SITE" "$KIT"/wheels/*.whl "$KIT"/wheels/antlr4-python3-runtime-*.tar.gz
        echo "[gpu_check.sh] building fairseq-fixed's extensions in $SOURCE (log: $OUT/fairseq_build.log)"
        rm -rf "$SOURCE" && mkdir -p "$SOURCE"
        tar xzf "$KIT"/wheels/fairseq_fixed-*.tar.gz -C "$SOURCE" --strip-components 1
        # Only what fairseq-kd imports: the Cython data helpers and libbleu (the BLEU scorer). Its
        # setup.py also builds libnat, libbase and alignment_train_cpu against torch's headers
        # (non-autoregressive models and BASE layers only; most of the first lease's 136 s of set-up)
        # with torch's BuildExtension, whose one build.ninja per folder forbids build_ext -j. These
        # three are plain setuptools extensions, so -j builds them side by side. The sdist ships no
        # generated .cpp: Cython turns the .pyx into C++ first.
        (cd "$SOURCE" && "$PY" - "$(nproc)" <<'PYBUILD'
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

flags = ["-std=c++11", "-O3"]  # fairseq-fixed's setup.py's, off macOS
cython = dict(language="c++", extra_compile_args=flags, include_dirs=[numpy.get_include()])
setup(name="fairseq-fixed-extensions", script_args=["build_ext", "--inplace", "-j", sys.argv[1]],
      ext_modules=[Extension("fairseq.libbleu", ["fairseq/clib/libbleu/libbleu.cpp",
                                                 "fairseq/clib/libbleu/module.cpp"], extra_compile_args=flags)]
      + cythonize([Extension("fairseq.data.data_utils_fast", ["fairseq/data/data_utils_fast.pyx"], **cython),
                   Extension("fairseq.data.token_block_utils_fast", ["fairseq/data/token_block_utils_fast.pyx"],
                             **cython)], nthreads=2, language_level=3, quiet=True))
PYBUILD
        ) >"$OUT/fairseq_build.log" 2>&1 || { tail -n 20 "$OUT/fairseq_build.log" >&2; exit 1; }
    fi
    export PYTHONPATH="$SITE:$SOURCE${PYTHONPATH:+:$PYTHONPATH}"
    set -- --commit "$(cat "$KIT/commit")" "$@"  # no .git travels to the device machine
fi
export PYTHONPATH="$ROOT:$ROOT/examples/translation${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# 15 s held back: a step running at the check's limit gets that long (gpu_check.GRACE) to stop
LEFT=$((BUDGET - (SECONDS - START) - 15))
echo "[gpu_check.sh] $((SECONDS - START)) s of set-up; the check gets ${LEFT} s"
exec "$PY" -m fairseq_kd_recipes.gpu_check "$OUT" --data "$KIT/data-bin" --time-limit "$LEFT" "$@"
