"""Line-oriented text files as the preparation steps read and write them.

Lines are split on ``\\n`` only.  Python's default universal-newline mode would also split on a
lone ``\\r``, which some crawled corpora contain inside sentences, and shift one side of a
parallel corpus against the other; the Moses scripts and fairseq's shell recipes split on
``\\n`` only, and so do we.  Written files never contain ``\\r``: fairseq-preprocess reads in
universal-newline mode and would split such a line in two.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator


#: lines between two updates of a bar (an update per line would cost more than some steps' work)
BAR_STEP = 1024


def iter_lines(path: Path, progress: str | None = None) -> Iterator[str]:
    """Yield the lines of a UTF-8 file without their ``\\n``. ``progress``: the name of a bar of the
    lines read, with rate and time left, on a terminal only (the lines are counted first then)."""
    if progress is not None:
        yield from _iter_lines_with_bar(path, progress)
        return
    with open(path, encoding="utf-8", newline="\n") as handle:
        for line in handle:
            yield line[:-1] if line.endswith("\n") else line


def _iter_lines_with_bar(path: Path, desc: str) -> Iterator[str]:
    from fairseq_kd.progress import progress_bar, progress_stream, stream_is_terminal

    total = count_lines(path) if stream_is_terminal(progress_stream()) else None
    with progress_bar(total=total, desc=desc, unit="line", unit_scale=True, leave=False) as bar:
        for number, line in enumerate(iter_lines(path), start=1):
            yield line
            if number % BAR_STEP == 0:
                bar.update(BAR_STEP)
        bar.update(bar.total - bar.n if bar.total else 0)


def read_lines(path: Path) -> list[str]:
    """All lines of a UTF-8 file, without their ``\\n``."""
    return list(iter_lines(path))


def parallel_pairs(source_lines: Iterable[str], target_lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """``zip(source_lines, target_lines, strict=True)`` without Python 3.10: the pairs, lazily, then
    zip's own ``ValueError`` if one side ends before the other."""
    missing = object()
    for source, target in itertools.zip_longest(source_lines, target_lines, fillvalue=missing):
        if source is missing or target is missing:
            raise ValueError(f"zip() argument 2 is {'longer' if source is missing else 'shorter'} than argument 1")
        yield source, target


def normalize_whitespace(line: str) -> str:
    """Collapse every run of (Unicode) whitespace, ``\\r`` and tabs included, to one space."""
    return " ".join(line.split())


def write_lines(path: Path, lines: Iterable[str]) -> int:
    """Write ``lines`` one per line, atomically (a temporary file renamed into place).

    Returns the number of lines.  A line holding ``\\n`` or ``\\r`` is a bug upstream (it would
    misalign a parallel corpus), so it raises ``ValueError`` naming the file and line.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    count = 0
    try:
        with open(temporary, "w", encoding="utf-8", newline="\n") as handle:
            for count, line in enumerate(lines, start=1):
                if "\n" in line or "\r" in line:
                    raise ValueError(f"line {count} for {path} contains a line break: {line!r}")
                handle.write(line)
                handle.write("\n")
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    return count


def count_lines(path: Path) -> int:
    """Number of ``\\n``-terminated lines (plus a final unterminated one, if any)."""
    count = 0
    last = b"\n"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")
