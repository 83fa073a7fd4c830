"""Run a teacher once over a binarised training set and keep its top-k next-token log-probabilities
per target token, for ``fairseq-train --task translation_kd --teacher-cache DIR`` (word_kd,
selective_kd) without a teacher forward pass per step.

    fairseq-kd-teacher-cache --data data-bin/iwslt14.de-en --teacher-checkpoint teacher.pt \\
        --output data-bin/iwslt14.de-en/teacher-top8 --k 8

Resumable: re-running after an interruption finishes the shards not yet written; re-running on a
finished cache of the same teacher, data and k does nothing. Format: ``fairseq_kd/data/teacher_cache.py``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

from fairseq_kd.cli.user_errors import exits_on_user_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairseq-kd-teacher-cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="fairseq-preprocess --destdir of the training data")
    parser.add_argument("--teacher-checkpoint", type=Path, required=True, help="the teacher (fairseq checkpoint)")
    parser.add_argument("--output", type=Path, required=True, help="folder of the cache (created)")
    parser.add_argument("--k", type=int, default=8, help="log-probabilities kept per token (default: %(default)s)")
    parser.add_argument("--split", default="train", help="binarised split to cover (default: %(default)s)")
    parser.add_argument("--source-lang", default=None, help="source language (default: inferred from --data)")
    parser.add_argument("--target-lang", default=None, help="target language (default: inferred from --data)")
    parser.add_argument("--teacher-data", default=None,
                        help="folder with the teacher's dictionaries, when its checkpoint's data folder is elsewhere")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per teacher batch (default: %(default)s)")
    parser.add_argument("--shard-size", type=int, default=5000,
                        help="sentences per resumable shard (default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is visible")
    parser.add_argument("--fp16", action="store_true", help="run the teacher in half precision (GPU)")
    return parser


@exits_on_user_error("fairseq-kd-teacher-cache")
def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    from fairseq_kd.data.teacher_cache import CacheConfig, TeacherCacheError, build_cache
    from fairseq_kd.models.teacher import TeacherCheckpointError

    if not args.data.is_dir():
        parser.error(f"--data {args.data}: no such folder")
    try:
        build_cache(CacheConfig(data=args.data, teacher_checkpoint=args.teacher_checkpoint, output=args.output,
                                k=args.k, split=args.split, max_tokens=args.max_tokens, shard_size=args.shard_size,
                                cpu=args.cpu, fp16=args.fp16, teacher_data=args.teacher_data,
                                source_lang=args.source_lang, target_lang=args.target_lang))
    except (TeacherCacheError, TeacherCheckpointError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    cli_main()
