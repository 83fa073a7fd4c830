"""Prepare Multi30k task 1 French-English (29K / 1,014 / 1,000 pairs) with joint subword-nmt BPE.

    python examples/translation/multi30k_fr_en/prepare.py
    python examples/translation/multi30k_fr_en/prepare.py --archives ../shared/data/multi30k-fr-en

Flags and steps: ``fairseq_kd_recipes.prepare.scripts.multi30k_fr_en``, which the recipes run (with
``python -m`` where the package is installed); see examples/translation/README.md.
"""
import sys
from pathlib import Path

# The recipes' package sits next to this folder; without `pip install .` it is found from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairseq_kd_recipes.prepare.scripts.multi30k_fr_en import build_parser, cli_main, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(cli_main())
