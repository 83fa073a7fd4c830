"""Prepare WMT'22 German-Lower Sorbian (very-low-resource task, ~40K pairs) with a joint SentencePiece model.

    python examples/translation/wmt22_de_dsb/prepare.py
    python examples/translation/wmt22_de_dsb/prepare.py --archives ~/corpora/wmt22-dsb --test-set valid2022

(from a checkout; ``python -m fairseq_kd_recipes.prepare.scripts.wmt22_de_dsb`` where the package is
installed with ``pip install .``).

See examples/translation/README.md for the files, the sets, the steps and the outputs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..arguments import (
    add_common_arguments,
    add_piece_clean_arguments,
    add_sentencepiece_arguments,
    context_from_args,
    piece_clean_rule,
    run_entry_point,
    sentencepiece_config,
)
from ..corpora import wmt22_de_dsb

HELD_OUT_SETS = [name for name in wmt22_de_dsb.SETS if name != wmt22_de_dsb.TRAIN_SET]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, wmt22_de_dsb.CORPUS)
    add_sentencepiece_arguments(parser, wmt22_de_dsb.SPM_VOCAB_SIZE, 1.0)
    add_piece_clean_arguments(parser, wmt22_de_dsb.PIECE_CLEAN.max_tokens)
    parser.add_argument("--valid-set", choices=HELD_OUT_SETS, default=wmt22_de_dsb.DEFAULT_VALID_SET,
                        help="held-out set used for validation (default: %(default)s)")
    parser.add_argument("--test-set", choices=HELD_OUT_SETS, default=wmt22_de_dsb.DEFAULT_TEST_SET,
                        help="held-out set used for testing (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = wmt22_de_dsb.Settings(
        spm=sentencepiece_config(args),
        valid_set=args.valid_set,
        test_set=args.test_set,
        piece_clean=piece_clean_rule(args),
    )
    wmt22_de_dsb.prepare(context_from_args(args), settings)


def cli_main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(main, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
