"""Binarise a prepared parallel corpus with ``fairseq-preprocess`` (joined dictionary).

The teacher and every student must share one vocabulary (Align-to-Distill, for one, compares
their distributions token by token), and the subword models here are learned jointly on both
languages, so the dictionary is built once over source and target (``--joined-dictionary``).
fairseq-preprocess runs as a subprocess of the same Python environment; its log goes to
``<destdir>/preprocess.log`` (written by fairseq) and, for failures, into the raised error.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import PrepareError


@dataclass(frozen=True)
class SplitPrefixes:
    """File prefixes ``PREFIX.<lang>`` of the splits (``None``: split absent)."""

    train: Path
    valid: Path | None = None
    test: Path | None = None


def fairseq_preprocess_command() -> list[str]:
    """The ``fairseq-preprocess`` of this Python environment (else the one on ``PATH``)."""
    beside_python = Path(sys.executable).with_name("fairseq-preprocess")
    if beside_python.is_file():
        return [str(beside_python)]
    on_path = shutil.which("fairseq-preprocess")
    if on_path:
        return [on_path]
    raise PrepareError(
        "fairseq-preprocess was not found next to this Python or on PATH; "
        "install fairseq into this environment (scripts/setup_env.sh)"
    )


def binarize(
    source_lang: str,
    target_lang: str,
    splits: SplitPrefixes,
    destdir: Path,
    workers: int = 1,
) -> list[str]:
    """Run fairseq-preprocess with a joined dictionary; return the command that ran."""
    command = fairseq_preprocess_command() + [
        "--source-lang", source_lang,
        "--target-lang", target_lang,
        "--trainpref", str(splits.train),
        "--destdir", str(destdir),
        "--joined-dictionary",
        "--workers", str(max(1, workers)),
    ]
    if splits.valid is not None:
        command += ["--validpref", str(splits.valid)]
    if splits.test is not None:
        command += ["--testpref", str(splits.test)]
    Path(destdir).mkdir(parents=True, exist_ok=True)
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-15:])
        raise PrepareError(f"fairseq-preprocess failed (exit {completed.returncode}) for {destdir}:\n{tail}")
    return command
