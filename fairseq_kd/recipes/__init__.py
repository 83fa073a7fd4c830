"""Recipes: one command per language pair that prepares the corpus, trains the teacher and the
students of every distillation method, decodes the test set, scores it and writes the report.

``methods`` defines the methods once, ``pairs`` the per-pair settings from the papers, ``profiles``
where and how long models train, ``runner`` the steps. Entry point: ``fairseq-kd-recipe``
(:mod:`fairseq_kd.cli.recipe`), wrapped by ``examples/translation/<pair>/run.sh``.
"""
