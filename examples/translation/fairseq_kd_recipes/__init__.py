"""Recipes and corpus preparation for the translation examples: one command per language pair that
prepares the corpus, trains the teacher and the students of every distillation method, decodes the
test set, scores it and writes the report. None of this registers with fairseq, so it lives beside
the recipes it serves, outside the plugin package that ``--user-dir fairseq_kd`` imports.

Design notes: ``docs/design/recipes.md``.
"""
