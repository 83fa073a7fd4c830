"""Joint byte-pair encoding with subword-nmt (Sennrich et al., 2016) through its Python API.

:func:`learn_joint_bpe` is ``cat TRAIN.src TRAIN.tgt | subword-nmt learn-bpe -s MERGES``: the merge
operations are learned on the concatenation of both languages (source first, as fairseq's
recipes concatenate them), so the two sides share one subword vocabulary.
:func:`apply_bpe_file` is ``subword-nmt apply-bpe -c CODES`` with the default ``@@`` separator.
Both show a bar (merges, lines) on a terminal only: subword-nmt's own bar, which it writes to stderr
even when that is a log file, is replaced by ours while it learns.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import subword_nmt.learn_bpe as subword_nmt_learn_bpe
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from fairseq_kd.progress import progress_bar

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
        with open(temporary, "w", encoding="utf-8") as out, _merges_bar():
            learn_bpe(itertools.chain(*handles), out, merges, min_frequency=min_frequency)
        os.replace(temporary, codes_path)
    finally:
        for handle in handles:
            handle.close()
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def _merges_bar():
    """subword-nmt's ``tqdm`` (module attribute of ``subword_nmt.learn_bpe``) replaced by our bar
    while it learns: theirs writes carriage-return lines to stderr wherever it goes."""
    original = subword_nmt_learn_bpe.tqdm
    bars = []

    def bar(iterable, *args, **kwargs):
        bars.append(progress_bar(iterable=iterable, desc="learn BPE merges", unit="merge"))
        return bars[-1]

    subword_nmt_learn_bpe.tqdm = bar
    try:
        yield
    finally:
        subword_nmt_learn_bpe.tqdm = original
        for made in bars:  # learning stops early when no pair is frequent enough
            made.close()


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
    lines = iter_lines(source, progress=f"apply BPE {Path(source).name}")
    return write_lines(destination, apply_bpe_lines(codes_path, lines, workers))
