"""Flags shared by every ``examples/translation/*/prepare.py`` entry point, and their checking."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from fairseq_kd.errors import message_of
from fairseq_kd.progress import progress_to_stderr
from .corpora.common import PrepareContext
from .download import Fetcher, load_pinned_checksums
from .errors import PrepareError
from .pipeline import StepRunner
from .spm import SentencePieceConfig
from .tokenize import CleanRule


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def add_common_arguments(parser: argparse.ArgumentParser, corpus: str) -> None:
    """Add the fetching, folder and execution flags; ``corpus`` names the default folders."""
    group = parser.add_argument_group("data and folders")
    group.add_argument(
        "--archives", type=Path, metavar="DIR",
        help="folder holding the already-downloaded files under their manifest names (see "
        "examples/translation/README.md); nothing is downloaded when given",
    )
    group.add_argument(
        "--workdir", type=Path, metavar="DIR", default=Path("work_dirs") / "prepare" / corpus,
        help="working folder for downloads, intermediate text and step stamps "
        "(default: %(default)s); re-running with the same folder skips finished steps",
    )
    group.add_argument(
        "--dest", type=Path, metavar="DIR", default=Path("data-bin") / corpus,
        help="output folder for the binarised corpus, the subword model and the references "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--overwrite", action="store_true",
        help="allow replacing the contents of an existing --dest that this --workdir did not write "
        "or wrote from different inputs",
    )
    group.add_argument(
        "--checksums", type=Path, metavar="FILE",
        help='JSON file {"file name": "sha256", ...}; a file listed there must have that sha256, which '
        "replaces the built-in manifest's checksums for it (a download without any pinned checksum "
        "records what it computed in WORKDIR/downloads/checksums.json)",
    )
    run = parser.add_argument_group("execution")
    run.add_argument(
        "--workers", type=int, default=default_workers(), metavar="N",
        help="worker processes for tokenisation, subword segmentation and fairseq-preprocess, and "
        "SentencePiece training threads (default: %(default)s)",
    )
    run.add_argument("--force", action="store_true", help="re-run every step even if its stamp says it is done")
    run.add_argument(
        "--download-retries", type=int, default=3, metavar="N",
        help="extra attempts per address after a network failure, each resuming the partial file (default: %(default)s)",
    )
    run.add_argument(
        "--download-timeout", type=float, default=60.0, metavar="SECONDS",
        help="network timeout of one read (default: %(default)s)",
    )


def context_from_args(args: argparse.Namespace) -> PrepareContext:
    """Check the common flags and build the :class:`PrepareContext` (raises PrepareError)."""
    if args.workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {args.workers}")
    if args.download_timeout <= 0:
        raise PrepareError(f"--download-timeout must be > 0, got {args.download_timeout}")
    pinned = load_pinned_checksums(args.checksums) if args.checksums is not None else {}
    workdir = args.workdir.resolve()
    if workdir.exists() and not workdir.is_dir():
        raise PrepareError(f"--workdir {args.workdir} exists and is not a directory")
    fetcher = Fetcher(
        download_dir=workdir / "downloads",
        archives_dir=args.archives,
        pinned_sha256=pinned,
        retries=args.download_retries,
        timeout=args.download_timeout,
    )
    return PrepareContext(
        workdir=workdir,
        dest=args.dest.resolve(),
        fetcher=fetcher,
        runner=StepRunner(workdir / "stamps", force=args.force),
        workers=args.workers,
        overwrite=args.overwrite,
    )


def run_entry_point(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` with progress logged to stderr; a user error (a PrepareError, or a file
    that cannot be read or written) becomes one line, ``PROG: error: MESSAGE`` as argparse prints
    it, and exit status 2."""
    prog = os.path.basename(sys.argv[0]) or "prepare"
    with progress_to_stderr("fairseq_kd_recipes.prepare", "%(asctime)s | %(levelname)s | %(message)s"):
        try:
            main(argv)
        except PrepareError as error:
            print(f"{prog}: error: {error}", file=sys.stderr)
            return 2
        except (OSError, UnicodeDecodeError) as error:
            print(f"{prog}: error: {message_of(error)}", file=sys.stderr)
            return 2
    return 0


def add_sentencepiece_arguments(parser: argparse.ArgumentParser, vocab_size: int, character_coverage: float) -> None:
    """Flags of the joint SentencePiece model."""
    group = parser.add_argument_group("SentencePiece")
    group.add_argument("--spm-vocab-size", type=int, default=vocab_size, metavar="N",
                       help="size of the joint SentencePiece vocabulary (default: %(default)s)")
    group.add_argument("--spm-model-type", default="unigram", choices=("unigram", "bpe", "char", "word"),
                       help="SentencePiece model type (default: %(default)s)")
    group.add_argument("--spm-character-coverage", type=float, default=character_coverage, metavar="F",
                       help="share of characters the model must cover (default: %(default)s)")
    group.add_argument("--spm-input-sentence-size", type=int, default=0, metavar="N",
                       help="train on a random sample of N sentences; 0 uses all (default: %(default)s)")


def sentencepiece_config(args: argparse.Namespace) -> SentencePieceConfig:
    """The :class:`SentencePieceConfig` of the flags added by :func:`add_sentencepiece_arguments`."""
    if args.spm_input_sentence_size < 0:
        raise PrepareError(f"--spm-input-sentence-size must be >= 0, got {args.spm_input_sentence_size}")
    return SentencePieceConfig(
        vocab_size=args.spm_vocab_size,
        model_type=args.spm_model_type,
        character_coverage=args.spm_character_coverage,
        input_sentence_size=args.spm_input_sentence_size,
        num_threads=args.workers,
    )


def add_piece_clean_arguments(parser: argparse.ArgumentParser, max_pieces: int) -> None:
    """Flags of the length filter applied to the encoded training pairs."""
    group = parser.add_argument_group("training-pair filter (counted in subword pieces)")
    group.add_argument("--max-pieces", type=int, default=max_pieces, metavar="N",
                       help="drop training pairs with a side longer than N pieces (default: %(default)s)")
    group.add_argument("--clean-ratio", type=float, default=None, metavar="R",
                       help="also drop training pairs whose sides differ in length by more than a factor R "
                       "(default: no ratio filter)")


def piece_clean_rule(args: argparse.Namespace) -> CleanRule:
    """The :class:`CleanRule` of the flags added by :func:`add_piece_clean_arguments`."""
    if args.max_pieces < 1:
        raise PrepareError(f"--max-pieces must be >= 1, got {args.max_pieces}")
    if args.clean_ratio is not None and args.clean_ratio < 1:
        raise PrepareError(f"--clean-ratio must be >= 1, got {args.clean_ratio}")
    return CleanRule(min_tokens=1, max_tokens=args.max_pieces, ratio=args.clean_ratio)
