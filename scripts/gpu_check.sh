#!/usr/bin/env bash
# The GPU check (fairseq_kd_recipes.gpu_check) on a lent GPU machine, from the kit that
# scripts/gpu_kit.sh gathered: its wheels installed into /tmp, fairseq-fixed built there from its
# sdist (C++/Cython extensions for the CPU only), then the check on the kit's corpus,
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
    "$ROOT/scripts/setup_env.sh"
    PY="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin/python"
else
    PY="${PYTHON:-python3}"
    SITE=/tmp/fairseq_kd_site
    SOURCE=/tmp/fairseq_kd_fairseq
    if ! PYTHONPATH="$SITE:$SOURCE" "$PY" -c "import fairseq.data.data_utils_fast, hydra, sacremoses" 2>/dev/null; then
        echo "[gpu_check.sh] installing the kit's wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
            --target "$SITE" "$KIT"/wheels/*.whl "$KIT"/wheels/antlr4-python3-runtime-*.tar.gz
        echo "[gpu_check.sh] building fairseq-fixed from its sdist in $SOURCE (log: $OUT/fairseq_build.log)"
        rm -rf "$SOURCE" && mkdir -p "$SOURCE"
        tar xzf "$KIT"/wheels/fairseq_fixed-*.tar.gz -C "$SOURCE" --strip-components 1
        # CUDA_HOME unset: no CUDA extensions (only non-autoregressive models use them). Not
        # build_ext -j: torch's BuildExtension writes one build.ninja per build dir, so parallel
        # extensions overwrite each other's (first lease: "ninja: no work to do", then ld found no
        # .o); ninja compiles each extension's files in parallel instead (MAX_JOBS).
        (cd "$SOURCE" && env -u CUDA_HOME MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace) \
            >"$OUT/fairseq_build.log" 2>&1 || { tail -n 20 "$OUT/fairseq_build.log" >&2; exit 1; }
    fi
    export PYTHONPATH="$SITE:$SOURCE${PYTHONPATH:+:$PYTHONPATH}"
    set -- --commit "$(cat "$KIT/commit")" "$@"  # no .git travels to the device machine
fi
export PYTHONPATH="$ROOT:$ROOT/examples/translation${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LEFT=$((BUDGET - (SECONDS - START)))
echo "[gpu_check.sh] $((SECONDS - START)) s of set-up; the check gets ${LEFT} s"
exec "$PY" -m fairseq_kd_recipes.gpu_check "$OUT" --data "$KIT/data-bin" --time-limit "$LEFT" "$@"
