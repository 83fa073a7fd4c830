"""Run a teacher once over a binarised training set and keep its top-k next-token log-probabilities
per target token, for ``fairseq-train --task translation_kd --teacher-cache DIR`` (word_kd,
selective_kd) without a teacher forward pass per step.

    fairseq-kd-teacher-cache --data data-bin/iwslt14.de-en --teacher-checkpoint teacher.pt \\
        --output data-bin/iwslt14.de-en/teacher-top8 --k 8

Resumable and shardable across workers as ``fairseq-kd-seqkd`` (``docs/design/commands.md``); format
and checks: ``fairseq_kd/teacher_pass/teacher_cache.py``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from fairseq_kd.cli.flags import add_config_flags
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import FOLDER, OUTPUT_FOLDER, path_problem


def build_parser() -> argparse.ArgumentParser:
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig

    parser = argparse.ArgumentParser(prog="fairseq-kd-teacher-cache", description=__doc__.split("\n\n")[0])
    add_config_flags(parser, CacheConfig)
    return parser


@exits_on_user_error("fairseq-kd-teacher-cache")
def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the libraries' INFO lines (fairseq's, once per worker) stay off the terminal, as in fairseq-kd-seqkd
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, TeacherCacheError, build_cache
    from fairseq_kd.models.teacher import TeacherCheckpointError

    for flag, path, expected in (("--data", args.data, FOLDER), ("--output", args.output, OUTPUT_FOLDER)):
        problem = path_problem(path, expected)
        if problem is not None:
            parser.error(f"{flag} {str(path)!r}: {problem}")
    try:
        build_cache(CacheConfig(**vars(args)))
    except (TeacherCacheError, TeacherCheckpointError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    cli_main()
