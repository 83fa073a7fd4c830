"""Input files of the scoring commands: a clear message for a folder given where a file is
expected, the file's name in every UTF-8 decoding error, and JSON inputs read with both."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from ..errors import not_a_file, undecodable_text_message


class UndecodableFileError(ValueError):
    """A text input is not valid UTF-8."""


@contextmanager
def naming_decode_errors(path, what: str = "file"):
    """Re-raise a ``UnicodeDecodeError`` met while reading ``path`` with the file named."""
    try:
        yield
    except UnicodeDecodeError as error:
        raise UndecodableFileError(f"{what}: {undecodable_text_message(error, path)}") from None


def load_json(path, what: str):
    """The JSON content of ``path``; ``what`` names the file in errors (e.g. ``"--sidecar file"``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} {not_a_file(path)}")
    try:
        with naming_decode_errors(path, what), open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {path}: not valid JSON ({error})") from None
