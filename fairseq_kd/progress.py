"""Progress messages and progress bars of the project's commands, on stderr. A bar is drawn only on
a terminal: a child whose stderr is a log file draws on its parent's terminal, whose descriptor the
parent passes (``FAIRSEQ_KD_PROGRESS_FD``, :func:`child_progress`); nothing of a bar reaches a log.
"""
import contextlib
import logging
import os
import sys
from typing import Callable, Dict, Iterable, Iterator, Optional, Tuple

#: the environment variable naming a terminal's file descriptor a parent process passed for bars
PROGRESS_FD_VARIABLE = "FAIRSEQ_KD_PROGRESS_FD"


@contextlib.contextmanager
def progress_to_stderr(logger_name: str, fmt: str = "%(asctime)s | %(message)s"):
    """Send ``logger_name``'s INFO messages (this logger only, not the root logger fairseq
    configures) to stderr for the duration of the block."""
    logger = logging.getLogger(logger_name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    previous = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


def stream_is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


_inherited_terminal = {}


def _inherited_progress_terminal():
    """The terminal a parent passed (``FAIRSEQ_KD_PROGRESS_FD``), opened once; None without one. A
    descriptor that is not a terminal (closed, or reused for a file by a grandchild that inherited
    the variable but not the descriptor) is ignored."""
    value = os.environ.get(PROGRESS_FD_VARIABLE, "")
    if not value.isdigit():
        return None
    fd = int(value)
    if fd not in _inherited_terminal:
        try:
            _inherited_terminal[fd] = os.fdopen(fd, "w", closefd=False) if os.isatty(fd) else None
        except OSError:
            _inherited_terminal[fd] = None
    return _inherited_terminal[fd]


def progress_stream():
    """Where bars go: stderr when it is a terminal, else the terminal a parent passed, else stderr
    (where the bar is then disabled)."""
    if stream_is_terminal(sys.stderr):
        return sys.stderr
    return _inherited_progress_terminal() or sys.stderr


@contextlib.contextmanager
def child_progress(stream=None) -> Iterator[Tuple[Dict[str, str], Tuple[int, ...]]]:
    """``(environment, pass_fds)`` for a child process whose output goes to a log file, so that its
    bars are drawn on ``stream`` (default: stderr) if a terminal: a copy of its descriptor, open
    for the block."""
    stream = sys.stderr if stream is None else stream
    env = {key: value for key, value in os.environ.items() if key != PROGRESS_FD_VARIABLE}
    try:
        fd = os.dup(stream.fileno()) if stream_is_terminal(stream) else None
    except (AttributeError, ValueError, OSError):  # a terminal without a descriptor (a test's fake)
        fd = None
    if fd is None:
        yield env, ()
        return
    env[PROGRESS_FD_VARIABLE] = str(fd)
    try:
        yield env, (fd,)
    finally:
        os.close(fd)


def progress_bar(total: Optional[int] = None, desc: Optional[str] = None, unit: str = "it",
                 iterable: Optional[Iterable] = None, stream=None, **options):
    """A tqdm progress bar on :func:`progress_stream` (or ``stream``), disabled when that is not a
    terminal; ``options`` go to tqdm."""
    from tqdm import tqdm

    stream = progress_stream() if stream is None else stream
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream,
                disable=not stream_is_terminal(stream), dynamic_ncols=True, mininterval=0.5,
                smoothing=0.1, **options)


def print_above_bars(log: Callable[[str], None]) -> Callable[[str], None]:
    """Wrap a line printer (``print`` to stdout) so that its lines appear above an active progress
    bar instead of through it when stdout and stderr are the same terminal."""
    def write(line: str) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stdout):
            log(line)
    return write
