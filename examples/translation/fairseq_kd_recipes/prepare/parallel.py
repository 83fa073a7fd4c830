"""Order-preserving, streaming line processing over worker processes.

Tokenising or segmenting millions of lines is CPU-bound; :func:`map_lines` sends chunks of lines
to ``workers`` processes and yields the results in input order, holding only a few chunks in
memory at a time.  The per-line function is built once per worker by ``make_function`` (a
picklable callable, e.g. a class taking a config), so heavy objects such as a tokenizer or a BPE
table are constructed in each worker rather than shipped with every chunk.
"""
from __future__ import annotations

import itertools
import multiprocessing
from typing import Callable, Iterable, Iterator

_FUNCTION: Callable[[str], str] | None = None


def _init(make_function: Callable[[], Callable[[str], str]]) -> None:
    global _FUNCTION
    _FUNCTION = make_function()


def _run(chunk: list[str]) -> list[str]:
    return [_FUNCTION(line) for line in chunk]


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def map_lines(
    lines: Iterable[str],
    make_function: Callable[[], Callable[[str], str]],
    workers: int = 1,
    chunk_size: int = 2000,
) -> Iterator[str]:
    """Yield ``function(line)`` for every line, in order, where ``function = make_function()``."""
    if workers <= 1:
        function = make_function()
        for line in lines:
            yield function(line)
        return
    context = multiprocessing.get_context("fork")
    chunks = _chunks(lines, chunk_size)
    with context.Pool(workers, initializer=_init, initargs=(make_function,)) as pool:
        # Pool.imap would drain the whole input into its task queue; feeding a bounded batch
        # at a time keeps memory proportional to workers x chunk_size.
        while batch := list(itertools.islice(chunks, 4 * workers)):
            for processed in pool.imap(_run, batch):
                yield from processed
