"""Sequence-level KD data (Kim & Rush, 2016): decode a binarised training split with the teacher.

Usage::

    fairseq-kd-seqkd --data data-bin/iwslt14.de-en --teacher-checkpoint checkpoints/teacher/checkpoint_best.pt \\
        --output data-bin/iwslt14.de-en.seqkd [--beam 5] [--max-tokens 4096] [--shard-size 10000] \\
        [--engine ctranslate2 [--ct2-quantization float32] [--threads 0]] \\
        [--nbest 5 --select chrf --remove-bpe subword_nmt --filter-keep-share 0.95]
    fairseq-kd-seqkd --data data-bin/de-en.opus --teacher-checkpoint opus-mt-de-en/ --output data-bin/de-en.opus.seqkd

Resumable, shardable across workers: ``docs/design/commands.md``, :mod:`fairseq_kd.teacher_pass.seqkd`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from fairseq_kd.cli.flags import add_config_flags
from fairseq_kd.errors import UserError, message_of
from fairseq_kd.teacher_pass import seqkd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairseq-kd-seqkd",
        description="Beam-decode a binarised training split with a teacher and write a new binarised "
                    "dataset whose targets are the teacher's outputs (sequence-level KD).")
    add_config_flags(parser, seqkd.SeqKDConfig)
    return parser


def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    config = seqkd.SeqKDConfig(**vars(args))
    try:
        result = seqkd.run(config, log=lambda line: print(line, flush=True))
    except UserError as error:
        parser.error(message_of(error))
    if not result.reports:  # a rank other than 0: rank 0 speaks for the ranks
        return
    if result.status == "partial":
        stopped = "stopped after --max-shards: " if config.max_shards is not None else ""
        print(f"{result.worker}{stopped}{result.shards_done}/{result.shards_total} shards done; "
              "re-run the same command to continue")
    elif result.status == "complete":
        print(f"wrote {result.summary['pairs'] if result.summary else result.sentences} sentence pairs to {result.output}")
    if result.summary and result.summary["pairs"] != result.sentences:  # n-best, filtered or mixed
        summary = result.summary
        print(f"{summary['pairs']} training pairs: {summary['distilled_pairs']} distilled (mean chosen rank "
              f"{summary['mean_chosen_rank']:.2f}), {summary['filtered_pairs']} removed by the cross-entropy filter, "
              f"{summary['original_pairs']} original")
    if result.decoded_now:
        print(f"{result.worker}teacher decoding throughput: {result.decoded_now} sentences in "
              f"{result.decode_seconds:.1f} s = {result.sentences_per_second:.1f} sentences/s")


if __name__ == "__main__":
    cli_main()
