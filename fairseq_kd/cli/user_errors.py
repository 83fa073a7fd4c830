"""One line, not a traceback, for every user error of the plugin's command-line tools.

``@exits_on_user_error("fairseq-kd-score")`` around a ``cli_main``: an error a user can fix (a
missing, unreadable or undecodable file, a folder where a file is expected, a bad value, an unsafe
checkpoint) is printed as ``PROG: error: MESSAGE`` on stderr and the command exits with status 2,
as argparse does for a bad flag. Programming errors keep their traceback.

:func:`require_path` (and :func:`path_problem`, its wording) is the one check of a path a flag
names: a folder given where a file is expected, a file where a folder is expected, or a file in
the way of an output folder is said as such, with the flag, instead of "no such file" or the
system's bare "Not a directory". It imports nothing beyond the standard library, so that library
code (the teacher, the export) words its own errors with it.

fairseq's own commands (``fairseq-train``, ``fairseq-generate``, ...) run the plugin inside their
``main``, which no decorator of ours wraps: :func:`install_for_fairseq_command` (called when
fairseq imports the plugin through ``--user-dir``) gives them the same one line for the plugin's
user errors, with Python's traceback for everything else, and for everything with
``FAIRSEQ_KD_TRACEBACK=1``.
"""
from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import io
import os
import sys
from pathlib import Path
from typing import Optional

#: what a flag's path must be, for :func:`path_problem`
FILE, FOLDER, OUTPUT_FILE, OUTPUT_FOLDER = "file", "folder", "output file", "output folder"

# ValueError and OSError, plus fairseq_kd.checkpoints.UnsafeCheckpointError (a RuntimeError),
# matched by name so that the scoring commands import neither torch nor fairseq.
USER_ERRORS = (ValueError, OSError)
USER_RUNTIME_ERRORS = ("UnsafeCheckpointError",)
# A missing optional dependency is the user's to install: the error names the fix.
USER_IMPORT_ERRORS = ("CTranslate2MissingError", "FairseqMissingError", "HuggingFaceMissingError")


class PathError(ValueError):
    """A path given to a flag is not what the flag expects (see :func:`require_path`)."""


def _file_in_the_way(path: Path) -> Optional[Path]:
    """The first existing ancestor of ``path`` (``path`` included) that is not a folder."""
    for ancestor in reversed((path, *path.parents)):
        if ancestor.exists() and not ancestor.is_dir():
            return ancestor
        if not ancestor.exists():
            return None
    return None


def path_problem(path, expected: str) -> Optional[str]:
    """Why ``path`` is not the ``expected`` kind of path (:data:`FILE`: an existing readable file;
    :data:`FOLDER`: an existing folder; :data:`OUTPUT_FILE` / :data:`OUTPUT_FOLDER`: absent or of
    that kind, with no file where a parent folder must be), in words for a message ("is a folder,
    not a file"); None when it is fine."""
    path = Path(path)
    if expected in (FILE, FOLDER):
        wanted_dir = expected == FOLDER
        if path.is_dir() != wanted_dir and path.exists():
            return "is a file, not a folder" if wanted_dir else "is a folder, not a file"
        if not path.exists():
            blocking = _file_in_the_way(path)
            if blocking is not None:
                return f"no such {expected}: {str(blocking)!r} is a file, not a folder"
            return f"no such {expected}"
        if not wanted_dir and not os.access(path, os.R_OK):
            return "the file is not readable (permissions)"
        return None
    if expected not in (OUTPUT_FILE, OUTPUT_FOLDER):
        raise ValueError(f"path_problem: unknown kind {expected!r}")
    if path.exists():
        if expected == OUTPUT_FOLDER and not path.is_dir():
            return "is a file, not a folder"
        if expected == OUTPUT_FILE and path.is_dir():
            return "is a folder, not a file"
        return None
    blocking = _file_in_the_way(path)
    return None if blocking is None else f"cannot be made: {str(blocking)!r} is a file, not a folder"


def require_path(path, flag: str, expected: str, hint: str = "") -> Path:
    """``path`` as a :class:`~pathlib.Path` if :func:`path_problem` finds nothing wrong; else
    :class:`PathError`: ``FLAG 'PATH': PROBLEM[; HINT]`` (the hint says what to give instead)."""
    problem = path_problem(path, expected)
    if problem is not None:
        raise PathError(f"{flag} {str(path)!r}: {problem}" + (f"; {hint}" if hint else ""))
    return Path(path)


def message_of(error: BaseException) -> str:
    if isinstance(error, UnicodeDecodeError):
        return undecodable_text_message(error)
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {_system_error_words(error)}"
    return str(error) or type(error).__name__


def undecodable_text_message(error: UnicodeDecodeError, path=None) -> str:
    """The file that is not UTF-8 (``path``, else the one being read where the error arose) and what
    to do: a text file in another encoding is converted; a binary file is the wrong file, or a
    damaged one, and is never to be converted."""
    path = str(path) if path is not None else _file_being_read(error)
    sample = bytes(error.object[:8192])
    if path is not None:
        with contextlib.suppress(OSError):
            with open(path, "rb") as file:
                sample = file.read(8192)
    byte = f"byte 0x{error.object[error.start]:02x}"
    what = f"{path} is" if path is not None else "a file read here is"
    if _looks_binary(sample):
        return f"{what} binary data, not UTF-8 text ({byte}): it is damaged or not the text file expected here"
    return (f"{what} not valid UTF-8 ({byte}); if it is text in another encoding, convert it to UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8)")


