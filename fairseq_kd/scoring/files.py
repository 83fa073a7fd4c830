"""Input files of the scoring commands: a clear message for a folder given where a file is
expected, the file's name in every UTF-8 decoding error, and JSON inputs read with both."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path


def not_a_file(path) -> str:
    """Why ``path`` is not a readable file, for messages: '... is a folder ...' or 'does not exist'."""
    path = Path(path)
    if path.is_dir():
        return "is a folder, not a file: give the path of a file (e.g. one inside it)"
    return "does not exist"


class UndecodableFileError(ValueError):
    """A text input is not valid UTF-8."""


@contextmanager
def naming_decode_errors(path, what: str = "file"):
    """Re-raise a ``UnicodeDecodeError`` met while reading ``path`` with the file named."""
    try:
        yield
    except UnicodeDecodeError as error:
        # the one wording of an undecodable file: conversion advised for text, never for binary data
        from ..cli.user_errors import undecodable_text_message

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
