#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install what fairseq-kd needs.
#
# Why by hand rather than `pip install -e .` resolving everything (pyproject.toml declares every
# dependency but fairseq; that path is for an environment that already has torch and fairseq, see
# the README): stock fairseq 0.12.2 does not build
# on Python >= 3.11, fairseq-fixed must be built without build isolation against the torch already
# installed, and a resolver left alone would pull a second (CUDA) torch or torchaudio.
# Idempotent: a finished environment is recognised by a stamp file and reused in about a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FAIRSEQ_KD_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.fairseq_kd_env_v1"
# v2 adds TensorBoard logging (tensorboardX) to a v1 environment; tqdm is in v1 already.
STAMP_V2="$VENV/.fairseq_kd_env_v2"
# v3 adds pytest-xdist: the test suite runs on every core (its training runs are single-threaded).
STAMP_V3="$VENV/.fairseq_kd_env_v3"
# v4 adds CTranslate2 (the deploy extra): export, decoding and the deploy benchmark.
STAMP_V4="$VENV/.fairseq_kd_env_v4"
CTRANSLATE2_SPEC="ctranslate2>=4.4,<5"
# v5 adds transformers (the hf extra): Hugging Face teachers and fairseq-kd-hf-data.
STAMP_V5="$VENV/.fairseq_kd_env_v5"
TRANSFORMERS_SPEC="transformers>=5,<6"

# Packages added after v1: installed into an existing environment without rebuilding it, each only
# when absent, against the installed torch (constraints.txt) so nothing replaces it.
upgrade_v1_to_v2() {
    if ! "$VENV/bin/python" -c "import tensorboardX, tqdm" 2>/dev/null; then
        echo "[setup_env] adding tensorboardX and tqdm to $VENV"
        local pin=()
        [[ -f "$VENV/constraints.txt" ]] && pin=(-c "$VENV/constraints.txt")
        if ! "$VENV/bin/python" -m pip install -q "${pin[@]}" tensorboardX tqdm; then
            # not fatal: everything but --tensorboard-logdir works without it; retried next time
            echo "[setup_env] warning: could not install tensorboardX; --tensorboard-logdir will not log" >&2
            return 0
        fi
    fi
    touch "$STAMP_V2"
}

upgrade_v2_to_v3() {
    if ! "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
        echo "[setup_env] adding pytest-xdist to $VENV"
        local pin=()
        [[ -f "$VENV/constraints.txt" ]] && pin=(-c "$VENV/constraints.txt")
        if ! "$VENV/bin/python" -m pip install -q "${pin[@]}" pytest-xdist; then
            # not fatal: scripts/run_tests.sh then runs the suite on one core
            echo "[setup_env] warning: could not install pytest-xdist; the tests will run on one core" >&2
            return 0
        fi
    fi
    touch "$STAMP_V3"
}

upgrade_v3_to_v4() {
    if ! "$VENV/bin/python" -c "import ctranslate2" 2>/dev/null; then
        echo "[setup_env] adding CTranslate2 to $VENV"
        local pin=()
        [[ -f "$VENV/constraints.txt" ]] && pin=(-c "$VENV/constraints.txt")
        # fatal: the demo ends with the CTranslate2 deploy table and the suite tests the export
        "$VENV/bin/python" -m pip install -q "${pin[@]}" "$CTRANSLATE2_SPEC"
    fi
    touch "$STAMP_V4"
}

upgrade_v4_to_v5() {
    if ! "$VENV/bin/python" -c "import transformers" 2>/dev/null; then
        echo "[setup_env] adding transformers to $VENV"
        local pin=()
        [[ -f "$VENV/constraints.txt" ]] && pin=(-c "$VENV/constraints.txt")
        # fatal: the suite tests Hugging Face teachers (tests/test_hf_teacher.py); the constraint keeps torch
        "$VENV/bin/python" -m pip install -q "${pin[@]}" "$TRANSFORMERS_SPEC"
    fi
    touch "$STAMP_V5"
}

if [[ -f "$STAMP" ]]; then
    [[ -f "$STAMP_V2" ]] || upgrade_v1_to_v2
    [[ -f "$STAMP_V3" ]] || upgrade_v2_to_v3
    [[ -f "$STAMP_V4" ]] || upgrade_v3_to_v4
    [[ -f "$STAMP_V5" ]] || upgrade_v4_to_v5
    # Keep the editable install pointing at this checkout (a fresh clone may reuse a shared venv).
    # (PYTHONWARNINGS: setuptools warns about editable installs on every run)
    PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null
    exit 0
fi

"$PY" - <<'PYCHK'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"fairseq-kd needs Python >= 3.11, found {sys.version.split()[0]}; set PYTHON=/path/to/python3.11")
PYCHK

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip setuptools wheel

# torch first and pinned, so nothing later can replace it.  A local CPU wheel is used where the
# machine provides one (TORCH_WHEEL or /opt/wheels), otherwise the registry's.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup_env] torch $("$VENV/bin/python" -c 'import torch;print(torch.__version__)') already installed"
else
    WHEEL="${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0*cp311*.whl 2>/dev/null | head -n1 || true)}"
    if [[ -n "$WHEEL" ]]; then
        "${PIP[@]}" install -q "$WHEEL"
    else
        "${PIP[@]}" install -q "$TORCH_SPEC"
    fi
fi
TORCH_VERSION="$("$VENV/bin/python" -c 'import torch;print(torch.__version__.split("+")[0])')"
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

# Build requirements of fairseq-fixed, then fairseq-fixed itself without isolation or deps.
"${PIP[@]}" install -q -c "$CONSTRAINTS" "cython<3.2" "numpy<2.3"
"${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "hydra-core==1.3.2" "omegaconf==2.3.0" cffi regex "sacrebleu>=2.3" tqdm bitarray \
    scikit-learn packaging sentencepiece subword-nmt sacremoses pytest pytest-xdist matplotlib tensorboardX \
    "$CTRANSLATE2_SPEC" "$TRANSFORMERS_SPEC"
echo "[setup_env] building fairseq-fixed==0.12.3.1 (about 3 minutes the first time; pip caches the wheel)"
"${PIP[@]}" install -q --no-deps --no-build-isolation "fairseq-fixed==0.12.3.1"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT"

# Refuse to finish with a second torch or torchaudio in the environment.
"$VENV/bin/python" - <<'PYCHK'
import importlib.util, sys, torch
if importlib.util.find_spec("torchaudio") is not None:
    sys.exit("torchaudio is installed in the environment; it pins another torch. Remove it.")
import ctranslate2, fairseq, fairseq_kd, tensorboardX, transformers  # noqa: F401
print(f"[setup_env] ok: torch {torch.__version__}, fairseq {fairseq.__version__}")
PYCHK
touch "$STAMP" "$STAMP_V2" "$STAMP_V3" "$STAMP_V4" "$STAMP_V5"
