"""The project's figures and what they are drawn from: :mod:`.training_log` reads fairseq training
logs into records (no matplotlib), :mod:`.draw` draws the figures (matplotlib's object-oriented
API). ``fairseq-kd-plot`` (:mod:`fairseq_kd.cli.plot`) is the command.

Imports neither torch nor fairseq; import the submodules directly.
"""
