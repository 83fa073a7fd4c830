"""Prepare Multi30k task 1 French-English (29K / 1,014 / 1,000 pairs) with joint subword-nmt BPE.

    python examples/translation/multi30k_fr_en/prepare.py
    python examples/translation/multi30k_fr_en/prepare.py --archives ../shared/data/multi30k-fr-en

(from a checkout; ``python -m fairseq_kd_recipes.prepare.scripts.multi30k_fr_en`` where the package is
installed with ``pip install .``).

The real-corpus quality benchmark (scripts/quality_benchmark.sh) runs this first.
See examples/translation/README.md for the files, the steps and the outputs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..arguments import add_common_arguments, context_from_args, run_entry_point
from ..corpora import multi30k_fr_en


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, multi30k_fr_en.CORPUS)
    parser.add_argument("--bpe-merges", type=int, default=multi30k_fr_en.Settings.bpe_merges,
                        help="joint BPE merge operations (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    multi30k_fr_en.prepare(context_from_args(args), multi30k_fr_en.Settings(bpe_merges=args.bpe_merges))


def cli_main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(main, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
