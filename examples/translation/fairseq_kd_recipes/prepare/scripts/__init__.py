"""The preparation commands, one module per ``examples/translation/<corpus>/`` folder: its flags and
the corpus function it calls. They live in the package so that an installed ``fairseq_kd_recipes``
(``pip install .``, which installs no ``examples/`` folder) prepares every corpus with
``python -m fairseq_kd_recipes.prepare.scripts.<corpus>``, which is what the recipes run; the
``prepare.py`` scripts of a checkout import the same module.
"""
