#!/usr/bin/env bash
# The main job end to end on data the project makes itself:
#   synthetic corpus -> fairseq-preprocess -> teacher -> students (no KD, word-level KD, Align-to-
#   Distill, sequence-level KD) -> export -> decode the test set -> BLEU report with 95% intervals
#   and paired tests against no KD -> figures (every model's validation nll on one axis, A2D's loss
#   terms, A2D's alignment heatmap) -> deploy table: the A2D student exported to CTranslate2 (float32,
#   int8) against the teacher under fairseq, speed and BLEU.
# Runs in under 10 minutes on 2 CPU cores; everything lands in $DEMO_DIR (default demo_output/).
# Re-running skips finished steps; an interrupted training run resumes from its last checkpoint.
#
# Same numbers from the same commit on any x86 machine with AVX2: every process runs with a fixed
# thread count (the teacher and the decoding two threads, each student one, two students at a
# time), fixed seeds, and the CPU kernels pinned to their AVX2 variants (PyTorch's own
# ATEN_CPU_CAPABILITY, MKL's conditional numerical reproducibility MKL_CBWR, oneDNN's
# ONEDNN_MAX_CPU_ISA), so that a machine with AVX-512 computes what one without it does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
VENV="${FAIRSEQ_KD_VENV:-$ROOT/.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
OUT="$(mkdir -p "${DEMO_DIR:-$ROOT/demo_output}" && cd "${DEMO_DIR:-$ROOT/demo_output}" && pwd)"
USER_DIR="$ROOT/fairseq_kd"
export PYTHONWARNINGS=ignore  # fairseq-fixed's deprecation warnings drown its progress output
export ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 KMP_DETERMINISTIC_REDUCTION=yes
export CT2_FORCE_CPU_ISA=AVX2  # CTranslate2's kernels too (its int8 GEMM differs between ISAs)
START=$SECONDS

