#!/usr/bin/env bash
# A Hugging Face teacher distils like the fairseq teacher it was exported from (Multi30k Fr-En):
#   1. the quality benchmark's fairseq teacher -> fairseq-kd-export --format hf (an M2M100 folder)
#   2. word_kd and a2d_kd (map mean) students, each distilled once from the fairseq checkpoint and
#      once from the Hugging Face folder through the adapter, with the recipe's CPU settings
#      (3+3 d 64 students, seed 1; EVIDENCE_EPOCHS epochs, default 6 as the benchmark); two trainings at a time, one thread each
#   3. every student decoded (beam 5) and scored; a report per method: the HF-teacher student
#      against the fairseq-teacher student (paired tests), and validation nll per epoch of both
#
#   EVIDENCE_DATA=/work/m30k/data-bin EVIDENCE_TEACHER=/work/m30k/models/teacher.pt \
#       bash scripts/hf_teacher_evidence.sh [WORKDIR]
#
# Resumable: a finished training, decode or score is not redone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh" >/dev/null
BIN="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin"
DATA="${EVIDENCE_DATA:?set EVIDENCE_DATA to the Multi30k data-bin (examples/translation/multi30k_fr_en)}"
TEACHER="${EVIDENCE_TEACHER:?set EVIDENCE_TEACHER to the quality benchmark teacher checkpoint}"
WORK="${1:-hf_teacher_evidence}"
mkdir -p "$WORK"/{train,generate,scores,logs}
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 \
    ONEDNN_MAX_CPU_ISA=AVX2 KMP_DETERMINISTIC_REDUCTION=yes

HF="$WORK/hf_teacher"
[[ -f "$HF/config.json" ]] || "$BIN/fairseq-kd-export" "$TEACHER" "$HF" --format hf --data "$DATA" \
    > "$WORK/logs/export_hf.log"

# the recipe's CPU profile for multi30k_fr_en (fairseq-kd-recipe multi30k_fr_en --profile cpu --print-commands)
STUDENT=(--user-dir "$ROOT/fairseq_kd" --task translation_kd --arch transformer --encoder-layers 3 --decoder-layers 3
         --encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256
         --encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings --label-smoothing 0.1
         --optimizer adam --adam-betas '(0.9, 0.98)' --lr 1.5e-3 --lr-scheduler inverse_sqrt --warmup-updates 500
         --dropout 0.2 --weight-decay 1e-4 --clip-norm 0.0 --max-tokens 2048 --max-epoch "${EVIDENCE_EPOCHS:-6}"
         --best-checkpoint-metric nll_loss --seed 1 --no-epoch-checkpoints --log-format json --log-interval 50 --cpu)
declare -A METHOD=([word_kd]="--criterion word_kd --kd-weight 0.5"
                   [a2d_kd]="--criterion a2d_kd --a2d-map-reduction mean")
declare -A TEACHER_FLAGS=([fairseq]="--teacher-checkpoint $TEACHER --teacher-data $DATA"
                          [hf]="--teacher-checkpoint $HF")

train() {  # method teacher-kind
    local name="$1-$2" save="$WORK/train/$1-$2"
    [[ -f "$save/.done" ]] && return 0
    mkdir -p "$save"
    # shellcheck disable=SC2086 - the flag strings above are word lists
    "$BIN/fairseq-train" "$DATA" "${STUDENT[@]}" ${METHOD[$1]} ${TEACHER_FLAGS[$2]} --save-dir "$save" \
        --log-file "$save/train.log" > "$WORK/logs/train-$name.out" 2>&1
    touch "$save/.done"
}

pids=()
for method in word_kd a2d_kd; do
    train "$method" fairseq & pids+=($!)
    train "$method" hf & pids+=($!)
    for pid in "${pids[@]}"; do wait "$pid"; done
    pids=()
done

for name in word_kd-fairseq word_kd-hf a2d_kd-fairseq a2d_kd-hf; do
    out="$WORK/generate/$name"
    if [[ ! -f "$out/generate-test.txt" ]] || ! grep -q "^Generate test" "$out/generate-test.txt"; then
        OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 "$BIN/fairseq-generate" "$DATA" --user-dir "$ROOT/fairseq_kd" \
            --task translation --gen-subset test --path "$WORK/train/$name/checkpoint_best.pt" --beam 5 \
            --max-tokens 2048 --required-batch-size-multiple 1 --seed 1 --results-path "$out" --cpu \
            > "$WORK/logs/generate-$name.log" 2>&1
    fi
done

for method in word_kd a2d_kd; do
    "$BIN/fairseq-kd-report" --system "$method-fairseq=$WORK/generate/$method-fairseq/generate-test.txt" \
        --system "$method-hf=$WORK/generate/$method-hf/generate-test.txt" --baseline "$method-fairseq" \
        --remove-bpe subword_nmt --tokenize 13a --detok-moses en --ref "$DATA/raw/test.en" --ref-is-plain \
        --title "Multi30k Fr-En: $method from the fairseq teacher and from the same teacher as a Hugging Face folder" \
        --out-prefix "$WORK/report-$method" --overwrite > /dev/null
done

"$BIN/python" - "$WORK" <<'PYEOF'
# validation nll per epoch of each pair of runs, and the largest difference
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
def valid_nll(name):
    rows = {}
    for line in (work / "train" / name / "train.log").read_text().splitlines():
        if '"valid_nll_loss"' in line:  # fairseq's --log-file: the JSON records alone, one per line
            record = json.loads(line[line.index("{"):])
            rows[int(record["epoch"])] = float(record["valid_nll_loss"])
    return rows
epochs = range(1, 1 + max(max(valid_nll(f"{m}-{k}"), default=0) for m in ("word_kd", "a2d_kd") for k in ("fairseq", "hf")))
lines = ["| method | teacher | " + " | ".join(f"epoch {e}" for e in epochs) + " |", "|---|---|" + "---:|" * len(epochs)]
for method in ("word_kd", "a2d_kd"):
    runs = {kind: valid_nll(f"{method}-{kind}") for kind in ("fairseq", "hf")}
    for kind, rows in runs.items():
        lines.append(f"| {method} | {kind} | " + " | ".join(f"{rows.get(e, float('nan')):.3f}" for e in epochs) + " |")
    common = sorted(set(runs["fairseq"]) & set(runs["hf"]))
    gap = max(abs(runs["fairseq"][e] - runs["hf"][e]) for e in common) if common else float("nan")
    lines.append(f"| {method} | largest difference | {gap:.3f} |" + " |" * (len(epochs) - 1))
(work / "valid_nll.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
