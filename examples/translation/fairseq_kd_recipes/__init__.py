"""Recipes and corpus preparation for the translation examples: one command per language pair that
prepares the corpus, trains the teacher and the students of every distillation method, decodes the
test set, scores it and writes the report. None of this registers with fairseq, so it lives beside
the recipes it serves, outside the plugin package that ``--user-dir fairseq_kd`` imports.

* ``prepare``: download, extraction, tokenisation, subword segmentation, binarisation, and the step
  runner (``prepare.pipeline``) that every resumable step of preparation and recipes goes through;
* ``methods``: the one table of distillation methods (recipes, the benchmark and the README's flag
  table are derived from it);
* ``pairs``: the per-pair settings from the papers; ``profiles``: where and how long models train;
* ``plan`` lays out a recipe's steps, ``execute`` runs them, ``results`` collects parameter counts
  and decoding speeds; ``recipe`` is the command line (``fairseq-kd-recipe``, wrapped by
  ``examples/translation/<pair>/run.sh``);
* ``benchmark``: step time and memory of every method (a developer tool, ``python -m
  fairseq_kd_recipes.benchmark``).

``pip install .`` installs this package as ``fairseq_kd_recipes`` (pyproject.toml maps it here); in
a checkout without that, the entry scripts put ``examples/translation`` on the path themselves.
"""
