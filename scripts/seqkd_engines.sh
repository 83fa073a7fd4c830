#!/usr/bin/env bash
# Sequence-level KD through both decoding engines, on the same data, teacher, beam and machine:
#   fairseq-kd-seqkd --engine fairseq      (fairseq's SequenceGenerator)
#   fairseq-kd-seqkd --engine ctranslate2  (the teacher converted to CTranslate2, float32)
#   fairseq-kd-seqkd --engine transformers (with SEQKD_HF_TEACHER=DIR: the same teacher as a Hugging
#                                           Face folder, fairseq-kd-export --format hf, decoded by generate)
# then one student trained on each engine's output with the same settings, both decoded with
# stock fairseq-generate, and a report: BLEU with 95% intervals and the paired tests of the
# CTranslate2-data student against the fairseq-data student (they should match within noise), the
# two engines' sentences/s, and how many training targets the engines decoded identically.
#
#   bash scripts/seqkd_engines.sh                       # on the demo's output (run scripts/demo.sh first)
#   SEQKD_DATA=... SEQKD_TEACHER=... bash scripts/seqkd_engines.sh   # decode-only timing on other data
#
# Both decodes run one after the other with the same thread count (SEQKD_THREADS, default 2), so
# their sentences/s compare; re-running skips finished steps (the outputs are resumable datasets).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
BIN="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin"
PY="$BIN/python"
DEMO="$(cd "${DEMO_DIR:-$ROOT/demo_output}" 2>/dev/null && pwd || true)"
DATA="${SEQKD_DATA:-$DEMO/data-bin}"
TEACHER="${SEQKD_TEACHER:-$DEMO/checkpoints/teacher/checkpoint_best.pt}"
OUT="$(mkdir -p "${SEQKD_OUT:-$DEMO/seqkd_engines}" && cd "${SEQKD_OUT:-$DEMO/seqkd_engines}" && pwd)"
THREADS="${SEQKD_THREADS:-2}"
HF_TEACHER="${SEQKD_HF_TEACHER:-}"
ENGINES=(fairseq ctranslate2)
[[ -n "$HF_TEACHER" ]] && ENGINES+=(transformers)
SPLIT="${SEQKD_SPLIT:-train}"
MAX_LEN="${MAX_LEN:-200}"
TRAIN_STUDENTS="${SEQKD_TRAIN_STUDENTS:-$([[ -z "${SEQKD_DATA:-}" ]] && echo 1 || echo 0)}"
export PYTHONWARNINGS=ignore ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
    KMP_DETERMINISTIC_REDUCTION=yes CT2_FORCE_CPU_ISA=AVX2
[[ -d "$DATA" ]] || { echo "no data folder $DATA: run scripts/demo.sh first, or set SEQKD_DATA" >&2; exit 2; }
[[ -f "$TEACHER" ]] || { echo "no teacher checkpoint $TEACHER: run scripts/demo.sh first, or set SEQKD_TEACHER" >&2; exit 2; }

for engine in "${ENGINES[@]}"; do
    if [[ ! -f "$OUT/$engine.log" ]] || ! grep -q "sentences/s" "$OUT/$engine.log"; then
        echo "== decoding the $SPLIT split with --engine $engine ($THREADS threads, beam 5)"
        extra=() teacher="$TEACHER"
        [[ "$engine" == ctranslate2 ]] && extra=(--ct2-quantization float32 --threads "$THREADS")
        [[ "$engine" == transformers ]] && teacher="$HF_TEACHER"
        OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS "$BIN/fairseq-kd-seqkd" --data "$DATA" \
            --teacher-checkpoint "$teacher" --output "$OUT/data-$engine" --split "$SPLIT" --beam 5 \
            --max-tokens 8192 --max-len-a 0 --max-len-b "$MAX_LEN" --cpu --engine "$engine" "${extra[@]}" \
            >"$OUT/$engine.log.tmp" 2>&1
        mv "$OUT/$engine.log.tmp" "$OUT/$engine.log"
    fi
    grep "throughput" "$OUT/$engine.log" | sed "s/^/$engine: /"
