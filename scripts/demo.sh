#!/usr/bin/env bash
# The main job end to end on data the project makes itself:
#   synthetic corpus -> fairseq-preprocess -> teacher -> students (no KD, Align-to-Distill,
#   sequence-level KD), each with three seeds -> export -> decode the test set -> BLEU
#   reports with 95% intervals and paired tests against no KD, per seed -> the verdict that holds on
#   every seed -> figures (every model's validation nll on one axis, A2D's loss
#   terms, A2D's alignment heatmap) -> deploy table: the A2D student exported to CTranslate2 (float32,
#   int8) against the teacher under fairseq, speed and BLEU.
# Runs in about 22 minutes on 2 quiet cores of a 2-core AVX2-only AMD EPYC (the teacher 9 of them; an
# estimated 10 on an AVX-512 one: docs/results/demo_design.md); everything lands in
# $DEMO_DIR (default demo_output/), each step's wall and CPU time (user+sys of its processes) in
# $DEMO_DIR/steps.tsv, each training's and the merged export's and decoding's in $DEMO_DIR/times.tsv.
# Re-running skips finished steps; an interrupted training run resumes from its last checkpoint.
#
# The same numbers from the same commit run after run on one machine: every process runs with a
# fixed thread count (the teacher and the decoding two threads, each student one, two students at a
# time), fixed seeds, and the CPU kernels pinned to their AVX2 variants (PyTorch's own
# ATEN_CPU_CAPABILITY, MKL's conditional numerical reproducibility MKL_CBWR, oneDNN's
# ONEDNN_MAX_CPU_ISA; each may be set otherwise in the environment). Across CPUs the last bits of
# a reduction still differ and a short training amplifies them as a new seed would, so every
# student trains with several seeds and the demo concludes only what holds on every seed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
VENV="${FAIRSEQ_KD_VENV:-$ROOT/.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
OUT="$(mkdir -p "${DEMO_DIR:-$ROOT/demo_output}" && cd "${DEMO_DIR:-$ROOT/demo_output}" && pwd)"
USER_DIR="$ROOT/fairseq_kd"
export PYTHONWARNINGS=ignore  # fairseq-fixed's deprecation warnings drown its progress output
export ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2} MKL_CBWR=${MKL_CBWR:-AVX2} KMP_DETERMINISTIC_REDUCTION=yes
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2}
export CT2_FORCE_CPU_ISA=${CT2_FORCE_CPU_ISA:-AVX2}  # CTranslate2's kernels too (its int8 GEMM differs between ISAs)
# DEMO_LAST_STEP=6 stops after the decoding (tests/test_demo.py re-runs one student so)
LAST_STEP=${DEMO_LAST_STEP:-8}
START=$SECONDS

# Wall and CPU time. CPU time (user+sys, from bash's `times` and `time`) is what a step costs
# whatever else runs on the machine; wall time is not, on a shared one.
TIMEFORMAT='%R %U %S'
: >"$OUT/steps.tsv"; : >"$OUT/times.tsv"
cpu_now() {  # CPU=user+sys seconds of every child of this shell waited for so far (not in a subshell: $(...)'s own)
    times >"$OUT/.times"
    CPU=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, t, "m"); sub("s", "", t[2]); n += t[1] * 60 + t[2] }; print n }' "$OUT/.times")
}
STEP=""
end_step() {
    [[ -n "$STEP" ]] || return 0
    cpu_now
    awk -v s="$STEP" -v t0="$STEP_T0" -v t1="$(date +%s.%N)" -v c0="$STEP_CPU0" -v c1="$CPU" \
        'BEGIN { printf "%s\t%.1f\t%.1f\n", s, t1 - t0, c1 - c0 }' >>"$OUT/steps.tsv"
}
step() {
    end_step
    cpu_now
    STEP=${1%% *}; STEP_T0=$(date +%s.%N); STEP_CPU0=$CPU
    printf '\n==== [%s] %s\n' "$(date +%H:%M:%S)" "$*"
}
timed() {  # timed LABEL COMMAND...: run it; add "LABEL wall-s cpu-s" to times.tsv (cpu: user+sys)
    local label=$1 t status=0; shift
    { t=$( { time "$@" 1>&3 2>&4; } 2>&1 ) || status=$?; } 3>&1 4>&2
    awk -v l="$label" '{ printf "%s\t%.1f\t%.1f\n", l, $(NF-2), $(NF-1) + $NF }' <<<"$t" >>"$OUT/times.tsv"
    return "$status"
}
done_or_run() {  # done_or_run NAME COMMAND...: run once, remember success in a stamp file
    local stamp="$OUT/.done.$1"; shift
    if [[ -f "$stamp" ]]; then echo "(already done: $(basename "$stamp" | cut -d. -f3-))"; return; fi
    "$@" || return  # (explicit: errexit does not reach into a function called from an && list)
    touch "$stamp"
}
threads() {  # threads N COMMAND...: run with N intra-op threads
    local n=$1; shift
    OMP_NUM_THREADS=$n MKL_NUM_THREADS=$n "$@"
}

