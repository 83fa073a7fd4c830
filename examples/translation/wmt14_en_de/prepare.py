"""Prepare WMT'14 English-German as in Vaswani et al. (2017): newstest2013 valid, newstest2014 test, joint BPE.

    python examples/translation/wmt14_en_de/prepare.py --workers 8
    python examples/translation/wmt14_en_de/prepare.py --archives ~/corpora/wmt14

Flags and steps: ``fairseq_kd_recipes.prepare.scripts.wmt14_en_de``, which the recipes run (with
``python -m`` where the package is installed); see examples/translation/README.md.
"""
import sys
from pathlib import Path

# The recipes' package sits next to this folder; without `pip install .` it is found from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairseq_kd_recipes.prepare.scripts.wmt14_en_de import build_parser, cli_main, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(cli_main())
