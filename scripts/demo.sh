#!/usr/bin/env bash
# The main job end to end on data the project makes itself:
#   synthetic corpus -> fairseq-preprocess -> teacher -> students (no KD, word-level KD,
#   sequence-level KD) -> export -> decode the test set -> BLEU report with 95% intervals.
# Runs in under 10 minutes on 2 CPU cores; everything lands in $DEMO_DIR (default demo_output/).
# Re-running skips finished steps; an interrupted training run resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
VENV="${FAIRSEQ_KD_VENV:-$ROOT/.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
OUT="$(mkdir -p "${DEMO_DIR:-$ROOT/demo_output}" && cd "${DEMO_DIR:-$ROOT/demo_output}" && pwd)"
USER_DIR="$ROOT/fairseq_kd"
export PYTHONWARNINGS=ignore  # fairseq-fixed's deprecation warnings drown its progress output
START=$SECONDS

step() { printf '\n==== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
done_or_run() {  # done_or_run NAME COMMAND...: run once, remember success in a stamp file
    local stamp="$OUT/.done.$1"; shift
    if [[ -f "$stamp" ]]; then echo "(already done: $(basename "$stamp" | cut -d. -f3-))"; return; fi
    "$@"
    touch "$stamp"
}

# Hyper-parameters: the papers' recipe (Adam 0.9/0.98, inverse_sqrt, label smoothing 0.1) scaled
# to a corpus that a 4-layer, d=128 teacher learns in a few hundred updates on two CPU cores.
COMMON=(--user-dir "$USER_DIR" --share-all-embeddings --optimizer adam --adam-betas '(0.9, 0.98)'
        --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 150 --dropout 0.1 --weight-decay 1e-4
        --max-tokens 4096 --seed 1 --no-epoch-checkpoints --disable-validation --num-workers 0
        --log-format simple --log-interval 25)
TEACHER_UPDATES=${TEACHER_UPDATES:-300}
STUDENT_UPDATES=${STUDENT_UPDATES:-250}
STUDENT=(--arch transformer_kd_tiny_student)

step "1/7 synthetic corpus (SVO source -> SOV target with agreement; fairseq_kd/data/synthetic.py)"
"$PY" -m fairseq_kd.cli.make_corpus --output-dir "$OUT/corpus" --seed 1 \
    --train-size 10000 --valid-size 300 --test-size 300

step "2/7 fairseq-preprocess (joined dictionary)"
done_or_run preprocess "$BIN/fairseq-preprocess" --source-lang src --target-lang tgt \
    --trainpref "$OUT/corpus/train" --validpref "$OUT/corpus/valid" --testpref "$OUT/corpus/test" \
    --destdir "$OUT/data-bin" --joined-dictionary --workers 2 >"$OUT/preprocess.log"

train() {  # train NAME DATA EXTRA_FLAGS...
    local name=$1 data=$2; shift 2
    done_or_run "train_$name" "$BIN/fairseq-train" "$data" "${COMMON[@]}" \
        --save-dir "$OUT/checkpoints/$name" --log-file "$OUT/logs/$name.log" "$@"
}
mkdir -p "$OUT/logs"

step "3/7 teacher: transformer_kd_tiny_teacher (4+4 layers, 4 heads, d=128), plain CE"
train teacher "$OUT/data-bin" --task translation --arch transformer_kd_tiny_teacher \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "$TEACHER_UPDATES"
TEACHER="$OUT/checkpoints/teacher/checkpoint_last.pt"

step "4/7 students: transformer_kd_tiny_student (2+2 layers, 2 heads, d=64)"
echo "-- no KD (plain label-smoothed CE)"
train no_kd "$OUT/data-bin" --task translation "${STUDENT[@]}" \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "$STUDENT_UPDATES"
echo "-- word-level KD (criterion word_kd, a=0.5, tau=1)"
train word_kd "$OUT/data-bin" --task translation_kd --teacher-checkpoint "$TEACHER" "${STUDENT[@]}" \
    --criterion word_kd --kd-weight 0.5 --max-update "$STUDENT_UPDATES"

step "5/7 sequence-level KD: the teacher beam-decodes the training set, a student trains on it"
done_or_run seqkd_data "$BIN/fairseq-kd-seqkd" --data "$OUT/data-bin" --teacher-checkpoint "$TEACHER" \
    --output "$OUT/data-bin-seqkd" --beam 5 --max-tokens 8192
train seq_kd "$OUT/data-bin-seqkd" --task translation "${STUDENT[@]}" \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "$STUDENT_UPDATES"

step "6/7 export each model as a stock fairseq transformer and decode the test set (beam 5)"
SYSTEMS=(teacher no_kd word_kd seq_kd)
SIDECAR="$OUT/systems.json"
echo "{}" >"$SIDECAR.tmp"
for name in "${SYSTEMS[@]}"; do
    mkdir -p "$OUT/models" "$OUT/generate"
    model="$OUT/models/$name.pt"
    [[ -f "$model" ]] || "$PY" -m fairseq_kd.cli.export_student \
        "$OUT/checkpoints/$name/checkpoint_last.pt" "$model" >"$OUT/models/$name.json"
    if [[ ! -s "$OUT/generate/$name.txt" ]]; then
        # stock fairseq-generate, no --user-dir: the exported model is a plain transformer
        "$BIN/fairseq-generate" "$OUT/data-bin" --task translation --path "$model" --gen-subset test \
            --beam 5 --batch-size 100 --required-batch-size-multiple 1 >"$OUT/generate/$name.tmp" 2>"$OUT/generate/$name.log"
        mv "$OUT/generate/$name.tmp" "$OUT/generate/$name.txt"
    fi
    "$PY" - "$SIDECAR.tmp" "$name" "$OUT/models/$name.json" "$OUT/generate/$name.log" <<'PYEOF'
import json, re, sys
sidecar, name, summary, log = sys.argv[1:]
data = json.load(open(sidecar))
speed = re.findall(r"\(([\d.]+) sentences/s", open(log).read())
data[name] = {"params": json.load(open(summary))["parameters"], "sents_per_sec": float(speed[-1])}
json.dump(data, open(sidecar, "w"), indent=2)
PYEOF
    echo "$name: $(grep -o 'Translated.*' "$OUT/generate/$name.log")"
done
mv "$SIDECAR.tmp" "$SIDECAR"

step "7/7 BLEU report: sacreBLEU, 1,000 bootstrap resamples, 95% intervals, paired test vs no_kd"
ARGS=()
for name in "${SYSTEMS[@]}"; do ARGS+=(--system "$name=$OUT/generate/$name.txt"); done
# The synthetic language is whitespace-tokenised by design (its references too), so sacreBLEU's
# "forgot to detokenize?" advice, printed per system, does not apply here.
"$PY" -m fairseq_kd.cli.report "${ARGS[@]}" --baseline no_kd --sidecar "$SIDECAR" \
    --bootstrap 1000 --out-prefix "$OUT/report" --overwrite \
    2> >(grep -v -e "tokenized period" -e "forgot to detokenize" -e "suppress this message" >&2)
"$PY" -m fairseq_kd.cli.plot curves --log "$OUT/logs/word_kd.log" \
    --output "$OUT/word_kd_training_curves.png" --overwrite
echo
echo "Report: $OUT/report.md (.csv, .json); loss curves: $OUT/word_kd_training_curves.png;"
echo "models: $OUT/models/ (stock fairseq transformers); total $((SECONDS - START)) s"
