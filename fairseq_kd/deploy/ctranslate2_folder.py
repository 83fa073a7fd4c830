"""A CTranslate2 model folder checked before anything decodes with it (:func:`check_ctranslate2_folder`,
called by every reader), so that a damaged folder is one line naming the file and what is wrong,
not CTranslate2's traceback. ``model.bin`` is walked as CTranslate2 reads it (binary version, spec
name and revision, then each variable's name, shape, type and bytes, then the aliases) without
reading the weights; a folder whose export record lists its files is also checked against their
recorded sizes and SHA-256."""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Optional

from ..errors import InputError
from .export_ctranslate2 import QUANTIZATIONS, RECORD_FORMAT, RECORD_NAME
from .model_folder import FILES_KEY, read_export_record, recorded_file_problem

MODEL_FILE, CONFIG_FILE = "model.bin", "config.json"
#: bytes per element of CTranslate2's type ids (float32, int8, int16, int32, float16, bfloat16)
TYPE_SIZES = (4, 1, 2, 4, 2, 2)
#: the binary version whose layout (type ids and byte counts, then aliases) is walked here, which
#: CTranslate2 3 and 4 write; older files are checked by CTranslate2 when it loads them
WALKED_VERSION = 6
#: the tokens CTranslate2 reads from a translation model's config.json as strings
CONFIG_STRINGS = ("unk_token", "bos_token", "eos_token", "decoder_start_token")
VOCABULARY_FILES = tuple(f"{side}_vocabulary.{suffix}" for side in ("source", "target", "shared")
                         for suffix in ("json", "txt"))


class DamagedFolderError(InputError):
    """A file of a CTranslate2 model folder is missing or damaged (the message names it)."""


def looks_like_ctranslate2_folder(folder) -> bool:
    """Whether ``folder`` is meant as a CTranslate2 model (a ``model.bin``, a CTranslate2
    vocabulary file or a CTranslate2 export record), whatever state its files are in; a Hugging
    Face folder has none of these."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    if (folder / MODEL_FILE).exists() or any((folder / name).exists() for name in VOCABULARY_FILES):
        return True
    try:
        return read_export_record(folder, RECORD_NAME).get("format") == RECORD_FORMAT
    except (OSError, ValueError):
        return False


def check_ctranslate2_folder(folder) -> None:
    """:class:`DamagedFolderError` naming the first missing or damaged file of the CTranslate2
    model folder ``folder`` (an existing folder); nothing when CTranslate2 can read every file."""
    folder = Path(folder)
    record = {}
    if os.path.lexists(folder / RECORD_NAME):
        try:
            record = read_export_record(folder, RECORD_NAME)
        except (OSError, ValueError) as err:
            raise DamagedFolderError(str(err)) from None
    for check in (_model_file_problem, _config_problem, _vocabulary_problem):
        problem = check(folder)
        if problem is not None:
            raise DamagedFolderError(problem)
    files = record.get(FILES_KEY) or {}
    if not isinstance(files, dict):
        raise DamagedFolderError(f"{str(folder / RECORD_NAME)!r} is damaged: its {FILES_KEY!r} is not a mapping")
    for name, entry in sorted(files.items()):
        problem = recorded_file_problem(folder, name, entry)
        if problem is not None:
            raise DamagedFolderError(f"{str(folder / name)!r} {problem}")


def _model_file_problem(folder: Path) -> Optional[str]:
    path = folder / MODEL_FILE
    if not path.is_file():
        return f"{str(path)!r} is missing" if not path.exists() else f"{str(path)!r} is not a file"
    problem = model_bin_problem(path)
    return None if problem is None else f"{str(path)!r} {problem}"


def model_bin_problem(path: Path) -> Optional[str]:
    """Why the file ``path`` is not a whole CTranslate2 ``model.bin``, in words after its name."""
    from ctranslate2.specs.model_spec import CURRENT_BINARY_VERSION as newest_readable

    size = path.stat().st_size
    if size == 0:
        return "is empty"
    with open(path, "rb") as model:
        def take(fmt: str, what: str):
            wanted = struct.calcsize(fmt)
            raw = model.read(wanted)
            if len(raw) < wanted:
                raise _Unreadable(f"is truncated ({size} bytes): it ends inside {what}")
            return struct.unpack(fmt, raw)

        def string(what: str) -> str:
            (length,) = take("<H", what)
            raw = model.read(length)
            if len(raw) < length:
                raise _Unreadable(f"is truncated ({size} bytes): it ends inside {what}")
            if length == 0 or raw[-1:] != b"\0":
                raise _Unreadable(f"is damaged: {what} is not a terminated string")
            try:
                return raw[:-1].decode("utf-8")
            except UnicodeDecodeError:
                raise _Unreadable(f"is damaged: {what} is not UTF-8 text") from None

        try:
            (version,) = take("<I", "its header")
            if version == 0 or version > 1000:
                return f"is not a CTranslate2 model file (its header's binary version is {version})"
            if version > newest_readable:
                return (f"was written by a newer CTranslate2 (binary version {version}; this one reads up to "
                        f"{newest_readable}): upgrade ctranslate2")
            if version != WALKED_VERSION:
                return None
            spec = string("its header (the model's spec name)")
            if not spec.isidentifier():
                return f"is damaged: its header names the spec {spec!r}"
            take("<I", "its header")
            (count,) = take("<I", "its header")
            for index in range(count):
                name = string(f"the name of variable {index + 1} of {count}")
                (rank,) = take("<B", f"variable {name!r}")
                shape = take(f"<{rank}I", f"variable {name!r}")
                type_id, payload = take("<BI", f"variable {name!r}")
                if type_id >= len(TYPE_SIZES):
                    return f"is damaged: variable {name!r} has the unknown type id {type_id}"
                elements = math.prod(shape)
                if payload != elements * TYPE_SIZES[type_id]:
                    return (f"is damaged: variable {name!r} of shape {list(shape)} holds {payload} bytes, "
                            f"not {elements * TYPE_SIZES[type_id]}")
                remaining = size - model.tell()
                if payload > remaining:
                    return (f"is truncated ({size} bytes): variable {name!r} needs {payload} bytes, "
                            f"{remaining} remain")
                model.seek(payload, 1)
            (aliases,) = take("<I", "its list of aliases")
            for index in range(aliases):
                string(f"alias {index + 1} of {aliases}")
                string(f"alias {index + 1} of {aliases}")
        except _Unreadable as problem:
            return str(problem)
        extra = size - model.tell()
    if extra:
        return f"is damaged: {extra} bytes follow its last entry"
    return None


class _Unreadable(Exception):
    """model_bin_problem's way out of a read that finds the file truncated or damaged."""


