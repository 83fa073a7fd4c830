#!/usr/bin/env bash
# The wmt22_de_dsb recipe: prepare the corpus, train the teacher and every student, decode the test set,
# score, report and plot. Arguments go to fairseq-kd-recipe, e.g.
#   examples/translation/wmt22_de_dsb/run.sh --methods no_kd,word_kd,a2d_kd_4h --archives ~/corpora
#   examples/translation/wmt22_de_dsb/run.sh --list-methods
#   examples/translation/wmt22_de_dsb/run.sh --dry-run
# Re-running skips finished steps. See examples/translation/README.md ("Recipes").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$here/../../../.venv/bin/python}"
[ -x "$python" ] || python=python3
PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m fairseq_kd_recipes.recipe wmt22_de_dsb "$@"
