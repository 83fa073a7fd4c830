"""Prepare WMT'14 English-German as in Vaswani et al. (2017): newstest2013 valid, newstest2014 test, joint BPE.

    python examples/translation/wmt14_en_de/prepare.py --workers 8
    python examples/translation/wmt14_en_de/prepare.py --archives ~/corpora/wmt14

(from a checkout; ``python -m fairseq_kd_recipes.prepare.scripts.wmt14_en_de`` where the package is
installed with ``pip install .``).

Needs about 10 GB of disk in --workdir; learning the BPE merges takes hours.
See examples/translation/README.md for the files, the steps and the outputs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..arguments import add_common_arguments, context_from_args, run_entry_point
from ..corpora import wmt14_en_de


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, wmt14_en_de.CORPUS)
    parser.add_argument(
        "--bpe-merges", type=int, default=wmt14_en_de.Settings.bpe_merges, metavar="N",
        help="number of joint subword-nmt merge operations (default: %(default)s, for the ~37K shared "
        "vocabulary of Vaswani et al.; fairseq's recipe uses 40000)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = wmt14_en_de.Settings(bpe_merges=args.bpe_merges)
    wmt14_en_de.prepare(context_from_args(args), settings)


def cli_main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(main, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