# Hyper-parameters: the papers' recipe (Adam 0.9/0.98, label smoothing 0.1) scaled to a corpus
# that a 4-layer, d=128 teacher learns in a few hundred updates on two CPU cores, with the learning
# rate decaying linearly to zero at the last update (polynomial_decay): a run ends converged to its
# schedule rather than at an arbitrary point of a noisy descent, which is what makes a short run
# repeatable across seeds and CPUs. The checkpoint decoded is the one with the best validation nll
# (never a KD criterion's total loss). Rates chosen on validation nll (docs/results/demo.md).
# Every student is trained with each seed of SEEDS: a conclusion of the demo must hold on every
# seed (fairseq_kd_recipes/demo_summary.py), because a new seed, a new CPU or a new rounding moves a
# short training as much as each other.
COMMON=(--user-dir "$USER_DIR" --share-all-embeddings --optimizer adam --adam-betas '(0.9, 0.98)'
        --lr-scheduler polynomial_decay --warmup-updates 100 --dropout 0.1 --weight-decay 1e-4
        --no-epoch-checkpoints --num-workers 0
        --best-checkpoint-metric nll_loss --log-format json --log-interval 25)
TEACHER_UPDATES=${TEACHER_UPDATES:-500}
STUDENT_UPDATES=${STUDENT_UPDATES:-300}
TRAIN_SIZE=${TRAIN_SIZE:-10000}
VALID_SIZE=${VALID_SIZE:-300}
TEST_SIZE=${TEST_SIZE:-1000}
SEEDS=(${SEEDS:-1 2 3})
# Beam search stops at 1.2 x the source length + 10 (every reference fits: the language's target is
# at most 1.5 x its source + 0, at most 5 tokens longer); fairseq's default of 200 tokens lets a
# student that repeats itself lose 20 BLEU on a few sentences.
MAX_LEN_A=${MAX_LEN_A:-1.2}
MAX_LEN_B=${MAX_LEN_B:-10}
# The students learn from batches of 2,048 tokens: half the teacher's, at half the cost of an update.
# After 300 updates no student has converged (valid nll 0.26-0.70 bits, the teacher's 0.14), and
# distillation lifts such a student on every seed and CPU rounding (docs/results/demo_design.md).
STUDENT=(--arch transformer_kd_tiny_student --max-tokens 2048 --lr 8e-3
         --max-update "$STUDENT_UPDATES" --total-num-update "$STUDENT_UPDATES")

step "1/8 synthetic corpus (SVO source -> SOV target with agreement; fairseq_kd/data/synthetic.py)"
"$PY" -m fairseq_kd.cli.make_corpus --output-dir "$OUT/corpus" --seed 1 \
    --train-size "$TRAIN_SIZE" --valid-size "$VALID_SIZE" --test-size "$TEST_SIZE"

step "2/8 fairseq-preprocess (joined dictionary)"
done_or_run preprocess "$BIN/fairseq-preprocess" --source-lang src --target-lang tgt \
    --trainpref "$OUT/corpus/train" --validpref "$OUT/corpus/valid" --testpref "$OUT/corpus/test" \
    --destdir "$OUT/data-bin" --joined-dictionary --workers 2 >"$OUT/preprocess.log"