def _file_being_read(error: BaseException) -> Optional[str]:
    """The name of the open file (read, not written) nearest to where ``error`` was raised, among
    the local variables of the frames it passed through; None if there is none."""
    frames = []
    traceback = error.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, (io.IOBase, codecs.StreamReader, codecs.StreamReaderWriter)):
                name, mode = getattr(value, "name", None), str(getattr(value, "mode", "r"))
                if isinstance(name, (str, bytes)) and "r" in mode:
                    return os.fsdecode(name)
    return None


def _looks_binary(sample: bytes) -> bool:
    """Whether bytes are not text in any encoding: a NUL byte, or many control characters."""
    if b"\0" in sample:
        return True
    controls = sum(1 for byte in sample if byte < 32 and byte not in (9, 10, 12, 13))
    return controls > 0.05 * max(1, len(sample))


def _system_error_words(error: OSError) -> str:
    """The system's words for ``error``, but a file where a folder is expected (and the reverse)
    said as such, naming the file in the way, instead of "Not a directory"."""
    if error.errno == errno.ENOTDIR:
        blocking = _file_in_the_way(Path(error.filename))
        where = "" if blocking is None or str(blocking) == str(error.filename) else f"{str(blocking)!r} "
        return f"{where}is a file, not a folder (a folder is expected here)"
    if error.errno == errno.EISDIR:
        return "is a folder, not a file (a file is expected here)"
    return error.strerror


def exits_on_user_error(prog: str):
    def decorate(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except USER_ERRORS as error:
                sys.stderr.write(f"{prog}: error: {message_of(error)}\n")
                sys.exit(2)
            except (RuntimeError, ImportError) as error:
                if type(error).__name__ not in USER_RUNTIME_ERRORS + USER_IMPORT_ERRORS:
                    raise
                sys.stderr.write(f"{prog}: error: {message_of(error)}\n")
                sys.exit(2)
            except KeyboardInterrupt:
                sys.stderr.write(f"{prog}: interrupted\n")
                sys.exit(130)
        return wrapped
    return decorate


#: set to 1 to keep Python's traceback for the plugin's user errors under fairseq's commands
TRACEBACK_VARIABLE = "FAIRSEQ_KD_TRACEBACK"
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def _is_plugin_user_error(error: BaseException, traceback) -> bool:
    """Whether ``error`` is a user error (as :func:`exits_on_user_error` counts them) that the
    plugin raised: of one of the plugin's classes, or raised by a line of the plugin's code. A
    ValueError from deep inside torch or fairseq is not ours to word and keeps its traceback."""
    name = type(error).__name__
    user_kind = isinstance(error, USER_ERRORS) or name in USER_RUNTIME_ERRORS + USER_IMPORT_ERRORS
    if not user_kind:
        return False
    if type(error).__module__.startswith("fairseq_kd"):
        return True
    innermost = None
    while traceback is not None:
        innermost, traceback = traceback.tb_frame, traceback.tb_next
    return innermost is not None and os.path.abspath(innermost.f_code.co_filename).startswith(_PACKAGE_DIR)


def one_line(prog: str, error: BaseException) -> str:
    """The line a fairseq command prints for the plugin's user error (see
    :func:`install_for_fairseq_command`)."""
    return f"{prog}: error: {message_of(error)} [{TRACEBACK_VARIABLE}=1 shows the traceback]\n"


def fairseq_command_name(argv0: str) -> Optional[str]:
    """``fairseq-train`` for ``.../bin/fairseq-train`` or ``.../fairseq_cli/train.py``; None for
    any other program (the plugin's own commands word their errors themselves)."""
    path = Path(argv0)
    if path.name.startswith("fairseq-") and not path.name.startswith("fairseq-kd"):
        return path.name
    if path.parent.name == "fairseq_cli" and path.suffix == ".py":
        return "fairseq-" + path.stem.replace("_", "-")
    return None


def install_for_fairseq_command(argv0: Optional[str] = None) -> bool:
    """Under a fairseq command, print the plugin's user errors as ``PROG: error: MESSAGE`` (one
    line on stderr, exit status 1 as for any uncaught error) instead of a traceback ending in it:
    e.g. ``fairseq-train: error: --teacher-cache DIR: no finished cache there (...)``. Returns
    whether it was installed."""
    prog = fairseq_command_name(sys.argv[0] if argv0 is None else argv0)
    if prog is None or os.environ.get(TRACEBACK_VARIABLE) == "1":
        return False
    previous = sys.excepthook

    def one_line_for_user_errors(kind, error, traceback):
        if not _is_plugin_user_error(error, traceback):
            return previous(kind, error, traceback)
        sys.stdout.flush()
        sys.stderr.write(one_line(prog, error))
        sys.stderr.flush()

    sys.excepthook = one_line_for_user_errors
    return True
