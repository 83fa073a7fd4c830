"""Prepare IWSLT'17 English-Chinese with a joint SentencePiece model (Align-to-Distill setup).

    python examples/translation/iwslt17_en_zh/prepare.py
    python examples/translation/iwslt17_en_zh/prepare.py --archives ~/corpora   # en-zh.tgz already there

Flags and steps: ``fairseq_kd_recipes.prepare.scripts.iwslt17_en_zh``, which the recipes run (with
``python -m`` where the package is installed); see examples/translation/README.md.
"""
import sys
from pathlib import Path

# The recipes' package sits next to this folder; without `pip install .` it is found from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairseq_kd_recipes.prepare.scripts.iwslt17_en_zh import build_parser, cli_main, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(cli_main())
