"""Joint byte-pair encoding with subword-nmt (Sennrich et al., 2016) through its Python API.

:func:`learn_joint_bpe` is ``cat TRAIN.src TRAIN.tgt | subword-nmt learn-bpe -s MERGES``: the merge
operations are learned on the concatenation of both languages (source first, as fairseq's
recipes concatenate them), so the two sides share one subword vocabulary.
:func:`apply_bpe_file` is ``subword-nmt apply-bpe -c CODES`` with the default ``@@`` separator.
"""
from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from .errors import PrepareError
from .parallel import map_lines
from .textio import iter_lines, write_lines


def learn_joint_bpe(train_files: Sequence[Path], codes_path: Path, merges: int, min_frequency: int = 2) -> None:
    """Learn ``merges`` merge operations from the concatenation of ``train_files``."""
    if merges < 1:
        raise PrepareError(f"--bpe-merges must be >= 1, got {merges}")
    codes_path = Path(codes_path)
    codes_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = codes_path.with_name(codes_path.name + ".tmp")
    handles = [open(path, encoding="utf-8", newline="\n") for path in train_files]
    try:
        with open(temporary, "w", encoding="utf-8") as out:
            learn_bpe(itertools.chain(*handles), out, merges, min_frequency=min_frequency)
        os.replace(temporary, codes_path)
    finally:
        for handle in handles:
            handle.close()
        temporary.unlink(missing_ok=True)


class BpeSegmenter:
    """Segments one tokenised line per call with the merges of a codes file (``@@`` separator)."""

    def __init__(self, codes_path: Path) -> None:
        with open(codes_path, encoding="utf-8") as codes:
            self._bpe = BPE(codes)

    def __call__(self, line: str) -> str:
        return self._bpe.process_line(line)


def apply_bpe_lines(codes_path: Path, lines: Iterable[str], workers: int = 1) -> Iterator[str]:
    """Segment already tokenised ``lines`` with the merges in ``codes_path``, in order."""
    return map_lines(lines, functools.partial(BpeSegmenter, codes_path), workers)


def apply_bpe_file(codes_path: Path, source: Path, destination: Path, workers: int = 1) -> int:
    """Segment every line of ``source`` into ``destination``; return the number of lines."""
    return write_lines(destination, apply_bpe_lines(codes_path, iter_lines(source), workers))
