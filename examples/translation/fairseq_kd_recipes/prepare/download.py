"""Fetch corpus files: resumable HTTP(S) download with verification, or a folder the user filled.

A :class:`RemoteFile` names a file, the public addresses it can be downloaded from, and what is
known about its content (sha256, md5, size).  :class:`Fetcher` either

* takes it from ``--archives DIR`` (for machines that reach no dataset host): the file must be
  there under its manifest name, and nothing is downloaded; or
* downloads it into ``<workdir>/downloads``: into ``NAME.part``, resuming an interrupted transfer
  with an HTTP ``Range`` request, and renames it to ``NAME`` only once it is complete and verified.

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fairseq_kd.fingerprint import fingerprint, read_json, write_json
from fairseq_kd.progress import progress_bar, stream_is_terminal

from .errors import PrepareError

LOG = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
USER_AGENT = "fairseq-kd-prepare/0.1 (+python-urllib)"


@dataclass(frozen=True)
class RemoteFile:
    """One downloadable file of a corpus manifest.

    ``name`` is the file name on disk (and the name looked for in ``--archives``); ``urls`` are
    tried in order.  ``sha256``/``md5``/``size`` are ``None`` where not known for certain: a
    checksum is never guessed.  ``provenance`` says where the address and checksum come from.
    """

    name: str
    urls: tuple[str, ...]
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None
    provenance: str = ""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"RemoteFile {self.name!r} needs at least one URL")
        if "/" in self.name or self.name in ("", ".", ".."):
            raise ValueError(f"RemoteFile name must be a plain file name, got {self.name!r}")
        for label, value, length in (("sha256", self.sha256, 64), ("md5", self.md5, 32)):
            if value is not None and not re.fullmatch(f"[0-9a-f]{{{length}}}", value):
                raise ValueError(f"RemoteFile {self.name!r}: {label} must be {length} lowercase hex digits")

    def expected_text(self, pinned_sha256: str | None = None) -> str:
        """The expected properties, for error messages (a pinned sha256 replaces the others)."""
        if pinned_sha256:
            return f"sha256 {pinned_sha256} (pinned with --checksums)"
        parts = []
        if self.sha256:
            parts.append(f"sha256 {self.sha256}")
        if self.md5:
            parts.append(f"md5 {self.md5}")
        if self.size is not None:
            parts.append(f"{self.size} bytes")
        return ", ".join(parts) if parts else "no checksum pinned"


@dataclass(frozen=True)
class FileDigest:
    """Size and checksums of a file, computed in one pass."""

    size: int
    sha256: str
    md5: str

    @classmethod
    def of(cls, recorded: Mapping) -> "FileDigest":
        """From a file's fingerprint (:mod:`fairseq_kd.fingerprint`) taken with ``md5=True``."""
        return cls(size=recorded["size"], sha256=recorded["sha256"], md5=recorded["md5"])


