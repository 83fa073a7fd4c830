"""Progress messages of the project's commands on stderr."""
import contextlib
import logging
import sys


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
