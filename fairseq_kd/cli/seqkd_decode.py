"""Sequence-level KD data (Kim & Rush, 2016): decode a binarised training split with the teacher.

Usage::

    fairseq-kd-seqkd --data data-bin/iwslt14.de-en --teacher-checkpoint checkpoints/teacher/checkpoint_best.pt \\
        --output data-bin/iwslt14.de-en.seqkd [--beam 5] [--max-tokens 4096] [--shard-size 10000]

(or ``python -m fairseq_kd.cli.seqkd_decode``). The output folder is a binarised dataset for
``fairseq-train`` (any criterion): the teacher's beam-search outputs as training targets, the
original valid/test splits and dictionaries. An interrupted run resumes from its finished shards
when re-run with the same flags; a finished one is a no-op. See ``fairseq_kd/data/seqkd.py``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from fairseq_kd.cli.config_flags import add_config_flags
from fairseq_kd.data import seqkd


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
    from fairseq_kd.checkpoint_safety import UnsafeCheckpointError
    from fairseq_kd.models.teacher import TeacherCheckpointError

    config = seqkd.SeqKDConfig(**vars(args))
    try:
        result = seqkd.run(config, log=lambda line: print(line, flush=True))
    except (seqkd.SeqKDError, TeacherCheckpointError, UnsafeCheckpointError) as error:
        parser.error(str(error))
    if result.status == "partial":
        print(f"stopped after --max-shards: {result.shards_done}/{result.shards_total} shards done; "
              "re-run the same command to continue")
    elif result.status == "complete":
        print(f"wrote {result.sentences} sentence pairs to {result.output}")
    if result.decoded_now:
        print(f"teacher decoding throughput: {result.decoded_now} sentences in {result.decode_seconds:.1f} s "
              f"= {result.sentences_per_second:.1f} sentences/s")


if __name__ == "__main__":
    cli_main()
