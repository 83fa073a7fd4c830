"""Prepare WMT'22 German-Lower Sorbian (very-low-resource task, ~40K pairs) with a joint SentencePiece model.

    python examples/translation/wmt22_de_dsb/prepare.py
    python examples/translation/wmt22_de_dsb/prepare.py --archives ~/corpora/wmt22-dsb --test-set valid2022

Flags and steps: ``fairseq_kd_recipes.prepare.scripts.wmt22_de_dsb``, which the recipes run (with
``python -m`` where the package is installed); see examples/translation/README.md.
"""
import sys
from pathlib import Path

# The recipes' package sits next to this folder; without `pip install .` it is found from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairseq_kd_recipes.prepare.scripts.wmt22_de_dsb import build_parser, cli_main, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(cli_main())
