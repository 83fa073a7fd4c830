"""Prepare IWSLT'14 Portuguese-English or Turkish-English with a joint SentencePiece model (CKD setup).

    python examples/translation/iwslt14_pt_en_tr_en/prepare.py --pair pt-en
    python examples/translation/iwslt14_pt_en_tr_en/prepare.py --pair tr-en --archives ~/corpora

Flags and steps: ``fairseq_kd_recipes.prepare.scripts.iwslt14_pt_en_tr_en``, which the recipes run (with
``python -m`` where the package is installed); see examples/translation/README.md.
"""
import sys
from pathlib import Path

# The recipes' package sits next to this folder; without `pip install .` it is found from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairseq_kd_recipes.prepare.scripts.iwslt14_pt_en_tr_en import build_parser, cli_main, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(cli_main())
