"""Decode a binarised split with a CTranslate2 model or a Hugging Face teacher, in fairseq-generate's
output format.

    fairseq-kd-export checkpoints/student/checkpoint_best.pt student-int8 --format ctranslate2
    fairseq-kd-translate data-bin/iwslt14.de-en --model student-int8 --gen-subset test --beam 5 \\
        --batch-size 32 --threads 2 --remove-bpe --results-path gen/student-int8
    fairseq-kd-translate data-bin/de-en.hf --model opus-mt-de-en/ --gen-subset test --results-path gen/teacher

How: ``docs/design/commands.md``.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from fairseq_kd.cli.flags import add_overwrite_flag
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import FOLDER, OUTPUT_FOLDER, FileAccessError, InputError, message_of, require_path


def build_parser() -> argparse.ArgumentParser:
    from fairseq_kd.deploy.ctranslate2_engine import COMPUTE_TYPES, DEVICES

    parser = argparse.ArgumentParser(prog="fairseq-kd-translate", description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="binarised data folder (fairseq-preprocess --destdir) with the split to decode")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="CTranslate2 model folder (fairseq-kd-export CKPT DIR --format ctranslate2), or a "
                             "Hugging Face save_pretrained folder (its own generate; the data binarised in its "
                             "vocabulary by fairseq-kd-hf-data)")
    parser.add_argument("--gen-subset", default="test", help="split to decode (default: %(default)s)")
    parser.add_argument("-s", "--source-lang", default=None, help="source language (default: from the file names)")
    parser.add_argument("-t", "--target-lang", default=None, help="target language (default: from the file names)")
    parser.add_argument("--beam", type=int, default=5, help="beam size (default: %(default)s)")
    parser.add_argument("--lenpen", type=float, default=1.0,
                        help="length penalty: scores are divided by length**lenpen (default: %(default)s)")
    parser.add_argument("--max-len-a", type=float, default=0.0,
                        help="at most max_len_a * S + max_len_b target tokens, S the batch's longest source "
                             "(default: %(default)s)")
    parser.add_argument("--max-len-b", type=int, default=200, help="see --max-len-a (default: %(default)s)")
    parser.add_argument("--min-len", type=int, default=1, help="at least this many tokens before </s> (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N", help="sentences per batch")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="source tokens per batch (default: 12000 when --batch-size is not given either)")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CTranslate2 threads on the CPU: N > 1 decodes each batch as N parts in parallel, one "
                             "thread each (0: CTranslate2's default); a Hugging Face model: torch's threads")
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="where to decode (default: %(default)s)")
    parser.add_argument("--compute-type", default="default", choices=COMPUTE_TYPES,
                        help="CTranslate2 compute type (default: the type the model was exported in); a Hugging "
                             "Face model decodes in float32 (default), or float16 on CUDA")
    parser.add_argument("--remove-bpe", "--post-process", dest="post_process", nargs="?", const="@@ ", default=None,
                        help="remove BPE from the H-/D- lines as fairseq-generate does (subword_nmt, sentencepiece, "
                             "or a continuation marker; bare flag: '@@ ')")
    parser.add_argument("--results-path", default=None, metavar="DIR",
                        help="write DIR/generate-SUBSET.txt (default: standard output)")
    add_overwrite_flag(parser, "an existing RESULTS_PATH/generate-SUBSET.txt")
    return parser


@exits_on_user_error("fairseq-kd-translate")
def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    translate(args)


def _output_path(args) -> Optional[Path]:
    if args.results_path is None:
        return None
    folder = require_path(args.results_path, "--results-path", OUTPUT_FOLDER,
                          f"give a folder (the output is FOLDER/generate-{args.gen_subset}.txt)")
    path = folder / f"generate-{args.gen_subset}.txt"
    if path.exists() and not args.overwrite:
        raise InputError(f"--results-path: {path} already exists; choose another folder or pass --overwrite")
    return path


def translate(args) -> dict:
    """Decode ``args.gen_subset`` of ``args.data`` with ``args.model``; returns the timing summary."""
    _check_settings(args)
    data = require_path(args.data, "DATA", FOLDER, "give the binarised data folder (fairseq-preprocess --destdir)")
    output_path = _output_path(args)

    import fairseq_kd

    fairseq_kd.register()
    from fairseq_kd.deploy.ctranslate2_engine import CTranslate2Engine, DecodingSettings
    from fairseq_kd.deploy.ctranslate2_folder import looks_like_ctranslate2_folder
    from fairseq_kd.models.teacher import is_hugging_face_folder

    task = _translation_task(args, data)
    # a CTranslate2 folder has a config.json too: its model.bin, vocabulary or record tells it
    # apart (even when that model.bin is missing: the engine then says so)
    hugging_face = is_hugging_face_folder(args.model) and not looks_like_ctranslate2_folder(args.model)
    if hugging_face:
        _check_hugging_face_settings(args)
    else:
        engine = CTranslate2Engine(args.model, task.source_dictionary, task.target_dictionary, device=args.device,
                                   threads=args.threads, compute_type=args.compute_type)
    task.load_dataset(args.gen_subset)
    dataset = task.dataset(args.gen_subset)
    if hugging_face:
        engine = _hugging_face_engine(args, task, dataset)
    batches = _batches(dataset, args)
    settings = DecodingSettings(beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                                max_len_b=args.max_len_b, min_len=args.min_len)
    lines, sentences, tokens, seconds = [], 0, 0, 0.0
    for batch in batches:
        items = [dataset[int(i)] for i in batch]
        longest_source = max(len(item["source"]) for item in items)
        start = time.perf_counter()
        hypotheses = engine.translate([item["source"].tolist() for item in items], settings,
                                      longest_source=longest_source)
        seconds += time.perf_counter() - start
        for item, hypothesis in zip(items, hypotheses):
            lines.extend(_generate_lines(item, hypothesis, task, args.post_process))
            sentences += 1
            tokens += len(hypothesis.tokens)
    rate, token_rate = (sentences / seconds, tokens / seconds) if seconds > 0 else (0.0, 0.0)
    translated = (f"Translated {sentences:,} sentences ({tokens:,} tokens) in {seconds:.1f}s ({rate:.2f} sentences/s, "
                  f"{token_rate:.2f} tokens/s)")
    lines.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} | INFO | fairseq_kd.cli.translate | {translated}")
    if hugging_face:
        lines.append(f"Generate {args.gen_subset} with beam={args.beam}: Hugging Face model {args.model} "
                     f"({engine.hf_model.config.model_type}, {next(engine.hf_model.parameters()).dtype}, "
                     f"{args.device}); score with fairseq-kd-score")
    else:
        quantization = engine.record.get("quantization", "unknown")
        lines.append(f"Generate {args.gen_subset} with beam={args.beam}: CTranslate2 model {args.model} "
                     f"({quantization}, compute type {args.compute_type}, {args.device}); score with fairseq-kd-score")
    text = "\n".join(lines) + "\n"
    if output_path is None:
        sys.stdout.write(text)
    else:
        from fairseq_kd.teacher_pass.common import replace_atomically

        try:
            output_path.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(output_path, lambda handle: handle.write(text.encode("utf-8")))
        except OSError as err:  # --results-path cannot be written
            raise FileAccessError(message_of(err)) from None
        print(f"{translated}: {output_path}", file=sys.stderr)
    return {"sentences": sentences, "tokens": tokens, "seconds": seconds}


def _check_settings(args) -> None:
    """The decoding and batching settings, checked before anything is read."""
    if args.beam < 1:
        raise InputError(f"--beam must be >= 1, got {args.beam}")
    if (args.batch_size is not None and args.batch_size < 1) or (args.max_tokens is not None and args.max_tokens < 1):
        raise InputError("--batch-size and --max-tokens must be positive")
    if args.max_len_b < 1 or args.max_len_a < 0 or args.min_len < 0:
        raise InputError("--max-len-b must be >= 1, --max-len-a and --min-len >= 0")


def _check_hugging_face_settings(args) -> None:
    """What a Hugging Face model can be asked for, checked before it is read."""
    import torch

    if args.compute_type not in ("default", "float32", "float16"):
        raise InputError(f"--compute-type {args.compute_type}: a Hugging Face --model decodes in float32 or "
                         "float16 (CUDA only)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: torch sees no CUDA device here; use --device cpu")
    if args.compute_type == "float16" and args.device != "cuda":
        raise InputError("--compute-type float16 needs --device cuda for a Hugging Face --model")


def _hugging_face_engine(args, task, dataset):
    """The Hugging Face model of ``--model`` (checked against the data's dictionaries symbol for
    symbol, as training checks it) as a decoding engine on ``--device``."""
    import torch

    from fairseq_kd.deploy.hf_engine import HuggingFaceEngine, first_target_symbol
    from fairseq_kd.models.hf_teacher import HuggingFaceTeacher
    from fairseq_kd.models.teacher import FLAG, TeacherCheckpointError

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        teacher = HuggingFaceTeacher.load(args.model, task)
    except TeacherCheckpointError as err:
        # the teacher loader names the training flag; here the folder came with --model
        message = str(err)
        raise TeacherCheckpointError("--model" + message[len(FLAG):] if message.startswith(FLAG) else message) from None
    model = teacher.model.to(args.device)
    if args.compute_type == "float16":
        model = model.half()
    return HuggingFaceEngine(model, first_target_symbol(args.model, dataset, task.target_dictionary, "--model"))


def _translation_task(args, data: Path):
    """fairseq's translation task on ``data`` (languages given or inferred), which must hold both
    dictionaries and the ``--gen-subset`` split."""
    from fairseq.data import data_utils
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    src, tgt = args.source_lang, args.target_lang
    if src is None or tgt is None:
        src, tgt = data_utils.infer_language_pair(str(data))
        if src is None or tgt is None:
            raise InputError(f"DATA {data}: cannot infer the language pair; pass --source-lang and --target-lang")
    for lang in (src, tgt):
        if not (data / f"dict.{lang}.txt").is_file():
            raise InputError(f"DATA {data}: no dict.{lang}.txt")
    if not any(data.glob(f"{args.gen_subset}.*-*.{src}.idx")):
        raise InputError(f"--gen-subset {args.gen_subset}: no binarised {args.gen_subset} split in {data}")
    return TranslationTask.setup_task(TranslationConfig(
        data=str(data), source_lang=src, target_lang=tgt, dataset_impl=None, required_seq_len_multiple=1))


def _batches(dataset, args):
    """fairseq-generate's batches: sentences by length (ties shuffled with --seed 1), cut by
    ``--max-tokens`` (default 12000 when neither it nor ``--batch-size`` is given) and ``--batch-size``."""
    from fairseq.data import data_utils

    max_tokens = args.max_tokens if args.max_tokens is not None or args.batch_size is not None else 12000
    with data_utils.numpy_seed(1):
        ordered = dataset.ordered_indices()
    if max_tokens is not None and len(dataset):
        longest = int(dataset.num_tokens_vec(ordered).max())
        if longest > max_tokens:
            raise InputError(f"--max-tokens {max_tokens} is smaller than the longest sentence ({longest} tokens)")
    return dataset.batch_by_size(ordered, max_tokens=max_tokens, max_sentences=args.batch_size,
                                 required_batch_size_multiple=1)


def _generate_lines(item: dict, hypothesis, task, post_process) -> list:
    """The S-, T-, H- and D- lines fairseq-generate prints for one sentence (fairseq_cli/generate.py),
    without --tokenizer/--bpe."""
    import torch
    from fairseq import utils

    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    eos = {tgt_dict.eos()}
    sentence_id = int(item["id"])
    src_str = src_dict.string(item["source"], post_process)
    lines = [f"S-{sentence_id}\t{src_str}"]
    if item.get("target") is not None:
        target_str = tgt_dict.string(item["target"], post_process, escape_unk=True, extra_symbols_to_ignore=eos)
        lines.append(f"T-{sentence_id}\t{target_str}")
    _, hypo_str, _ = utils.post_process_prediction(
        hypo_tokens=torch.tensor(hypothesis.tokens, dtype=torch.int), src_str=src_str, alignment=None,
        align_dict=None, tgt_dict=tgt_dict, remove_bpe=post_process, extra_symbols_to_ignore=eos)
    score = hypothesis.score / math.log(2)  # base 2, as fairseq-generate prints scores
    lines.append(f"H-{sentence_id}\t{score}\t{hypo_str}")
    lines.append(f"D-{sentence_id}\t{score}\t{hypo_str}")
    return lines


if __name__ == "__main__":
    cli_main()
