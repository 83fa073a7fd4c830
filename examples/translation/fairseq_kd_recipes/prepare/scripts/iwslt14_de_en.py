"""Prepare IWSLT'14 German-English as fairseq's prepare-iwslt14.sh does, without Perl.

    python examples/translation/iwslt14_de_en/prepare.py --dest data-bin/iwslt14.tokenized.de-en
    python examples/translation/iwslt14_de_en/prepare.py --archives ~/corpora   # de-en.tgz already there

(from a checkout; ``python -m fairseq_kd_recipes.prepare.scripts.iwslt14_de_en`` where the package is
installed with ``pip install .``).

See examples/translation/README.md for the steps and outputs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..arguments import add_common_arguments, context_from_args, run_entry_point
from ..corpora import iwslt14_de_en


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, iwslt14_de_en.CORPUS)
    parser.add_argument(
        "--bpe-merges", type=int, default=iwslt14_de_en.Settings.bpe_merges, metavar="N",
        help="number of joint subword-nmt merge operations (default: %(default)s, as in fairseq)",
    )
    parser.add_argument(
        "--drop-talk-headers", action="store_true",
        help="also drop the <title> and <description> lines of the training data "
        "(fairseq keeps their text; the default reproduces fairseq's corpus)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = iwslt14_de_en.Settings(bpe_merges=args.bpe_merges, keep_talk_headers=not args.drop_talk_headers)
    iwslt14_de_en.prepare(context_from_args(args), settings)


def cli_main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(main, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
