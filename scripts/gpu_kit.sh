#!/usr/bin/env bash
# Gather what a bare GPU machine (Python 3.12 with a CUDA torch, no package registry) lacks to run
# scripts/gpu_check.sh, into one git-ignored folder of at most 64 MiB:
#   wheels/    hydra-core, omegaconf, antlr4-python3-runtime (an sdist: pure Python), bitarray, cffi,
#              pycparser, sacremoses, subword-nmt, mock, ctranslate2, tensorboardX: for CPython 3.12
#              on x86-64 Linux, at the versions the CPU environment tests (.venv);
#              fairseq-fixed's sdist, built there (gpu_check.sh)
#   data-bin/  Multi30k Fr-En binarised as the recipe prepares it (from $MULTI30K_DIR, default
#              ../shared/data/multi30k-fr-en, else downloaded)
#   commit     the checkout's commit ("+changes" when tracked files differ from it)
#
#   bash scripts/gpu_kit.sh [DIR]            # DIR defaults to .gpu_kit (ignored by git)
# Reuses what DIR already holds; the wheels need PyPI, the data only the archives.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
PY="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin/python"
KIT="${1:-$ROOT/.gpu_kit}"
LIMIT_MIB=64
mkdir -p "$KIT/wheels"

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
binary=()
for name in hydra-core omegaconf bitarray cffi pycparser sacremoses subword-nmt mock ctranslate2 tensorboardX; do
    binary+=("$name==$(version "$name")")
done
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${tag}_x86_64")
done
echo "[gpu_kit] wheels for CPython 3.12: ${binary[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$KIT/wheels" "${binary[@]}"
echo "[gpu_kit] sources: antlr4-python3-runtime, fairseq-fixed"
"$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$KIT/wheels" \
    "antlr4-python3-runtime==$(version antlr4-python3-runtime)" "fairseq-fixed==$(version fairseq-fixed)"

if [[ ! -f "$KIT/data-bin/prepare.json" ]]; then
    MULTI30K_DIR="${MULTI30K_DIR:-$ROOT/../shared/data/multi30k-fr-en}"
    archives=()
    [[ -d "$MULTI30K_DIR" ]] && archives=(--archives "$MULTI30K_DIR")
    echo "[gpu_kit] preparing Multi30k Fr-En into $KIT/data-bin"
    PYTHONPATH="$ROOT/examples/translation${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m \
        fairseq_kd_recipes.prepare.scripts.multi30k_fr_en "${archives[@]}" --workdir "$KIT/.prepare" \
        --dest "$KIT/data-bin" >"$KIT/prepare.log" 2>&1 || { cat "$KIT/prepare.log" >&2; exit 1; }
    rm -rf "$KIT/.prepare"
fi

head="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
[[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]] && head="$head+changes"
echo "$head" >"$KIT/commit"

kit_kib="$(du -sk "$KIT" | cut -f1)"
tree_kib="$(git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 du -ck 2>/dev/null) | tail -n1 | cut -f1)"
echo "[gpu_kit] $KIT: $((kit_kib / 1024)) MiB, plus the working tree's $((tree_kib / 1024)) MiB"
if (( kit_kib + tree_kib > LIMIT_MIB * 1024 )); then
    echo "[gpu_kit] error: the kit and the working tree exceed the device call's $LIMIT_MIB MiB" >&2
    exit 1
fi
