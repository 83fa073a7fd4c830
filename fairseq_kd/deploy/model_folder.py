"""The folder an export writes (``--format ctranslate2``, ``--format hf``): checked before any work,
built under a staging name beside it and renamed into place, so that a failed or killed export
leaves the output as it was. Every export lists its files (name, size, SHA-256) in its record;
``--overwrite`` replaces only a folder that is wholly an unchanged earlier export of the same
format, anything else is refused in one line with nothing touched (docs/design/deploy.md)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Dict, Iterator, Optional, Type

from ..errors import OUTPUT_FOLDER, FileAccessError, InputError, message_of, path_problem
from ..fingerprint import file_sha256

#: the key of an export record that lists the export's files: {relative path: {"bytes", "sha256"}}
FILES_KEY = "files"


def file_inventory(folder: Path, record_name: str) -> Dict[str, dict]:
    """{relative path: {"bytes": size, "sha256": digest}} of every file under ``folder`` but the
    record itself, for the record (what ``--overwrite`` and the readers check against)."""
    inventory = {}
    for path in sorted(Path(folder).rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name != record_name:
            inventory[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return inventory


def recorded_file_problem(folder: Path, name: str, entry) -> Optional[str]:
    """Why the file ``name`` of ``folder`` is not the one its record lists as ``entry`` (absent, of
    another size or content), in words after the file's name; None when it is that file."""
    path = Path(folder) / name
    if not isinstance(entry, dict) or Path(name).is_absolute() or ".." in Path(name).parts:
        return "has a damaged entry in the export's record"
    if not path.is_file():
        return "is missing (the export wrote it)" if not os.path.lexists(path) else "is not a file"
    try:
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"has {size} bytes, the export wrote {entry.get('bytes')}"
        if file_sha256(path) != entry.get("sha256"):
            return "differs from what the export wrote (its SHA-256 is not the recorded one)"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def read_export_record(folder: Path, record_name: str) -> dict:
    """The export record of ``folder`` as a dict; InputError naming the file when it is not one."""
    path = Path(folder) / record_name
    if not path.is_file():
        raise InputError(f"{str(path)!r} is not a file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise FileAccessError(message_of(err)) from None
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{str(path)!r} is not UTF-8 text (damaged)") from None
    except ValueError as err:
        raise InputError(f"{str(path)!r} is not valid JSON ({err if raw.strip() else 'empty'})") from None
    if not isinstance(record, dict):
        raise InputError(f"{str(path)!r} holds a JSON {type(record).__name__}, not an export record")
    return record


def earlier_export_problem(folder: Path, record_name: str, record_format: str) -> Optional[str]:
    """Why ``folder`` is not wholly an earlier export of ``record_format`` (what is in the way, in
    words after the folder's name); None when ``--overwrite`` may replace it."""
    record_path = folder / record_name
    if record_path.is_symlink() or not record_path.is_file():
        return f"holds no {record_name} (every fairseq-kd export writes one)"
    try:
        record = read_export_record(folder, record_name)
    except (OSError, ValueError) as err:
        return f"has a damaged record: {err}"
    if record.get("format") != record_format:
        return f"is not an export of this format (its {record_name} says {record.get('format')!r})"
    files = record.get(FILES_KEY)
    if not isinstance(files, dict):
        return f"has a {record_name} that lists no files"
    try:
        return _unlisted_file(folder, record_name, files)
    except OSError as err:
        return f"holds {err.filename!r}, which cannot be read ({err.strerror or err})"


def _raise(error: OSError):
    raise error


def _unlisted_file(folder: Path, record_name: str, files: dict) -> Optional[str]:
    """What in ``folder`` is not a file of ``files`` as recorded (see :func:`earlier_export_problem`)."""
    # os.walk follows no links; a folder it cannot list is in the way, not skipped
    for root, folders, names in os.walk(folder, onerror=_raise):
        for name in sorted(folders) + sorted(names):
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                return f"holds {relative!r}, a symbolic link, which no export writes"
            if stat.S_ISDIR(mode):
                if not any(listed.startswith(relative + "/") for listed in files):
                    return f"holds the folder {relative!r}, which the export did not write"
                continue
            if relative == record_name:
                continue
            if not stat.S_ISREG(mode):
                return f"holds {relative!r}, which is not a regular file"
            if relative not in files:
                return f"holds {relative!r}, which the export did not write (not in its {record_name})"
            problem = recorded_file_problem(folder, relative, files[relative])
            if problem is not None:
                return f"holds {relative!r}, which {problem}"
    return None


class ExportFolder:
    """The output folder of one export: :meth:`check` before any work, :meth:`staged` to write it."""

    def __init__(self, checkpoint: str, output: str, overwrite: bool, *, kind: str, record_name: str,
                 record_format: str, error: Type[Exception]):
        self.checkpoint, self.output, self.path, self.overwrite = checkpoint, output, Path(output), overwrite
        self.kind, self.record_name, self.record_format, self.error = kind, record_name, record_format, error

    def check(self) -> Path:
        """The output as a Path, or ``error`` in one line before anything is touched."""
        out = self.path
        if out.name in ("", ".."):  # "." or "..": the folder would be renamed from inside itself
            raise self.error(f"output {self.output!r}: give the folder by its name (e.g. ../NAME)")
        if out.is_symlink():
            raise self.error(f"output {self.output!r} is a symbolic link (to {os.readlink(out)!r}); give a real "
                             "folder path: the export neither writes through a link nor replaces it")
        if out.exists() and not out.is_dir():
            raise self.error(f"output {self.output!r} is a file; a {self.kind} model is a folder: give a new "
                             "folder path")
        problem = path_problem(out, OUTPUT_FOLDER)
        if problem is not None:
            raise self.error(f"output {self.output!r}: {problem}")
        resolved, checkpoint_path = out.resolve(), Path(self.checkpoint).resolve()
        if resolved == checkpoint_path or resolved in checkpoint_path.parents:  # is_relative_to, Python >= 3.9
            raise self.error(f"output {self.output!r} holds the input checkpoint; choose another folder "
                             "(the export never replaces its input)")
        problem = self.replacement_problem(out)
        if problem is not None:
            raise self.error(problem)
        writable = next(folder for folder in (out, *out.parents) if folder.exists())
        if not os.access(writable, os.W_OK | os.X_OK) or (out.exists() and not os.access(out.parent, os.W_OK)):
            raise self.error(f"output {self.output!r}: {str(writable)!r} is not writable (permissions)")
        return out

    def replacement_problem(self, folder: Path) -> Optional[str]:
        """The one-line refusal for writing the export where ``folder`` is (``folder`` is the output,
        or the output already moved aside), or None when it is absent, empty, or an earlier export
        of this format that ``--overwrite`` may replace."""
        if not os.path.lexists(folder):
            return None
        if folder.is_symlink() or not folder.is_dir():
            return f"output {self.output!r} is no longer a folder; nothing was written"
        if not any(folder.iterdir()):
            return None
        if not self.overwrite:
            return f"output {self.output!r} already exists and is not empty; choose another folder or pass --overwrite"
        problem = earlier_export_problem(folder, self.record_name, self.record_format)
        if problem is None:
            return None
        return (f"output {self.output!r} {problem}; --overwrite replaces only a folder that is wholly an unchanged "
                f"{self.kind} export: choose another folder (nothing was touched)")

    @contextlib.contextmanager
    def staged(self) -> Iterator[Path]:
        """A staging folder to write the export into; once the block ends without an error it
        becomes the output. An existing output is checked again (under a name of its own, so that
        nothing written to it since :meth:`check` is lost), swapped out, then deleted. Whatever
        happens, no staging folder, moved-aside output or folder made for the output is left."""
        out = self.path
        with parent_folders(out):
            staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
            try:
                yield staging
                if out.is_symlink():
                    raise self.error(f"output {self.output!r} became a symbolic link during the export; nothing "
                                     "was written")
                if not os.path.lexists(out):
                    os.replace(staging, out)
                else:
                    retired = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
                    os.replace(out, retired)
                    try:
                        problem = self.replacement_problem(retired)
                        if problem is not None:
                            raise self.error(problem)
                        os.replace(staging, out)
                    except BaseException:
                        os.replace(retired, out)
                        raise
                    try:
                        shutil.rmtree(retired, ignore_errors=True)
                    finally:  # interrupted while deleting: delete the rest before stopping
                        if os.path.lexists(retired):
                            shutil.rmtree(retired, ignore_errors=True)
                    if os.path.lexists(retired):
                        raise self.error(f"output {self.output!r} was written, but the earlier export it replaced "
                                         f"could not be deleted: remove {retired}")
            finally:
                if os.path.lexists(staging):
                    shutil.rmtree(staging, ignore_errors=True)

    def write_record(self, staging: Path, record: dict) -> None:
        """Write ``record`` as the export's record, listing the staging folder's files last."""
        record[FILES_KEY] = file_inventory(staging, self.record_name)
        (staging / self.record_name).write_text(json.dumps(record, indent=2) + "\n")

    def size(self) -> int:
        """The bytes of the written output's files."""
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())


@contextlib.contextmanager
def parent_folders(path: Path) -> Iterator[None]:
    """Make ``path``'s missing parent folders; if the block fails, remove those still empty."""
    made = []
    folder = path.parent
    while not os.path.lexists(folder) and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield
    except BaseException:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if still empty
        raise
