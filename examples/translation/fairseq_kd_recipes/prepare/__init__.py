"""Corpus preparation: download, extraction, tokenisation, subword segmentation, binarisation.

The building blocks live in one module each (``download``, ``archive``, ``iwslt``, ``tokenize``,
``bpe``, ``spm``, ``binarize``, ``pipeline``, with ``textio`` and ``parallel`` for line-oriented
files and worker processes); ``corpora`` strings them together per corpus, and the commands in
``scripts`` (one per ``examples/translation/<corpus>/`` folder, whose ``prepare.py`` imports it;
the recipes run it with ``python -m``) only parse flags (``arguments``) and call a corpus function.  Every step records what it consumed in a stamp file, so re-running a command resumes
where it stopped and skips what is already done.
"""
from .errors import PrepareError

__all__ = ["PrepareError"]
