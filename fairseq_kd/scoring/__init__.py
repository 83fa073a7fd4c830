"""Scoring and reporting: detokenisation, sacreBLEU with bootstrap intervals and paired
significance, paper-style result tables. Free of torch and fairseq imports, so that scoring runs
fast and without the training stack; import the submodules directly.
"""
