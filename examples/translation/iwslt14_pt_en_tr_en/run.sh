#!/usr/bin/env bash
# The CKD setup's recipes for IWSLT'14 Portuguese-English and Turkish-English: prepare the corpus,
# train the teacher and every student, decode the test set, score, report and plot. The first
# argument chooses the pair; the others go to fairseq-kd-recipe, e.g.
#   examples/translation/iwslt14_pt_en_tr_en/run.sh pt-en --methods no_kd,word_kd,pkd,ckd_rc
#   examples/translation/iwslt14_pt_en_tr_en/run.sh tr-en --list-methods
# Re-running skips finished steps. See examples/translation/README.md ("Recipes").
set -euo pipefail
case "${1:-}" in
  pt-en) recipe=iwslt14_pt_en ;;
  tr-en) recipe=iwslt14_tr_en ;;
  *) echo "usage: $0 pt-en|tr-en [fairseq-kd-recipe options]" >&2; exit 2 ;;
esac
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$here/../../../.venv/bin/python}"
[ -x "$python" ] || python=python3
PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m fairseq_kd_recipes.recipe "$recipe" "$@"
