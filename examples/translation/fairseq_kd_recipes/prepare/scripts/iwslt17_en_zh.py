"""Prepare IWSLT'17 English-Chinese with a joint SentencePiece model (Align-to-Distill setup).

    python examples/translation/iwslt17_en_zh/prepare.py
    python examples/translation/iwslt17_en_zh/prepare.py --archives ~/corpora   # en-zh.tgz already there

(from a checkout; ``python -m fairseq_kd_recipes.prepare.scripts.iwslt17_en_zh`` where the package is
installed with ``pip install .``).

Score the decoded output with sacreBLEU's Chinese tokeniser: sacrebleu REF -tok zh < HYP.
See examples/translation/README.md for the split, the steps and the outputs.
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
from ..corpora import iwslt_spm

CORPUS = iwslt_spm.IWSLT17_EN_ZH


def _set_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, CORPUS.name)
    add_sentencepiece_arguments(parser, CORPUS.spm_vocab_size, CORPUS.spm_character_coverage)
    add_piece_clean_arguments(parser, CORPUS.piece_clean.max_tokens)
    parser.add_argument("--valid-sets", type=_set_list, metavar="SET[,SET...]",
                        help=f"XML sets concatenated into the validation set (default: {','.join(CORPUS.valid_sets)})")
    parser.add_argument("--test-sets", type=_set_list, metavar="SET[,SET...]",
                        help=f"XML sets concatenated into the test set (default: {','.join(CORPUS.test_sets)})")
    parser.add_argument("--drop-talk-headers", action="store_true",
                        help="drop the <title> and <description> lines of the training data (kept by default, as fairseq does)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = iwslt_spm.Settings(
        spm=sentencepiece_config(args),
        valid_sets=args.valid_sets,
        test_sets=args.test_sets,
        piece_clean=piece_clean_rule(args),
        keep_talk_headers=not args.drop_talk_headers,
    )
    iwslt_spm.prepare(context_from_args(args), CORPUS, settings)


def cli_main(argv: Sequence[str] | None = None) -> int:
    return run_entry_point(main, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
