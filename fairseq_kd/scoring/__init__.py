"""Scoring and reporting: detokenisation, sacreBLEU with bootstrap intervals and paired
significance, paper-style result tables (the figures are in :mod:`fairseq_kd.figures`).

Deliberately free of torch and fairseq imports so that scoring runs fast and on machines without
the training stack; import the submodules (``fairseq_kd.scoring.bleu`` and so on) directly.
"""