def _config_problem(folder: Path) -> Optional[str]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return (f"{str(path)!r} is missing (CTranslate2 reads the model's tokens from it)" if not path.exists()
                else f"{str(path)!r} is not a file")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return f"{str(path)!r} is not UTF-8 text (damaged)"
    except ValueError as err:
        return f"{str(path)!r} is not valid JSON ({'empty' if not path.stat().st_size else err})"
    if not isinstance(config, dict):
        return f"{str(path)!r} holds a JSON {type(config).__name__}, not CTranslate2's model configuration"
    wrong = [key for key in CONFIG_STRINGS if key in config and not isinstance(config[key], str)]
    if wrong:
        return f"{str(path)!r}: {', '.join(wrong)} must be strings (token symbols)"
    return None


def _vocabulary_problem(folder: Path) -> Optional[str]:
    for name in VOCABULARY_FILES:
        if (folder / name).is_file():
            try:
                read_vocabulary(folder / name)
            except DamagedFolderError as err:
                return str(err)
    return None


def read_vocabulary(path: Path) -> list:
    """The tokens of a CTranslate2 vocabulary file (``.json``: a list; ``.txt``: one a line);
    :class:`DamagedFolderError` naming the file when it is not one."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise DamagedFolderError(f"{str(path)!r} is not UTF-8 text (damaged)") from None
    if path.suffix != ".json":
        return text.split("\n")[:-1]
    try:
        tokens = json.loads(text)
    except ValueError as err:
        raise DamagedFolderError(f"{str(path)!r} is not valid JSON ({'empty' if not text else err})") from None
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise DamagedFolderError(f"{str(path)!r} is not a list of tokens")
    return tokens


def reexport_advice(folder) -> str:
    """What to do about a damaged folder: the export command, with the checkpoint and weight type
    its record names where it can be read."""
    try:
        record = read_export_record(Path(folder), RECORD_NAME)
    except (OSError, ValueError):
        record = {}
    checkpoint, quantization = record.get("checkpoint"), record.get("quantization")
    if not isinstance(checkpoint, str) or not checkpoint.isprintable():  # the message stays one line
        checkpoint = "CHECKPOINT"
    command = (f"fairseq-kd-export {checkpoint} NEW_FOLDER --format ctranslate2"
               + (f" --quantization {quantization}" if quantization in QUANTIZATIONS else ""))
    return f"re-export the model into a new folder ({command})"
