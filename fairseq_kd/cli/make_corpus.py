"""Write the synthetic parallel corpus of :mod:`fairseq_kd.data.synthetic` as tokenised text files.

Usage: ``fairseq-kd-make-corpus --output-dir data/synthetic [--seed 1] [--train-size 20000]``
(or ``python -m fairseq_kd.cli.make_corpus``). Re-running with the same parameters on a folder it
wrote before reuses that corpus (checked against ``corpus.json``) instead of regenerating it.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from fairseq_kd.data import synthetic
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairseq-kd-make-corpus",
        description="Generate a deterministic synthetic translation corpus between two invented "
                    "languages (SVO -> SOV with gender/number agreement); see the docstring of "
                    "fairseq_kd/data/synthetic.py for the grammar.")
    parser.add_argument("--output-dir", required=True,
                        help="folder to write {train,valid,test}.{SRC,TGT} and corpus.json into; "
                             "created if missing")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the sentence sampler; the corpus is a pure function of it and "
                             "of the sizes (default: %(default)s)")
    parser.add_argument("--train-size", type=int, default=20000,
                        help="number of training sentence pairs (default: %(default)s)")
    parser.add_argument("--valid-size", type=int, default=500,
                        help="number of validation sentence pairs (default: %(default)s)")
    parser.add_argument("--test-size", type=int, default=500,
                        help="number of test sentence pairs (default: %(default)s)")
    parser.add_argument("--source-lang", default="src",
                        help="file suffix of the source side, e.g. train.SRC (default: %(default)s)")
    parser.add_argument("--target-lang", default="tgt",
                        help="file suffix of the target side, e.g. train.TGT (default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the corpus files and corpus.json in a non-empty output "
                             "folder that holds no corpus made with these parameters (other files "
                             "in it are kept)")
    return parser


@exits_on_user_error("fairseq-kd-make-corpus")
def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # write_corpus checks every argument before it generates or writes anything
        outcome = synthetic.write_corpus(
            args.output_dir, seed=args.seed, train_size=args.train_size, valid_size=args.valid_size,
            test_size=args.test_size, source_lang=args.source_lang, target_lang=args.target_lang,
            force=args.force)
    except UserError as error:  # write_corpus's refusals (data.synthetic)
        parser.error(str(error))
    if outcome == "reused":
        print(f"{args.output_dir} already holds this corpus ({synthetic.MANIFEST_NAME} matches the "
              f"parameters and checksums); skipping generation")
    else:
        sizes = f"{args.train_size}/{args.valid_size}/{args.test_size}"
        print(f"wrote train/valid/test ({sizes} pairs) .{args.source_lang}/.{args.target_lang} "
              f"to {args.output_dir}")


if __name__ == "__main__":
    cli_main()
