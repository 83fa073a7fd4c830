"""Input files of the scoring commands: a path that is not a readable file said as such
(:func:`fairseq_kd.errors.require_path`), the file's name in every UTF-8 decoding error, and JSON
inputs read with both."""
from __future__ import annotations

import json
from contextlib import contextmanager

from ..errors import FILE, InputError, require_path, undecodable_text_message


class UndecodableFileError(InputError):
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
    path = require_path(path, what, FILE)
    try:
        with naming_decode_errors(path, what), open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise InputError(f"{what} {path}: not valid JSON ({error})") from None