done

if [[ "$TRAIN_STUDENTS" == 1 ]]; then
    # the demo's sequence-level KD student of 2026-11-28 (4,096-token batches; the demo's students now
    # learn from 2,048), once on each engine's data
    COMMON=(--user-dir "$ROOT/fairseq_kd" --share-all-embeddings --optimizer adam --adam-betas '(0.9, 0.98)'
            --lr-scheduler polynomial_decay --warmup-updates 100 --dropout 0.1 --weight-decay 1e-4
            --max-tokens 4096 --seed 1 --no-epoch-checkpoints --num-workers 0
            --best-checkpoint-metric nll_loss --log-format json --log-interval 25
            --task translation --arch transformer_kd_tiny_student --lr 8e-3
            --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "${STUDENT_UPDATES:-300}"
            --total-num-update "${STUDENT_UPDATES:-300}")
    ARGS=()
    for engine in fairseq ctranslate2; do
        if [[ ! -f "$OUT/checkpoints/$engine/checkpoint_best.pt" || ! -f "$OUT/.trained.$engine" ]]; then
            echo "== training the sequence-level KD student on the $engine engine's data"
            OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$BIN/fairseq-train" "$OUT/data-$engine" "${COMMON[@]}" \
                --save-dir "$OUT/checkpoints/$engine" --log-file "$OUT/train_$engine.log" >"$OUT/train_$engine.out" 2>&1
            touch "$OUT/.trained.$engine"
        fi
        [[ -f "$OUT/$engine.pt" ]] || "$BIN/fairseq-kd-export" "$OUT/checkpoints/$engine/checkpoint_best.pt" \
            "$OUT/$engine.pt" >/dev/null
        if [[ ! -s "$OUT/generate_$engine.txt" ]]; then
            OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 "$BIN/fairseq-generate" "$DATA" --task translation \
                --path "$OUT/$engine.pt" --gen-subset test --beam 5 --batch-size 100 \
                --required-batch-size-multiple 1 --max-len-a 0 --max-len-b "$MAX_LEN" \
                >"$OUT/generate_$engine.tmp" 2>/dev/null
            mv "$OUT/generate_$engine.tmp" "$OUT/generate_$engine.txt"
        fi
        ARGS+=(--system "seq_kd_${engine}_data=$OUT/generate_$engine.txt")
    done
    "$PY" -m fairseq_kd.cli.report "${ARGS[@]}" --baseline seq_kd_fairseq_data --bootstrap 1000 \
        --out-prefix "$OUT/report" --overwrite \
        --title "Sequence-level KD students trained on the fairseq engine's and on the CTranslate2 engine's teacher outputs" \
        2> >(grep -v -e "tokenized period" -e "forgot to detokenize" -e "suppress this message" >&2)
fi

"$PY" - "$OUT" "$SPLIT" "${ENGINES[@]}" <<'PYEOF'
# How many training targets each engine decoded as the fairseq engine did (the binarised target files)
import sys
from pathlib import Path
from fairseq.data import data_utils
out, split, engines = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
datasets = {}
for engine in engines:
    folder = out / f"data-{engine}"
    src, tgt = data_utils.infer_language_pair(str(folder))
    datasets[engine] = data_utils.load_indexed_dataset(str(folder / f"{split}.{src}-{tgt}.{tgt}"), None)
a = datasets["fairseq"]
for engine in engines[1:]:
    b = datasets[engine]
    same = sum(a[i].tolist() == b[i].tolist() for i in range(len(a)))
    print(f"{engine}: teacher outputs identical to the fairseq engine's: {same} of {len(a)} sentences "
          f"({100 * same / len(a):.2f}%)")
PYEOF