train() {  # train NAME THREADS DATA EXTRA_FLAGS...
    local name=$1 n=$2 data=$3; shift 3
    timed "train $name" done_or_run "train_$name" threads "$n" "$BIN/fairseq-train" "$data" "${COMMON[@]}" \
        --save-dir "$OUT/checkpoints/$name" --log-file "$OUT/logs/$name.log" "$@" >"$OUT/logs/$name.out" 2>&1 || {
        echo "$name: training failed; the end of $OUT/logs/$name.out:" >&2; tail -5 "$OUT/logs/$name.out" >&2; return 1; }
    echo "$name: trained ($(grep -o '"valid_nll_loss": "[0-9.]*"' "$OUT/logs/$name.log" | tail -1))"
}
two_at_a_time() {  # two_at_a_time "CMD"...: the commands two at a time, one core each; fail if any fails
    local running=0 status=0 command
    for command in "$@"; do
        if ((running == 2)); then wait -n || status=$?; running=$((running - 1)); fi
        eval "$command" & running=$((running + 1))
    done
    while ((running > 0)); do wait -n || status=$?; running=$((running - 1)); done
    return "$status"
}
mkdir -p "$OUT/logs"

step "3/8 teacher: transformer_kd_tiny_teacher (4+4 layers, 4 heads, d=128), plain CE"
train teacher 2 "$OUT/data-bin" --task translation --arch transformer_kd_tiny_teacher --seed 1 \
    --max-tokens 4096 --lr 3e-3 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-update "$TEACHER_UPDATES" --total-num-update "$TEACHER_UPDATES"
TEACHER="$OUT/checkpoints/teacher/checkpoint_best.pt"

step "4/8 sequence-level KD data: the teacher beam-decodes the training set"
timed "seqkd pass" done_or_run seqkd_data threads 2 "$BIN/fairseq-kd-seqkd" --data "$OUT/data-bin" --teacher-checkpoint "$TEACHER" \
    --output "$OUT/data-bin-seqkd" --beam 5 --max-tokens 8192 --max-len-a "$MAX_LEN_A" --max-len-b "$MAX_LEN_B"

step "5/8 students: transformer_kd_tiny_student (2+2 layers, 2 heads, d=64), seeds ${SEEDS[*]}, two at a time"
echo "-- no KD (label-smoothed CE), Align-to-Distill (a2d_kd, its defaults: CE + word-level KD + all three"
echo "   attention kinds, head-wise AAM), sequence-level KD (CE on the teacher's outputs)"
TRAININGS=()
for seed in "${SEEDS[@]}"; do  # the slowest first, so that the last pair ends together
    TRAININGS+=(
        "train a2d_kd_seed$seed 1 \"\$OUT/data-bin\" --task translation_kd --teacher-checkpoint \"\$TEACHER\" \"\${STUDENT[@]}\" --seed $seed --criterion a2d_kd"
        "train no_kd_seed$seed 1 \"\$OUT/data-bin\" --task translation \"\${STUDENT[@]}\" --seed $seed --criterion label_smoothed_cross_entropy --label-smoothing 0.1"
        "train seq_kd_seed$seed 1 \"\$OUT/data-bin-seqkd\" --task translation \"\${STUDENT[@]}\" --seed $seed --criterion label_smoothed_cross_entropy --label-smoothing 0.1")
done
two_at_a_time "${TRAININGS[@]}"

step "6/8 export each model as a stock fairseq transformer and decode the test set (beam 5)"
METHODS=(no_kd a2d_kd seq_kd)
MODELS=(teacher)
for seed in "${SEEDS[@]}"; do for method in "${METHODS[@]}"; do MODELS+=("${method}_seed$seed"); done; done
mkdir -p "$OUT/models" "$OUT/generate"
# every model not yet exported, from one interpreter (fairseq-kd-export's cli_main once per model:
# one start-up for all of them); each model's summary (its parameter count) in models/NAME.json
EXPORT_PY='import contextlib, os, sys
from fairseq_kd.cli.export_student import cli_main
out = sys.argv[1]
for name in sys.argv[2:]:
    with open(f"{out}/models/{name}.json.tmp", "w") as summary, contextlib.redirect_stdout(summary):
        cli_main([f"{out}/checkpoints/{name}/checkpoint_best.pt", f"{out}/models/{name}.pt"])
    os.replace(f"{out}/models/{name}.json.tmp", f"{out}/models/{name}.json")'
