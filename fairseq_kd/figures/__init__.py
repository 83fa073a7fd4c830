"""The project's figures (:mod:`.draw`) and the training logs they are drawn from (:mod:`.training_log`),
for ``fairseq-kd-plot``. Imports neither torch nor fairseq; import the submodules directly.
"""