def load_pinned_checksums(path: Path) -> dict[str, str]:
    """Read a ``--checksums`` JSON file: ``{"file name": "sha256 hex", ...}``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PrepareError(f"--checksums {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise PrepareError(f"--checksums {path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise PrepareError(f"--checksums {path}: expected a JSON object mapping file names to sha256")
    pinned = {}
    for name, value in data.items():
        if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
            raise PrepareError(f"--checksums {path}: the value for {name!r} is not a sha256 (64 lowercase hex digits)")
        pinned[name] = value
    return pinned


class _IncompleteTransfer(Exception):
    """The connection ended before the announced length arrived (the .part is kept for resuming)."""


class Fetcher:
    """Provide the local path of a :class:`RemoteFile`, downloading it if need be.

    ``archives_dir``: take every file from this folder and never download.  ``pinned_sha256``
    maps file names to a sha256 that replaces what the manifest expects of that file (the
    ``--checksums`` file).  ``retries``: extra attempts per URL after a network failure, each
    resuming the partial file.
    """

    def __init__(
        self,
        download_dir: Path,
        archives_dir: Path | None = None,
        pinned_sha256: Mapping[str, str] | None = None,
        retries: int = 3,
        timeout: float = 60.0,
        retry_wait: float = 2.0,
    ) -> None:
        if archives_dir is not None and not Path(archives_dir).is_dir():
            raise PrepareError(f"--archives {archives_dir}: not a directory")
        if retries < 0:
            raise PrepareError(f"--download-retries must be >= 0, got {retries}")
        self.download_dir = Path(download_dir)
        self.archives_dir = Path(archives_dir) if archives_dir is not None else None
        self.pinned_sha256 = dict(pinned_sha256 or {})
        self.retries = retries
        self.timeout = timeout
        self.retry_wait = retry_wait

    # ------------------------------------------------------------------ public
    def fetch(self, remote: RemoteFile) -> Path:
        """Local, verified path of ``remote`` (see the module docstring for the rules)."""
        if self.archives_dir is not None:
            return self._from_archives(remote)
        self.download_dir.mkdir(parents=True, exist_ok=True)
        target = self.download_dir / remote.name
        if target.exists():
            self._verify(target, remote, remedy=f"delete {target} to download it again")
            LOG.info("%s: already downloaded and verified", remote.name)
            return target
        return self._download(remote, target)

    # ----------------------------------------------------------------- helpers
    def _from_archives(self, remote: RemoteFile) -> Path:
        path = self.archives_dir / remote.name
        if not path.is_file():
            raise PrepareError(
                f"{remote.name} is missing from --archives {self.archives_dir} "
                f"(expected: {remote.expected_text(self.pinned_sha256.get(remote.name))}). "
                f"Download it from {remote.urls[0]} into that folder under this name."
            )
        self._verify(path, remote, remedy=f"replace it with a fresh copy from {remote.urls[0]}")
        LOG.info("%s: using %s", remote.name, path)
        return path

    def _digest_cache_path(self) -> Path:
        return self.download_dir / "digests.json"

    def _cached_digest(self, path: Path) -> FileDigest:
        """Digest of ``path``, reusing a recorded one while size and mtime are unchanged."""
        cache_path = self._digest_cache_path()
        cache = read_json(cache_path) or {}
        key = str(path.resolve())
        cache[key] = fingerprint(path, cache.get(key), md5=True)
        write_json(cache_path, cache)
        return FileDigest.of(cache[key])

    def _verify(self, path: Path, remote: RemoteFile, remedy: str) -> FileDigest:
        digest = self._cached_digest(path)
        pinned = self.pinned_sha256.get(remote.name)
        problems = _mismatches(digest, remote, pinned)
        if problems:
            raise PrepareError(
                f"{path} is corrupt or not the expected file: {'; '.join(problems)} "
                f"(expected: {remote.expected_text(pinned)}); {remedy}."
            )
        if not (pinned or remote.sha256 or remote.md5):
            self._report_unpinned(remote, digest)
        return digest

    def _report_unpinned(self, remote: RemoteFile, digest: FileDigest) -> None:
        LOG.warning(
            "%s: no checksum is pinned for this file; it was checked against its size only. "
            "Computed sha256 %s (%d bytes): pin it with --checksums (see examples/translation/README.md).",
            remote.name, digest.sha256, digest.size,
        )
        if self.archives_dir is None:
            record = self.download_dir / "checksums.json"
            recorded = read_json(record) or {}
            recorded[remote.name] = digest.sha256
            write_json(record, recorded)

    def _download(self, remote: RemoteFile, target: Path) -> Path:
        part = target.with_name(target.name + ".part")
        origin = target.with_name(target.name + ".part.url")
        failures: list[str] = []
        for url in remote.urls:
            if part.exists() and (not origin.exists() or origin.read_text(encoding="utf-8") != url):
                # A partial file from another address may not be the same bytes: start over.
                part.unlink()
            origin.write_text(url, encoding="utf-8")
            for attempt in range(self.retries + 1):
                try:
                    self._transfer(url, part, remote)
                except urllib.error.HTTPError as error:
                    failures.append(f"{url}: HTTP {error.code} {error.reason}")
                    if 400 <= error.code < 500:
                        break  # this address will not serve the file; try the next one
                except (urllib.error.URLError, http.client.HTTPException, OSError, _IncompleteTransfer) as error:
                    failures.append(f"{url}: {error}")
                else:
                    digest = self._verify_part(part, remote, url)
                    os.replace(part, target)
                    origin.unlink(missing_ok=True)
                    self._remember_digest(target, digest)
                    LOG.info("%s: downloaded and verified (%d bytes)", remote.name, digest.size)
                    return target
                if attempt < self.retries:
                    LOG.warning("%s: %s; retrying (%d/%d)", remote.name, failures[-1], attempt + 1, self.retries)
                    time.sleep(self.retry_wait * (attempt + 1))
        kept = f"the partial file {part} is kept and the next run resumes it; " if part.exists() else ""
        raise PrepareError(
            f"could not download {remote.name} ({'; '.join(failures)}); {kept}"
            f"or download it yourself from {remote.urls[0]} and pass its folder as --archives DIR."
        )

    def _verify_part(self, part: Path, remote: RemoteFile, url: str) -> FileDigest:
        digest = FileDigest.of(fingerprint(part, md5=True))
        pinned = self.pinned_sha256.get(remote.name)
        problems = _mismatches(digest, remote, pinned)
        if problems:
            part.unlink()
            raise PrepareError(
                f"the download of {remote.name} from {url} is corrupt: {'; '.join(problems)} "
                f"(expected: {remote.expected_text(pinned)}); the partial file was deleted, "
                "run again to download it anew or fetch it yourself and use --archives DIR."
            )
        if not (pinned or remote.sha256 or remote.md5):
            self._report_unpinned(remote, digest)
        return digest

    def _remember_digest(self, path: Path, digest: FileDigest) -> None:
        """Record the digest of a file just verified under its final name (renaming kept it)."""
        cache_path = self._digest_cache_path()
        cache = read_json(cache_path) or {}
        stat = path.stat()
        cache[str(path.resolve())] = {"kind": "file", "size": digest.size, "mtime_ns": stat.st_mtime_ns,
                                      "sha256": digest.sha256, "md5": digest.md5}
        write_json(cache_path, cache)

    def _transfer(self, url: str, part: Path, remote: RemoteFile) -> None:
        """Download ``url`` into ``part``, resuming from its current size when possible."""
        offset = part.stat().st_size if part.exists() else 0
        headers = {"User-Agent": USER_AGENT}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        request = urllib.request.Request(url, headers=headers)
        try:
            response = urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            if error.code == 416 and offset:
                # Range not satisfiable: the partial file already holds every byte.
                return
            raise
        with response:
            if offset and response.status == 206:
                start = _content_range_start(response.headers.get("Content-Range"))
                if start != offset:
                    part.unlink()
                    raise _IncompleteTransfer(f"server resumed at byte {start} instead of {offset}; restarting")
                mode = "ab"
                LOG.info("%s: resuming at byte %d from %s", remote.name, offset, url)
            else:
                # A plain 200: the server ignores ranges (or this is a fresh start).
                offset, mode = 0, "wb"
                LOG.info("%s: downloading %s", remote.name, url)
            length = response.headers.get("Content-Length")
            expected_total = offset + int(length) if length is not None else None
            self._copy(response, part, mode, remote.name, offset, expected_total)
        size = part.stat().st_size
        if expected_total is not None and size != expected_total:
            raise _IncompleteTransfer(f"connection ended after {size} of {expected_total} bytes")


    @staticmethod
    def _copy(response, part: Path, mode: str, name: str, offset: int, expected_total: int | None) -> None:
        """The response's bytes appended to ``part``, with a bar on a terminal and, where stderr is
        not one (a log file), a line at every 10% instead."""
        received, next_report = offset, 0.1
        lines = not stream_is_terminal(sys.stderr)
        with open(part, mode) as out, progress_bar(total=expected_total, initial=offset, desc=name, unit="B",
                                                   unit_scale=True, unit_divisor=1024) as bar:
            while block := response.read(CHUNK_BYTES):
                out.write(block)
                received += len(block)
                bar.update(len(block))
                if lines and expected_total and received / expected_total >= next_report:
                    LOG.info("%s: %d%% of %d bytes", name, int(100 * received / expected_total), expected_total)
                    next_report += 0.1


def _mismatches(digest: FileDigest, remote: RemoteFile, pinned_sha256: str | None) -> list[str]:
    """What differs from the expectations; a user-pinned sha256 replaces the manifest's values."""
    if pinned_sha256:
        return [] if digest.sha256 == pinned_sha256 else [f"sha256 is {digest.sha256}"]
    problems = []
    if remote.size is not None and digest.size != remote.size:
        problems.append(f"size is {digest.size} bytes, expected {remote.size}")
    if remote.sha256 and digest.sha256 != remote.sha256:
        problems.append(f"sha256 is {digest.sha256}")
    if remote.md5 and digest.md5 != remote.md5:
        problems.append(f"md5 is {digest.md5}")
    return problems


def _content_range_start(header: str | None) -> int | None:
    match = re.match(r"bytes (\d+)-\d+/(\d+|\*)", header or "")
    return int(match.group(1)) if match else None


