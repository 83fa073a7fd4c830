#!/usr/bin/env bash
# Sequence-level knowledge distillation (Kim & Rush, 2016) as a recipe step.
#
#   examples/translation/seqkd.sh DATA_BIN TEACHER_CHECKPOINT SEQKD_BIN STUDENT_SAVE_DIR [fairseq-train flags]
#
# 1. fairseq-kd-seqkd beam-decodes (beam 5) every training source of DATA_BIN with the teacher and
#    writes SEQKD_BIN: the same sources with the teacher's outputs as targets, plus DATA_BIN's
#    dictionaries and valid/test splits. Resumable: re-running continues an interrupted decoding,
#    and does nothing once it is complete.
# 2. fairseq-train trains the student on SEQKD_BIN. By default with label-smoothed CE only (Kim &
#    Rush's "Seq-KD"); to combine sequence-level with another method, point that method at SEQKD_BIN,
#    e.g. CRITERION="--task translation_kd --teacher-checkpoint $TEACHER --criterion word_kd".
#
# Environment (all optional):
#   PYTHON_BIN     the project's environment (default: .venv/bin next to this repository)
#   SEQKD_FLAGS    extra fairseq-kd-seqkd flags (default: --beam 5 --max-tokens 4096); n-best data, e.g.
#                  "--beam 5 --nbest 5 --select chrf --remove-bpe subword_nmt --filter-keep-share 0.95"
#   CRITERION      task and criterion flags of the student (default: plain label-smoothed CE)
#   STUDENT_ARCH   --arch of the student (default: transformer_kd_iwslt_student_3l)
# Flags after the four paths go to fairseq-train (optimiser, schedule, --max-update, ...).
set -euo pipefail

if [ "$#" -lt 4 ]; then
    sed -n '2,20p' "$0" >&2
    exit 2
fi
DATA_BIN=$1 TEACHER=$2 SEQKD_BIN=$3 SAVE_DIR=$4
shift 4
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN_DIR="${PYTHON_BIN:-$ROOT/.venv/bin}"
SEQKD_FLAGS=${SEQKD_FLAGS:---beam 5 --max-tokens 4096}
CRITERION=${CRITERION:---task translation --criterion label_smoothed_cross_entropy --label-smoothing 0.1}
STUDENT_ARCH=${STUDENT_ARCH:-transformer_kd_iwslt_student_3l}

# shellcheck disable=SC2086  # the flag variables are word lists on purpose
"$BIN_DIR/fairseq-kd-seqkd" --data "$DATA_BIN" --teacher-checkpoint "$TEACHER" --output "$SEQKD_BIN" $SEQKD_FLAGS

# shellcheck disable=SC2086
"$BIN_DIR/fairseq-train" "$SEQKD_BIN" --user-dir "$ROOT/fairseq_kd" $CRITERION \
    --arch "$STUDENT_ARCH" --save-dir "$SAVE_DIR" "$@"