step() { printf '\n==== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
done_or_run() {  # done_or_run NAME COMMAND...: run once, remember success in a stamp file
    local stamp="$OUT/.done.$1"; shift
    if [[ -f "$stamp" ]]; then echo "(already done: $(basename "$stamp" | cut -d. -f3-))"; return; fi
    "$@"
    touch "$stamp"
}
threads() {  # threads N COMMAND...: run with N intra-op threads
    local n=$1; shift
    OMP_NUM_THREADS=$n MKL_NUM_THREADS=$n "$@"
}

# Hyper-parameters: the papers' recipe (Adam 0.9/0.98, inverse_sqrt, label smoothing 0.1) scaled
# to a corpus that a 4-layer, d=128 teacher learns in a few hundred updates on two CPU cores. The
# checkpoint decoded is the one with the best validation nll (never a KD criterion's total loss).
# The students' peak learning rate was chosen on the no-KD student's validation nll after 250
# updates (2e-3: 1.81, 4e-3: 0.92, 6e-3: 0.75, 8e-3: 0.60 bits per token); at 2e-3 every student
# was still far from learning the task. Every student trains with the same rate.
COMMON=(--user-dir "$USER_DIR" --share-all-embeddings --optimizer adam --adam-betas '(0.9, 0.98)'
        --lr-scheduler inverse_sqrt --warmup-updates 150 --dropout 0.1 --weight-decay 1e-4
        --max-tokens 4096 --seed 1 --no-epoch-checkpoints --num-workers 0
        --best-checkpoint-metric nll_loss --log-format json --log-interval 25)
TEACHER_UPDATES=${TEACHER_UPDATES:-300}
STUDENT_UPDATES=${STUDENT_UPDATES:-250}
TRAIN_SIZE=${TRAIN_SIZE:-10000}
EVAL_SIZE=${EVAL_SIZE:-300}  # sentences of the validation and of the test set
MAX_LEN=${MAX_LEN:-200}  # longest output of beam search (fairseq's default; the suite's short run: 10)
STUDENT=(--arch transformer_kd_tiny_student --lr 8e-3)

step "1/8 synthetic corpus (SVO source -> SOV target with agreement; fairseq_kd/data/synthetic.py)"
"$PY" -m fairseq_kd.cli.make_corpus --output-dir "$OUT/corpus" --seed 1 \
    --train-size "$TRAIN_SIZE" --valid-size "$EVAL_SIZE" --test-size "$EVAL_SIZE"

step "2/8 fairseq-preprocess (joined dictionary)"
done_or_run preprocess "$BIN/fairseq-preprocess" --source-lang src --target-lang tgt \
    --trainpref "$OUT/corpus/train" --validpref "$OUT/corpus/valid" --testpref "$OUT/corpus/test" \
    --destdir "$OUT/data-bin" --joined-dictionary --workers 2 >"$OUT/preprocess.log"

train() {  # train NAME THREADS DATA EXTRA_FLAGS...
    local name=$1 n=$2 data=$3; shift 3
    done_or_run "train_$name" threads "$n" "$BIN/fairseq-train" "$data" "${COMMON[@]}" \
        --save-dir "$OUT/checkpoints/$name" --log-file "$OUT/logs/$name.log" "$@" >"$OUT/logs/$name.out" 2>&1
    echo "$name: trained ($(grep -o '"valid_nll_loss": "[0-9.]*"' "$OUT/logs/$name.log" | tail -1))"
}
in_parallel() {  # in_parallel "CMD1" "CMD2": two trainings at once, one core each; fail if either fails
    eval "$1" & local first=$!
    eval "$2" & local second=$!
    local status=0
    wait "$first" || status=$?
    wait "$second" || status=$?
    return "$status"
}
mkdir -p "$OUT/logs"

step "3/8 teacher: transformer_kd_tiny_teacher (4+4 layers, 4 heads, d=128), plain CE"
train teacher 2 "$OUT/data-bin" --task translation --arch transformer_kd_tiny_teacher \
    --lr 2e-3 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "$TEACHER_UPDATES"
TEACHER="$OUT/checkpoints/teacher/checkpoint_best.pt"

step "4/8 students: transformer_kd_tiny_student (2+2 layers, 2 heads, d=64), two at a time"
echo "-- no KD (plain label-smoothed CE) and word-level KD (criterion word_kd, a=0.5, tau=1)"
in_parallel \
    'train no_kd 1 "$OUT/data-bin" --task translation "${STUDENT[@]}" \
        --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "$STUDENT_UPDATES"' \
    'train word_kd 1 "$OUT/data-bin" --task translation_kd --teacher-checkpoint "$TEACHER" "${STUDENT[@]}" \
        --criterion word_kd --kd-weight 0.5 --max-update "$STUDENT_UPDATES"'

step "5/8 sequence-level KD data (the teacher beam-decodes the training set), then A2D and seq KD"
done_or_run seqkd_data threads 2 "$BIN/fairseq-kd-seqkd" --data "$OUT/data-bin" --teacher-checkpoint "$TEACHER" \
    --output "$OUT/data-bin-seqkd" --beam 5 --max-tokens 8192 --max-len-a 0 --max-len-b "$MAX_LEN"
echo "-- Align-to-Distill (criterion a2d_kd, its defaults: all three attention kinds, head-wise AAM)"
echo "-- sequence-level KD (plain CE on the teacher's translations)"
in_parallel \
    'train a2d_kd 1 "$OUT/data-bin" --task translation_kd --teacher-checkpoint "$TEACHER" "${STUDENT[@]}" \
        --criterion a2d_kd --max-update "$STUDENT_UPDATES"' \
    'train seq_kd 1 "$OUT/data-bin-seqkd" --task translation "${STUDENT[@]}" \
        --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-update "$STUDENT_UPDATES"'

step "6/8 export each model as a stock fairseq transformer and decode the test set (beam 5)"
SYSTEMS=(teacher no_kd word_kd a2d_kd seq_kd)
PARAMS=()
for name in "${SYSTEMS[@]}"; do
    mkdir -p "$OUT/models" "$OUT/generate"
    model="$OUT/models/$name.pt"
    [[ -f "$model" ]] || threads 2 "$PY" -m fairseq_kd.cli.export_student \
        "$OUT/checkpoints/$name/checkpoint_best.pt" "$model" >"$OUT/models/$name.json"
    if [[ ! -s "$OUT/generate/$name.txt" ]]; then
        # stock fairseq-generate, no --user-dir: the exported model is a plain transformer
        threads 2 "$BIN/fairseq-generate" "$OUT/data-bin" --task translation --path "$model" --gen-subset test \
            --beam 5 --batch-size 100 --required-batch-size-multiple 1 --max-len-a 0 --max-len-b "$MAX_LEN" \
            >"$OUT/generate/$name.tmp" 2>"$OUT/generate/$name.log"
        mv "$OUT/generate/$name.tmp" "$OUT/generate/$name.txt"
    fi
    PARAMS+=(--params "$name=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["parameters"])' "$OUT/models/$name.json")")
    echo "$name: $(grep -o 'Translated.*sentences' "$OUT/generate/$name.log")"
done

step "7/8 BLEU report (sacreBLEU, 95% intervals, paired tests vs no_kd) and figures"
ARGS=()
for name in "${SYSTEMS[@]}"; do ARGS+=(--system "$name=$OUT/generate/$name.txt"); done
# The synthetic language is whitespace-tokenised by design (its references too), so sacreBLEU's
# "forgot to detokenize?" advice, printed per system, does not apply here. No speed column: the
# students decode on a machine shared with nothing else only by chance.
"$PY" -m fairseq_kd.cli.report "${ARGS[@]}" --baseline no_kd "${PARAMS[@]}" \
    --bootstrap 1000 --out-prefix "$OUT/report" --overwrite \
    --title "Demo: synthetic SVO->SOV corpus, $TRAIN_SIZE training pairs; teacher 4+4 d128 ($TEACHER_UPDATES updates), students 2+2 d64 ($STUDENT_UPDATES updates)" \
    2> >(grep -v -e "tokenized period" -e "forgot to detokenize" -e "suppress this message" >&2)
LOGS=()
for name in "${SYSTEMS[@]}"; do LOGS+=(--log "$name=$OUT/logs/$name.log"); done
"$PY" -m fairseq_kd.cli.plot compare "${LOGS[@]}" --output "$OUT/validation_nll.png" --overwrite
"$PY" -m fairseq_kd.cli.plot curves --log "$OUT/logs/a2d_kd.log" --output "$OUT/a2d_kd_training_curves.png" --overwrite
"$PY" -m fairseq_kd.cli.plot alignment --checkpoint "$OUT/checkpoints/a2d_kd/checkpoint_best.pt" \
    --weights-output "$OUT/a2d_kd_alignment.json" --output "$OUT/a2d_kd_alignment.png" --overwrite

step "8/8 ship the A2D student: CTranslate2 float32 and int8 against the teacher under fairseq (2 threads)"
# Timings are decoding time only, one process at a time, on whatever else the machine is doing;
# BLEU and the paired tests are exact and repeatable.
"$BIN/fairseq-kd-deploy-benchmark" --data "$OUT/data-bin" --teacher "$OUT/models/teacher.pt" \
    --student "a2d_kd=$OUT/models/a2d_kd.pt" --quantizations float32,int8 --threads 2 --batch-sizes 100 \
    --beam 5 --max-len-a 0 --max-len-b "$MAX_LEN" --bootstrap 1000 --workdir "$OUT/deploy" \
    --output-md "$OUT/deploy.md" --output-json "$OUT/deploy.json" --overwrite \
    --title "Demo deploy table: the A2D student under fairseq and CTranslate2 against the teacher" >"$OUT/deploy.log" 2>&1 \
    || { tail -20 "$OUT/deploy.log" >&2; exit 1; }
"$PY" - "$OUT" <<'PYEOF'
# The deploy summary, and the README's demo tables (readme_section.md) from report.json and deploy.json
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
report, deploy = (json.loads((out / name).read_text()) for name in ("report.json", "deploy.json"))
names = {"teacher": "teacher (4+4, d 128)", "no_kd": "no KD (2+2, d 64)", "word_kd": "word-level KD",
         "a2d_kd": "Align-to-Distill", "seq_kd": "sequence-level KD"}
lines = ["| system | parameters | BLEU | 95% CI | Δ vs no KD | p |", "|---|---:|---:|---:|---:|---:|"]
for row in report["systems"]:
    base = row["is_baseline"]
    lines.append(f"| {names[row['system']]} | {row['params']:,} | {row['bleu']:.2f} | ± {row['ci']:.2f} | "
                 + ("" if base else f"{row['difference']:+.2f}") + " | " + ("" if base else f"{row['p_bootstrap']:.3f}") + " |")
teacher = next(row for row in deploy["rows"] if row["role"] == "teacher")
speed = lambda row: row["measurements"][0]
lines += ["", f"| A2D student shipped | BLEU | Δ vs fairseq student | p | sentences/s ({speed(teacher)['threads']} threads, "
          f"batch {speed(teacher)['batch_size']}) | vs teacher | size on disk |", "|---|---:|---:|---:|---:|---:|---:|"]
for row in deploy["rows"]:
    engine = {"fairseq": "fairseq", "ctranslate2": "CTranslate2"}[row["engine"]]
    label = "teacher, fairseq float32" if row["role"] == "teacher" else f"{engine} {row['weights']}"
    identical = (row.get("paired") or {}).get("sentences_differing") == 0
    delta = "" if row["delta"] is None or row["role"] == "teacher" else f"{row['delta']:+.2f}"
    p = "" if row["role"] == "teacher" or row["p_bootstrap"] is None else ("identical" if identical else f"{row['p_bootstrap']:.3f}")
    lines.append(f"| {label} | {row['bleu']:.2f} | {delta} | {p} | {speed(row)['sentences_per_s']:.0f} | "
                 f"{speed(row)['speedup_vs_teacher']:.1f}x | {row['size_mb']:.2f} MB |")
    print(f"{label:>26}: BLEU {row['bleu']:6.2f}, {speed(row)['sentences_per_s']:7.1f} sentences/s "
          f"({speed(row)['speedup_vs_teacher']:.1f}x the teacher under fairseq), {row['size_mb']:.2f} MB")
(out / "readme_section.md").write_text("\n".join(lines) + "\n")
PYEOF
echo
echo "Report: $OUT/report.md (.csv, .json); deploy table: $OUT/deploy.md (.json); README tables: $OUT/readme_section.md"
echo "Figures: $OUT/validation_nll.png (every model's validation nll against updates),"
echo "         $OUT/a2d_kd_training_curves.png (A2D's loss terms), $OUT/a2d_kd_alignment.png (its AAM weights)"
echo "Models: $OUT/models/ (stock fairseq transformers); total $((SECONDS - START)) s"
