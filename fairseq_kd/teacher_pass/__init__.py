"""Offline passes of the frozen teacher over a binarised split: sequence-level KD data
(:mod:`.seqkd`, ``fairseq-kd-seqkd``) and the top-k teacher cache (:mod:`.teacher_cache`,
``fairseq-kd-teacher-cache``; training reads it through :mod:`fairseq_kd.data.teacher_cache_reader`,
importing nothing of this package). What they share (set-up, shards, the resumable record,
workers, progress) is :mod:`.common`.
"""
