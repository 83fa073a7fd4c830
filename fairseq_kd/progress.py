"""Progress messages and progress bars of the project's commands, on stderr."""
import contextlib
import logging
import sys
from typing import Callable, Iterable, Optional


@contextlib.contextmanager
def progress_to_stderr(logger_name: str, fmt: str = "%(asctime)s | %(message)s"):
    """Send ``logger_name``'s INFO messages to stderr for the duration of the block.

    Only this logger is configured, and restored afterwards, so that importing fairseq (which
    configures the root logger) neither duplicates nor swallows the messages.
    """
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


def progress_bar(total: Optional[int] = None, desc: Optional[str] = None, unit: str = "it",
                 iterable: Optional[Iterable] = None, stream=None):
    """A tqdm progress bar (count, rate and time left, as fairseq-generate's) on stderr, or on
    ``stream``; disabled, so that it prints nothing, when that stream is not a terminal (a log file,
    a pipe, a test's captured output). Use it as a context manager or close it; call ``update(n)``.
    """
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream,
                disable=not stream_is_terminal(stream), dynamic_ncols=True, mininterval=0.5,
                smoothing=0.1)


def print_above_bars(log: Callable[[str], None]) -> Callable[[str], None]:
    """Wrap a line printer (``print`` to stdout) so that its lines appear above an active progress
    bar instead of through it when stdout and stderr are the same terminal."""
    def write(line: str) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stdout):
            log(line)
    return write
