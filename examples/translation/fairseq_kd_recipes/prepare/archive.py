"""Unpack downloaded archives (tar, tar.gz, zip, single-file gzip) and find files inside them.

Extraction goes to a temporary sibling folder that is renamed into place once complete, so an
interrupted extraction never looks finished.  Members that would land outside the destination
(absolute paths, ``..``, links pointing out) are refused.  A truncated or corrupt archive (bad gzip
CRC, unexpected end of data, bad zip member) raises a
:class:`~fairseq_kd_recipes.prepare.errors.PrepareError` naming the archive.
"""
from __future__ import annotations

import gzip
import platform
import shutil
import tarfile
import zipfile
import zlib
from pathlib import Path

from .errors import PrepareError


def extract(archive: Path, destination: Path) -> Path:
    """Unpack ``archive`` into ``destination`` (replaced if it exists); return ``destination``.

    ``.tgz``/``.tar.gz``/``.tar``: the tar members; ``.zip``: the zip members; any other ``.gz``:
    the single decompressed file, named without ``.gz``.
    """
    archive, destination = Path(archive), Path(destination)
    if not archive.is_file():
        raise PrepareError(f"archive {archive} does not exist")
    staging = destination.with_name(destination.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    name = archive.name.lower()
    try:
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            _extract_tar(archive, staging)
        elif name.endswith(".zip"):
            _extract_zip(archive, staging)
        elif name.endswith(".gz"):
            _gunzip(archive, staging / archive.name[: -len(".gz")])
        else:
            raise PrepareError(f"{archive}: unknown archive type (expected .tgz, .tar.gz, .tar, .zip or .gz)")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise PrepareError(
            f"{archive} is truncated or corrupt ({type(error).__name__}: {error}); "
            "delete it and download it again"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if destination.exists():
        shutil.rmtree(destination)
    staging.rename(destination)
    return destination


def _extract_tar(archive: Path, destination: Path) -> None:
    if not hasattr(tarfile, "data_filter"):  # came with 3.12 and 3.8.17, 3.9.17, 3.10.12, 3.11.4
        raise PrepareError(f"{archive}: this Python ({platform.python_version()}) has no tar extraction filters, "
                           "needed to refuse unsafe members; use Python >= 3.8.17 (3.9.17, 3.10.12, 3.11.4)")
    with open(archive, "rb") as handle:
        compressed = handle.read(2) == b"\x1f\x8b"
    if compressed:
        # tarfile stops reading at the last member, so a cut-off gzip trailer would go unnoticed;
        # decompressing the whole stream first checks the gzip CRC and length.
        with gzip.open(archive, "rb") as stream:
            while stream.read(1 << 20):
                pass
    with tarfile.open(archive, "r:*") as tar:
        # The "data" filter refuses absolute paths, "..", device files and links leaving the tree.
        try:
            tar.extractall(destination, filter="data")
        except tarfile.FilterError as error:
            raise PrepareError(f"{archive}: refusing unsafe member ({error})") from None


def _extract_zip(archive: Path, destination: Path) -> None:
    root = destination.resolve()
    with zipfile.ZipFile(archive) as package:
        bad_member = package.testzip()
        if bad_member is not None:
            raise zipfile.BadZipFile(f"CRC error in member {bad_member}")
        for member in package.namelist():
            target = (destination / member).resolve()
            if root != target and root not in target.parents:
                raise PrepareError(f"{archive}: refusing member {member!r} outside the extraction folder")
        package.extractall(destination)


def _gunzip(archive: Path, target: Path) -> None:
    with gzip.open(archive, "rb") as source, open(target, "wb") as out:
        shutil.copyfileobj(source, out, length=1 << 20)


def find_file(root: Path, file_name: str, described_as: str) -> Path:
    """The unique file called ``file_name`` anywhere under ``root``.

    Archives nest their files differently across releases (``training/x`` or just ``x``), so
    files are found by name.  ``described_as`` names the archive in the error listing what it
    holds when the file is absent or ambiguous.
    """
    matches = sorted(path for path in Path(root).rglob(file_name) if path.is_file())
    if len(matches) == 1:
        return matches[0]
    if not matches:
        present = sorted(str(path.relative_to(root)) for path in Path(root).rglob("*") if path.is_file())
        listing = ", ".join(present[:40]) + (" ..." if len(present) > 40 else "")
        raise PrepareError(f"{described_as} holds no file named {file_name} (it holds: {listing or 'nothing'})")
    raise PrepareError(
        f"{described_as} holds several files named {file_name}: "
        + ", ".join(str(path.relative_to(root)) for path in matches)
    )
