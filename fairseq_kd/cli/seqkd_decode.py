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

from fairseq_kd.data import seqkd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairseq-kd-seqkd",
        description="Beam-decode a binarised training split with a teacher and write a new binarised "
                    "dataset whose targets are the teacher's outputs (sequence-level KD).")
    parser.add_argument("--data", required=True,
                        help="binarised data folder (fairseq-preprocess --destdir) holding dict.*.txt "
                             "and the split to decode")
    parser.add_argument("--teacher-checkpoint", required=True,
                        help="fairseq Transformer translation checkpoint trained with the same "
                             "dictionaries as --data")
    parser.add_argument("--teacher-data", default=None, metavar="DIR",
                        help="folder holding the teacher's dict.SRC.txt and dict.TGT.txt (its "
                             "fairseq-preprocess --destdir), to check symbol for symbol that the teacher "
                             "uses --data's dictionaries when the checkpoint cannot prove it (a teacher "
                             "not trained by translation_kd, whose data folder is not on this machine); "
                             "without any proof the teacher is refused")
    parser.add_argument("--output", required=True,
                        help="folder to write the new dataset into: new or empty, one this command "
                             "started with the same flags (resumed), or any folder with --force")
    parser.add_argument("--source-lang", default=None,
                        help="source language suffix; inferred from the file names like fairseq does "
                             "when either language is not given")
    parser.add_argument("--target-lang", default=None,
                        help="target language suffix; inferred like --source-lang")
    parser.add_argument("--split", default="train",
                        help="split to decode; the other splits are copied unchanged (default: %(default)s)")
    parser.add_argument("--beam", type=int, default=5,
                        help="beam size; the best hypothesis becomes the target (Kim & Rush: 5; "
                             "default: %(default)s)")
    parser.add_argument("--max-len-a", type=float, default=0.0,
                        help="hypotheses are at most max_len_a * source_length + max_len_b tokens, "
                             "source length of the batch's longest source (default: %(default)s)")
    parser.add_argument("--max-len-b", type=int, default=200,
                        help="see --max-len-a (default: %(default)s)")
    parser.add_argument("--lenpen", type=float, default=1.0,
                        help="length penalty of beam search, as in fairseq-generate (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=4096,
                        help="source tokens per decoding batch (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sentences per decoding batch (default: limited by --max-tokens only)")
    parser.add_argument("--shard-size", type=int, default=10000,
                        help="sentences per resumable shard: an interrupted run loses at most one "
                             "shard of work (default: %(default)s)")
    parser.add_argument("--max-shards", type=int, default=None,
                        help="decode at most this many new shards, then stop (re-run to continue); "
                             "splits a long job across sessions (default: all)")
    parser.add_argument("--fp16", action="store_true", help="decode in half precision (CUDA only)")
    parser.add_argument("--cpu", action="store_true",
                        help="decode on the CPU even when CUDA is available (default: CUDA if available)")
    parser.add_argument("--force", action="store_true",
                        help="use an --output folder that holds another dataset: its binarised files "
                             "(*.bin, *.idx, dict.*.txt) and previous seq-KD work are deleted first")
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
