"""The folder an export writes (``--format ctranslate2``, ``--format hf``): checked before any work,
and written whole: built under a staging name beside it and renamed into place, so that a failed
or killed export leaves the output as it was, and ``--overwrite`` replaces only an export of the
same format, never the input checkpoint or a folder of other files."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator, Type


def check_output(checkpoint: str, output: str, overwrite: bool, *, kind: str, is_export: Callable[[Path], bool],
                 not_an_export: str, error: Type[Exception]) -> Path:
    """``output`` as a Path, or ``error`` in one line: a file (a ``kind`` model is a folder), a path
    under a file, the folder of the input checkpoint, a non-empty folder without ``overwrite``, or
    one ``is_export`` does not recognise (``not_an_export`` says what it holds and what to do)."""
    from ..cli.user_errors import OUTPUT_FOLDER, path_problem

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise error(f"output {output!r} is a file; a {kind} model is a folder: give a new folder path")
    problem = path_problem(out, OUTPUT_FOLDER)
    if problem is not None:
        raise error(f"output {output!r}: {problem}")
    resolved, checkpoint_path = out.resolve(), Path(checkpoint).resolve()
    if resolved == checkpoint_path or resolved in checkpoint_path.parents:  # is_relative_to, Python >= 3.9
        raise error(f"output {output!r} holds the input checkpoint; choose another folder "
                    "(the export never replaces its input)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise error(f"output {output!r} already exists and is not empty; choose another folder or pass --overwrite")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise error(f"output {output!r} {not_an_export}")
    return out


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A staging folder to write the export into; once the block ends without an error it becomes
    ``out`` (an existing ``out``, checked by :func:`check_output`, is swapped out, then deleted).
    The staging folder is removed whatever happens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        yield staging
        if out.exists():
            retired = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
            os.replace(out, retired)
            os.replace(staging, out)
            shutil.rmtree(retired)
        else:
            os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
