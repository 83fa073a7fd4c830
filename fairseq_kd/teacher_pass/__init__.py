"""Offline passes of the frozen teacher over a binarised split: sequence-level KD data
(:mod:`.seqkd`, ``fairseq-kd-seqkd``) and the top-k teacher cache (:mod:`.teacher_cache`,
``fairseq-kd-teacher-cache``; read back by training with ``--teacher-cache``). What they share
(set-up, shards, the resumable record, progress) is :mod:`.common`.
"""
