#!/usr/bin/env bash
# The iwslt14_de_en recipe: prepare the corpus, train the teacher and every student, decode the test set,
# score, report and plot. Arguments go to fairseq-kd-recipe, e.g.
#   examples/translation/iwslt14_de_en/run.sh --methods no_kd,word_kd,a2d_kd_4h --archives ~/corpora
#   examples/translation/iwslt14_de_en/run.sh --list-methods
#   examples/translation/iwslt14_de_en/run.sh --dry-run
# Re-running skips finished steps. See examples/translation/README.md ("Recipes").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$here/../../../.venv/bin/python}"
[ -x "$python" ] || python=python3
PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m fairseq_kd_recipes.recipe iwslt14_de_en "$@"
