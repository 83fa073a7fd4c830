"""The plugin's user errors: every error raised because of its input is a :class:`UserError`, which
the commands print as one line (:mod:`fairseq_kd.cli.user_errors`), each kind also the built-in
exception a caller expects. :func:`require_path` is the one check of a path a flag names and
:func:`undecodable_text_message` the one wording of a file that is not UTF-8. Standard library only.
"""
from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
from pathlib import Path
from typing import Optional


class UserError(Exception):
    """An error the user can fix: a command prints its message as one line, no traceback."""


class InputError(UserError, ValueError):
    """A value, a flag or a file's content is not what the plugin can work with."""


class PathError(InputError):
    """A path given to a flag is not what the flag expects (see :func:`require_path`)."""


class FileAccessError(UserError, OSError):
    """A file or folder the user named cannot be read or written (the system's reason)."""


class MissingDependencyError(UserError, ImportError):
    """An optional package a feature needs is not installed; the message names the install."""


#: what a flag's path must be, for :func:`path_problem`
FILE, FOLDER, OUTPUT_FILE, OUTPUT_FOLDER = "file", "folder", "output file", "output folder"


def _file_in_the_way(path: Path) -> Optional[Path]:
    """The first existing ancestor of ``path`` (``path`` included) that is not a folder."""
    for ancestor in reversed((path, *path.parents)):
        if ancestor.exists() and not ancestor.is_dir():
            return ancestor
        if not ancestor.exists():
            return None
    return None


def path_problem(path, expected: str) -> Optional[str]:
    """Why ``path`` is not the ``expected`` kind (an existing readable file or folder; an output: absent
    or of that kind, with no file where a parent folder must be), in words; None when it is fine."""
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
