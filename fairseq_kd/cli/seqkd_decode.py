"""Sequence-level KD data (Kim & Rush, 2016): decode a binarised training split with the teacher.

Usage::

    fairseq-kd-seqkd --data data-bin/iwslt14.de-en --teacher-checkpoint checkpoints/teacher/checkpoint_best.pt \\
        --output data-bin/iwslt14.de-en.seqkd [--beam 5] [--max-tokens 4096] [--shard-size 10000] \\
        [--engine ctranslate2 [--ct2-quantization float32] [--threads 0]]
    fairseq-kd-seqkd --data data-bin/de-en.opus --teacher-checkpoint opus-mt-de-en/ --output data-bin/de-en.opus.seqkd

(or ``python -m fairseq_kd.cli.seqkd_decode``). The output folder is a binarised dataset for
``fairseq-train`` (any criterion): the teacher's beam-search outputs as training targets, the
original valid/test splits and dictionaries. An interrupted run resumes from its finished shards
when re-run with the same flags; a finished one is a no-op.

Several workers share the pass the fairseq way, all writing into the same ``--output`` (on a shared
filesystem): a job array's ``--num-shards N --shard-id I`` (worker I decodes the shards i with
i % N == I; the one that writes the last shard binarises), or the ranks of ``torchrun
--nproc_per_node G -m fairseq_kd.cli.seqkd_decode ...`` or of ``srun`` (each rank on GPU
LOCAL_RANK; rank 0 binarises after the others). The output is one process's, byte for byte.

``--engine ctranslate2`` decodes with CTranslate2 instead of fairseq's ``SequenceGenerator`` (the
``deploy`` extra): the teacher is converted once per run into ``OUTPUT/seqkd_work/`` with
``--ct2-quantization`` weights (float32 by default, which gives fairseq's tokens with beam 1 and on
most sentences with beam 5; float16 or int8_float16 on CUDA instead of ``--fp16``), decoded with
``--threads`` intra-op threads, on CUDA when available and not ``--cpu``. Same batches, length
limits, shards and output; the engine is part of what a resumed run must repeat.

A Hugging Face teacher (``--teacher-checkpoint DIR``, a ``save_pretrained`` folder; the data
binarised in its vocabulary by ``fairseq-kd-hf-data``) decodes with its own ``generate`` under the
same rules (``--engine transformers``, what the default ``--engine auto`` chooses for a folder; the
``hf`` extra). See ``fairseq_kd/teacher_pass/seqkd.py``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from fairseq_kd.cli.flags import add_config_flags
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
    from fairseq_kd.checkpoints import UnsafeCheckpointError
    from fairseq_kd.deploy import CTranslate2MissingError
    from fairseq_kd.deploy.ctranslate2_engine import CTranslate2ModelError
    from fairseq_kd.deploy.export_ctranslate2 import CTranslate2ExportError
    from fairseq_kd.models.teacher import TeacherCheckpointError

    config = seqkd.SeqKDConfig(**vars(args))
    try:
        result = seqkd.run(config, log=lambda line: print(line, flush=True))
    except (seqkd.SeqKDError, TeacherCheckpointError, UnsafeCheckpointError, CTranslate2MissingError,
            CTranslate2ExportError, CTranslate2ModelError) as error:
        parser.error(str(error))
    if not result.reports:  # a rank other than 0: rank 0 speaks for the ranks
        return
    if result.status == "partial":
        stopped = "stopped after --max-shards: " if config.max_shards is not None else ""
        print(f"{result.worker}{stopped}{result.shards_done}/{result.shards_total} shards done; "
              "re-run the same command to continue")
    elif result.status == "complete":
        print(f"wrote {result.sentences} sentence pairs to {result.output}")
    if result.decoded_now:
        print(f"{result.worker}teacher decoding throughput: {result.decoded_now} sentences in "
              f"{result.decode_seconds:.1f} s = {result.sentences_per_second:.1f} sentences/s")


if __name__ == "__main__":
    cli_main()
