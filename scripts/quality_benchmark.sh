#!/usr/bin/env bash
# The real-corpus quality benchmark: Multi30k task 1 French-English (29K training pairs), a teacher
# and 3+3 students trained without KD and with each distillation method, test_2016_flickr decoded
# with beam 5, and the report (BLEU, sacreBLEU's 95% CI, delta and paired bootstrap / approximate
# randomisation p against no KD).
#
#   bash scripts/quality_benchmark.sh                       # every method, gpu profile if a GPU is visible
#   bash scripts/quality_benchmark.sh --profile cpu --methods no_kd,word_kd,a2d_kd_4h
#   bash scripts/quality_benchmark.sh --teacher path/to/teacher.pt   # distil from a teacher you have
#
# Arguments go to fairseq-kd-recipe (see examples/translation/README.md, "Recipes"). The corpus is
# read from $MULTI30K_DIR (default ../shared/data/multi30k-fr-en, the release's file names:
# train/val/test_2016_flickr.{fr,en}.gz), or downloaded when that folder does not exist. Re-running
# skips finished steps and resumes an interrupted training. The report is copied to
# $QUALITY_RESULTS_DIR/multi30k_fr_en_<profile>.md (default docs/results/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh"
PY="${FAIRSEQ_KD_VENV:-$ROOT/.venv}/bin/python"
cd "$ROOT"

PROFILE=auto
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --profile) PROFILE="${args[i + 1]:-auto}" ;;
        --profile=*) PROFILE="${args[i]#--profile=}" ;;
    esac
done
if [[ "$PROFILE" == auto ]]; then
    PROFILE="$("$PY" -c 'import torch; print("gpu" if torch.cuda.is_available() else "cpu")')"
fi

source_args=()
MULTI30K_DIR="${MULTI30K_DIR:-$ROOT/../shared/data/multi30k-fr-en}"
if [[ " $* " != *" --data "* && -d "$MULTI30K_DIR" ]]; then
    source_args=(--archives "$MULTI30K_DIR")
fi
WORKDIR="${QUALITY_WORKDIR:-$ROOT/work_dirs/quality/multi30k_fr_en/$PROFILE}"

PYTHONPATH="$ROOT/examples/translation${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m fairseq_kd_recipes.recipe multi30k_fr_en --profile "$PROFILE" --workdir "$WORKDIR" "${source_args[@]}" "$@"
# Only after a run (not --dry-run, --print-commands or --sbatch): report/tables.txt names the tables
# that run's plan wrote.
if [[ -f "$WORKDIR/report/tables.txt" && " $* " != *" --dry-run "* && " $* " != *" --print-commands "* \
      && " $* " != *" --sbatch"* ]]; then
    RESULTS_DIR="${QUALITY_RESULTS_DIR:-$ROOT/docs/results}"
    mkdir -p "$RESULTS_DIR"
    # The tables this invocation's plan wrote (report/tables.txt, in step order; an earlier invocation's
    # tables in the same folder are not copied): the main table, one per other student shape
    # (results_2l.md: CKD's 2+2 students against no_kd_2l) and per further seed (results_seed2.md),
    # then what holds on every seed (seeds.md, --student-seeds); not the tokenised-BLEU tables.
    TABLES=()
    while IFS= read -r name; do
        if [[ -n "$name" && "$name" != results_tokenized* ]]; then TABLES+=("$WORKDIR/report/$name"); fi
    done < "$WORKDIR/report/tables.txt"
    if [[ ${#TABLES[@]} -eq 0 ]]; then
        echo "quality_benchmark.sh: $WORKDIR/report/tables.txt names no results table; nothing copied" >&2
        exit 1
    fi
    cat "${TABLES[@]}" > "$RESULTS_DIR/multi30k_fr_en_${PROFILE}.md"
    echo "report copied to $RESULTS_DIR/multi30k_fr_en_${PROFILE}.md"
    # Each system's test translations as scored (BPE removed, Moses-detokenised), one line per test
    # sentence: with them a later session can add systems and recompute the paired tests
    # (fairseq-kd-score --hyp FILE --ref REF --ref-is-plain) without retraining these models.
    HYP_DIR="$RESULTS_DIR/multi30k_fr_en_${PROFILE}_hypotheses"
    mkdir -p "$HYP_DIR"
    "$PY" - "$WORKDIR" "$HYP_DIR" "${TABLES[@]}" <<'PYEOF'
import json, sys
from pathlib import Path
from fairseq_kd.scoring.detok import detokenize_lines, read_generate_output
workdir, out, tables = Path(sys.argv[1]), Path(sys.argv[2]), [Path(path) for path in sys.argv[3:]]
systems = 0
for table in tables:
    if not table.name.startswith("results"):  # seeds.md lists no system's decoding
        continue
    report = json.loads(table.with_suffix(".json").read_text(encoding="utf-8"))
    for row in report["systems"]:
        parsed = read_generate_output(workdir / "generate" / row["system"] / "generate-test.txt",
                                      expected_sentences=report["n_sentences"])
        lines = detokenize_lines(parsed.hypotheses, "subword_nmt", "en")
        (out / f"{row['system']}.en").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        systems += 1
print(f"test translations of {systems} systems in {out}")
PYEOF
fi