TO_EXPORT=()
for name in "${MODELS[@]}"; do [[ -f "$OUT/models/$name.pt" ]] || TO_EXPORT+=("$name"); done
if ((${#TO_EXPORT[@]})); then timed "export ${TO_EXPORT[*]}" threads 2 "$PY" -c "$EXPORT_PY" "$OUT" "${TO_EXPORT[@]}"; fi
# every model not yet decoded, with stock fairseq-generate's main() (no --user-dir: the exported model is a
# plain transformer) once per model in one interpreter: one start-up for all of them; each model's
# hypotheses (what the command prints on stdout) in generate/NAME.txt, fairseq's log lines in generate/NAME.log
DECODE_PY='import contextlib, logging, os, sys
from fairseq import options
from fairseq_cli.generate import main
out, data, split = sys.argv[1], sys.argv[2], sys.argv.index("--")
flags, names, root = sys.argv[3:split], sys.argv[split + 1:], logging.getLogger()
root.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())  # fairseq-generate logs at INFO
for name in names:
    parser = options.get_generation_parser()
    parser.add_argument("--arch", "-a", default="wav2vec2")  # as fairseq-generate does
    args = options.parse_args_and_arch(parser, [data, "--path", f"{out}/models/{name}.pt", *flags])
    log = logging.FileHandler(f"{out}/generate/{name}.log", mode="w")
    log.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%Y-%m-%d %H:%M:%S"))
    saved, root.handlers = root.handlers, [log]
    try:
        with open(f"{out}/generate/{name}.tmp", "w") as hypotheses, contextlib.redirect_stdout(hypotheses):
            main(args)
    finally:
        root.handlers = saved
        log.close()
    os.replace(f"{out}/generate/{name}.tmp", f"{out}/generate/{name}.txt")'
TO_DECODE=()
for name in "${MODELS[@]}"; do [[ -s "$OUT/generate/$name.txt" ]] || TO_DECODE+=("$name"); done
if ((${#TO_DECODE[@]})); then
    timed "decode ${TO_DECODE[*]}" threads 2 "$PY" -c "$DECODE_PY" "$OUT" "$OUT/data-bin" --task translation --gen-subset test \
        --beam 5 --batch-size 100 --required-batch-size-multiple 1 --max-len-a "$MAX_LEN_A" --max-len-b "$MAX_LEN_B" \
        -- "${TO_DECODE[@]}"
fi
declare -A PARAMS
for name in "${MODELS[@]}"; do
    PARAMS[$name]=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["parameters"])' "$OUT/models/$name.json")
    echo "$name: $(grep -o 'Translated.*sentences' "$OUT/generate/$name.log")"
done
if ((LAST_STEP < 7)); then end_step; exit 0; fi

step "7/8 BLEU reports (sacreBLEU, 95% intervals, paired tests vs the same seed's no KD), the verdict, figures"
# The synthetic language is whitespace-tokenised by design (its references too), so sacreBLEU's
# "forgot to detokenize?" advice, printed per system, does not apply here. No speed column: the
# students decode on a machine shared with nothing else only by chance.
SUMMARY=()
for seed in "${SEEDS[@]}"; do
    ARGS=(--system "teacher=$OUT/generate/teacher.txt" --params "teacher=${PARAMS[teacher]}")
    for method in "${METHODS[@]}"; do
        ARGS+=(--system "$method=$OUT/generate/${method}_seed$seed.txt" --params "$method=${PARAMS[${method}_seed$seed]}")
        SUMMARY+=(--log "$method/$seed=$OUT/logs/${method}_seed$seed.log")
    done
    timed "report seed$seed" "$PY" -m fairseq_kd.cli.report "${ARGS[@]}" --baseline no_kd --bootstrap 1000 --out-prefix "$OUT/report_seed$seed" \
        --overwrite --title "Demo, seed $seed: synthetic SVO->SOV corpus, $TRAIN_SIZE training pairs; teacher 4+4 d128 ($TEACHER_UPDATES updates of 4,096 tokens), students 2+2 d64 ($STUDENT_UPDATES updates of 2,048 tokens)" \
        2> >(grep -v -e "tokenized period" -e "forgot to detokenize" -e "suppress this message" >&2) >/dev/null
    SUMMARY+=(--report "$seed=$OUT/report_seed$seed.json")
done
SUMMARY+=(--log "teacher/${SEEDS[0]}=$OUT/logs/teacher.log")
LOGS=(--log "teacher=$OUT/logs/teacher.log")
for method in "${METHODS[@]}"; do LOGS+=(--log "$method=$OUT/logs/${method}_seed${SEEDS[0]}.log"); done
# the three figures from one interpreter (fairseq-kd-plot's cli_main once per figure, "---" between them)
FIGURES_PY='import sys
from fairseq_kd.cli.plot import cli_main
figure = []
for word in sys.argv[1:] + ["---"]:
    if word == "---":
        cli_main(figure)
        figure = []
    else:
        figure.append(word)'
timed figures "$PY" -c "$FIGURES_PY" \
    compare "${LOGS[@]}" --output "$OUT/validation_nll.png" --overwrite \
        --title "Demo: validation nll of the teacher and the students of seed ${SEEDS[0]}" --- \
    curves --log "$OUT/logs/a2d_kd_seed${SEEDS[0]}.log" --output "$OUT/a2d_kd_training_curves.png" --overwrite --- \
    alignment --checkpoint "$OUT/checkpoints/a2d_kd_seed${SEEDS[0]}/checkpoint_best.pt" \
        --weights-output "$OUT/a2d_kd_alignment.json" --output "$OUT/a2d_kd_alignment.png" --overwrite
if ((LAST_STEP < 8)); then end_step; exit 0; fi

step "8/8 ship the A2D student of seed ${SEEDS[0]}: CTranslate2 float32 and int8 against the teacher under fairseq (2 threads)"
# Timings are decoding time only, one process at a time, on whatever else the machine is doing;
# BLEU and the paired tests are exact and repeatable.
timed deploy "$BIN/fairseq-kd-deploy-benchmark" --data "$OUT/data-bin" --teacher "$OUT/models/teacher.pt" \
    --student "a2d_kd=$OUT/models/a2d_kd_seed${SEEDS[0]}.pt" --quantizations float32,int8 --threads 2 --batch-sizes 100 \
    --beam 5 --max-len-a "$MAX_LEN_A" --max-len-b "$MAX_LEN_B" --bootstrap 1000 --workdir "$OUT/deploy" \
    --output-md "$OUT/deploy.md" --output-json "$OUT/deploy.json" --overwrite \
    --title "Demo deploy table: the A2D student under fairseq and CTranslate2 against the teacher" >"$OUT/deploy.log" 2>&1 \
    || { tail -20 "$OUT/deploy.log" >&2; exit 1; }
echo
echo "The verdict over seeds ${SEEDS[*]} (every student against the no-KD student of its seed):"
# DEMO_RECORD_INTO=tests/expected/demo.json adds this run and its machine to the runs the suite checks
RECORD=(${DEMO_RECORD_INTO:+--record-into "$DEMO_RECORD_INTO"})
"$PY" -m fairseq_kd_recipes.demo_summary "${SUMMARY[@]}" --deploy "$OUT/deploy.json" --out-prefix "$OUT/summary" "${RECORD[@]}"
end_step
echo
echo "Summary: $OUT/summary.md (.json); per seed: $OUT/report_seed*.md (.csv, .json); deploy table: $OUT/deploy.md"
echo "(.json); README tables: $OUT/readme_section.md"
echo "Figures: $OUT/validation_nll.png (validation nll against updates, seed ${SEEDS[0]}),"
echo "         $OUT/a2d_kd_training_curves.png (A2D's loss terms), $OUT/a2d_kd_alignment.png (its AAM weights)"
echo "Models: $OUT/models/ (stock fairseq transformers)"
echo "Time per step (wall s, CPU s = user+sys of its processes; $OUT/steps.tsv, per process $OUT/times.tsv):"
awk -F'\t' '{ printf "  %-4s %7.1f %8.1f\n", $1, $2, $3; w += $2; c += $3 } END { printf "  all  %7.1f %8.1f\n", w, c }' "$OUT/steps.tsv"
echo "total $((SECONDS - START)) s"
