"""The one place where the plugin hashes (files, bytes, records, fairseq dictionaries), for every
resumable record and the teacher binding of a run. Imports neither torch nor fairseq.

A file's fingerprint is its size, modification time and sha256 (and md5 where a download manifest
pins one); a folder's is its files' fingerprints. Two describe the same content when their
:func:`content` is equal. A recorded fingerprint passed back as ``previous`` has its checksums
reused while size and modification time agree, so that a finished pipeline's files are not re-read.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

CHUNK_BYTES = 1 << 20


def fingerprint(path: Path, previous: Mapping[str, Any] | None = None, md5: bool = False) -> dict[str, Any]:
    """``{"kind": "file", "size", "mtime_ns", "sha256"[, "md5"]}`` of a file, or
    ``{"kind": "dir", "files": {relative path: fingerprint}}`` of a folder."""
    path = Path(path)
    if path.is_dir():
        names = {child.relative_to(path).as_posix(): child for child in sorted(path.rglob("*")) if child.is_file()}
        return {"kind": "dir", "files": _each(names, previous, md5)}
    stat = path.stat()
    reusable = (previous and previous.get("size") == stat.st_size and previous.get("mtime_ns") == stat.st_mtime_ns
                and "sha256" in previous and (not md5 or "md5" in previous))
    digests = {key: previous[key] for key in ("sha256", "md5") if key in previous} if reusable else _digests(path, md5)
    return {"kind": "file", "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, **digests}


def fingerprint_files(paths: Iterable[Path], previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"kind": "files", "files": {file name: fingerprint}}`` of chosen files (e.g. a binarised
    split among other files of its folder), by file name, so that a moved folder matches."""
    return {"kind": "files", "files": _each({Path(path).name: Path(path) for path in paths}, previous, False)}


def _each(paths: Mapping[str, Path], previous: Mapping[str, Any] | None, md5: bool) -> dict[str, Any]:
    """``{name: fingerprint}`` of ``paths``, each reusing its entry of ``previous["files"]``."""
    previous_files = (previous or {}).get("files", {})
    return {name: fingerprint(path, previous_files.get(name), md5) for name, path in paths.items()}


def content(recorded: Mapping[str, Any]) -> Any:
    """The part of a fingerprint that identifies content (not modification times)."""
    if recorded.get("kind") in ("dir", "files"):
        return {name: content(child) for name, child in recorded["files"].items()}
    return recorded.get("sha256")


def file_sha256(path: Path) -> str:
    return _digests(Path(path), False)["sha256"]


def bytes_sha256(data: bytes) -> str:
    """SHA-256 of bytes in memory (a teacher pass's shard, hashed before it is written)."""
    return hashlib.sha256(data).hexdigest()


def record_sha256(record: Any) -> str:
    """SHA-256 of a JSON-serialisable record in canonical form (keys sorted, no spaces): the
    identity of a teacher pass, which each of its shards' records carries."""
    return bytes_sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def dictionary_sha256(dictionary) -> str:
    """SHA-256 of a fairseq dictionary's symbols in index order (not their counts)."""
    return hashlib.sha256("\n".join(dictionary.symbols).encode("utf-8")).hexdigest()


def _digests(path: Path, md5: bool) -> dict[str, str]:
    """sha256 (and md5) of ``path`` in one read."""
    hashes = {"sha256": hashlib.sha256()}
    if md5:  # for a download's published sum: FIPS-mode builds allow it only when told so (Python >= 3.9)
        hashes["md5"] = hashlib.md5(usedforsecurity=False) if sys.version_info >= (3, 9) else hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            for digest in hashes.values():
                digest.update(block)
    return {name: digest.hexdigest() for name, digest in hashes.items()}


def read_json(path: Path) -> dict | None:
    """A record written by :func:`write_json`; None when absent or unreadable (a step interrupted
    before its record was complete counts as not done)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Write a record atomically (a temporary file renamed over it), keys sorted. The temporary
    file is this process's (host and pid in its name), so workers of one teacher pass that write
    the same record into a shared folder at once never write into each other's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)
