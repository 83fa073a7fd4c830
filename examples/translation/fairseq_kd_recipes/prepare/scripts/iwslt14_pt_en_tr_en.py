"""Prepare IWSLT'14 Portuguese-English or Turkish-English with a joint SentencePiece model (CKD setup).

    python examples/translation/iwslt14_pt_en_tr_en/prepare.py --pair pt-en
    python examples/translation/iwslt14_pt_en_tr_en/prepare.py --pair tr-en --archives ~/corpora

(from a checkout; ``python -m fairseq_kd_recipes.prepare.scripts.iwslt14_pt_en_tr_en`` where the package is
installed with ``pip install .``).

Pt-En comes from the WIT3 2014-01 archive (pt-br-en.tgz), Tr-En from the Multitarget TED Talks
release (multitarget-ted.tgz: its train, dev and test1 sets, the CKD paper's 1,958 / 1,982).
See examples/translation/README.md for the split, the steps and the outputs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..arguments import (
    add_common_arguments,
    add_sentencepiece_arguments,
    context_from_args,
    run_entry_point,
    sentencepiece_config,
)
from ..corpora import iwslt_spm

PAIRS = {"pt-en": iwslt_spm.IWSLT14_PT_EN, "tr-en": iwslt_spm.IWSLT14_TR_EN}


def _set_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    # The pair decides the default folders, so it is read before the full parser is built.
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--pair", choices=sorted(PAIRS))
    known, _ = probe.parse_known_args(argv)
    corpus = PAIRS.get(known.pair or "pt-en")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), required=True,
                        help="language pair: pt-en (Portuguese-English) or tr-en (Turkish-English)")
    add_common_arguments(parser, corpus.name)
    add_sentencepiece_arguments(parser, corpus.spm_vocab_size, corpus.spm_character_coverage)
    parser.add_argument(
        "--valid-sets", type=_set_list, metavar="SET[,SET...]",
        help="pt-en only: take the validation set from these XML sets (e.g. TED.dev2010) instead of "
        "every 23rd cleaned training pair (the default, as in fairseq and the CKD paper's Pt-En split)",
    )
    parser.add_argument(
        "--test-sets", type=_set_list, metavar="SET[,SET...]",
        help="pt-en only: XML sets concatenated into the test set (default: every set of the archive, "
        "development sets first, then test sets, by year)",
    )
    parser.add_argument(
        "--drop-talk-headers", action="store_true",
        help="pt-en only: drop the <title> and <description> lines of the training data (fairseq "
        "keeps their text)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser(argv).parse_args(argv)
    settings = iwslt_spm.Settings(
        spm=sentencepiece_config(args),
        valid_sets=args.valid_sets,
        test_sets=args.test_sets,
        keep_talk_headers=not args.drop_talk_headers,
    )
    iwslt_spm.prepare(context_from_args(args), PAIRS[args.pair], settings)


def cli_main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(main, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
