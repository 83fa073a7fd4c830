"""Deprecated alias of ``fairseq-kd-recipe`` (``python -m fairseq_kd_recipes.recipe``): the recipes
moved to ``examples/translation/fairseq_kd_recipes``. Kept so that ``python -m fairseq_kd.cli.recipe``
still works in a checkout; nothing in the plugin imports it."""
import sys
from pathlib import Path

try:
    from fairseq_kd_recipes.recipe import cli_main
except ImportError:  # a checkout without `pip install .`: the package sits in examples/translation
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "translation"))
    from fairseq_kd_recipes.recipe import cli_main

if __name__ == "__main__":
    sys.exit(cli_main())
