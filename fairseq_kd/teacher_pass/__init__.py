"""Offline passes of the frozen teacher over a binarised split: sequence-level KD data
(:mod:`.seqkd`, ``fairseq-kd-seqkd``) and the top-k teacher cache (:mod:`.teacher_cache`,
``fairseq-kd-teacher-cache``); what they share is :mod:`.common`."""
