"""Binarise raw parallel text in a Hugging Face teacher's vocabulary (``fairseq-kd-hf-data``).

Usage::

    fairseq-kd-hf-data --teacher opus-mt-de-en/ -s de -t en \\
        --trainpref raw/train --validpref raw/valid --testpref raw/test --destdir data-bin/de-en.hf

How: ``docs/design/commands.md``.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import (FILE, FOLDER, OUTPUT_FOLDER, FileAccessError, InputError, message_of, require_path,
                               undecodable_text_message)

PROG = "fairseq-kd-hf-data"
#: fairseq's ``</s>`` and its first ordinary symbol (fairseq.data.Dictionary: ``<s> <pad> </s> <unk>``)
FAIRSEQ_EOS, FAIRSEQ_FIRST_SYMBOL = 2, 4
#: lines tokenised per call of the tokenizer
CHUNK_LINES = 1000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tokenise raw parallel text with a Hugging Face teacher's tokenizer and write "
        "fairseq binarised data whose dictionaries are the teacher's vocabulary (for "
        "--teacher-checkpoint DIR with word_kd or selective_kd).")
    parser.add_argument("--teacher", required=True, help="the teacher's save_pretrained folder (config.json, "
                        "weights and tokenizer files); read offline")
    parser.add_argument("-s", "--source-lang", required=True, help="source language: files PREF.SRC")
    parser.add_argument("-t", "--target-lang", required=True, help="target language: files PREF.TGT")
    parser.add_argument("--trainpref", required=True, help="training text prefix (PREF.SRC, PREF.TGT)")
    parser.add_argument("--validpref", help="validation text prefix")
    parser.add_argument("--testpref", help="test text prefix")
    parser.add_argument("--destdir", required=True, help="output folder (created if missing)")
    parser.add_argument("--teacher-source-lang", help="the tokenizer's code of the source language for "
                        "multilingual teachers (M2M100: de; NLLB: deu_Latn); default: -s")
    parser.add_argument("--teacher-target-lang", help="the tokenizer's code of the target language "
                        "(M2M100: en; NLLB: eng_Latn); default: -t")
    parser.add_argument("--overwrite", action="store_true", help="replace output files that exist")
    return parser


def read_lines(path: Path) -> Iterator[List[str]]:
    """The lines of ``path`` (without their newline), in chunks."""
    chunk: List[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            chunk.append(line.rstrip("\n"))
            if len(chunk) == CHUNK_LINES:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def set_languages(tokenizer, args) -> None:
    """Tell a multilingual tokenizer the language codes (it puts their tags); refuse codes for a
    tokenizer without languages, and codes it does not know."""
    multilingual = hasattr(tokenizer, "src_lang") and hasattr(tokenizer, "tgt_lang")
    if not multilingual:
        if args.teacher_source_lang or args.teacher_target_lang:
            raise InputError(f"--teacher-source-lang/--teacher-target-lang: the tokenizer of --teacher "
                             f"{args.teacher!r} takes no language codes; drop them")
        return
    for flag, attribute, code in (("--teacher-source-lang", "src_lang", args.teacher_source_lang or args.source_lang),
                                  ("--teacher-target-lang", "tgt_lang", args.teacher_target_lang or args.target_lang)):
        try:
            setattr(tokenizer, attribute, code)
            tag_id = tokenizer.convert_tokens_to_ids(tokenizer.get_lang_token(code)) if hasattr(
                tokenizer, "get_lang_token") else tokenizer.convert_tokens_to_ids(code)
        except (KeyError, ValueError) as err:
            raise InputError(f"{flag} {code!r}: the teacher's tokenizer does not know this language code "
                             f"({err}); pass its code (M2M100: de, NLLB: deu_Latn)") from None
        if tag_id is None or tag_id == tokenizer.unk_token_id:
            raise InputError(f"{flag} {code!r}: the teacher's tokenizer does not know this language code; "
                             "pass its code (M2M100: de, NLLB: deu_Latn)")


def encode_chunk(tokenizer, vocabulary, lines: List[str], target: bool) -> List[List[int]]:
    """fairseq indices of ``lines`` (of the side ``target`` says) without the closing ``</s>``, which
    fairseq's binarisation appends."""
    encoded = tokenizer(text_target=lines) if target else tokenizer(lines)
    eos = vocabulary.hf_id_of_fairseq[FAIRSEQ_EOS]
    rows = []
    for hf_ids in encoded["input_ids"]:
        if not hf_ids or hf_ids[-1] != eos:
            raise InputError(f"the teacher's tokenizer does not end sentences with its {tokenizer.eos_token!r} "
                             "(fairseq appends one to every sentence), so it is not supported")
        rows.append(vocabulary.to_fairseq(hf_ids[:-1]))
    return rows


def decode_fairseq_ids(tokenizer, vocabulary, fairseq_ids: Sequence[int], source: bool = False) -> str:
    """The text of a binarised sentence (fairseq indices of the side ``vocabulary`` maps) as the
    teacher's tokenizer decodes it with ``skip_special_tokens``."""
    hf_ids = vocabulary.to_hf(fairseq_ids)
    if source and getattr(tokenizer, "separate_vocabs", False):
        # transformers' MarianTokenizer turns ids into tokens through its target vocabulary only,
        # so a source sentence of separate vocabularies is read through the source map's symbols
        # and the source SentencePiece model, as the tokenizer's decode does for a shared one
        pieces = [vocabulary.fairseq_symbols[i] for i in fairseq_ids if i >= FAIRSEQ_FIRST_SYMBOL]
        return tokenizer.spm_source.decode_pieces(pieces).replace("\u2581", " ").strip()
    return tokenizer.decode(hf_ids, skip_special_tokens=True)


def binarise_split(tokenizer, vocabulary, dictionary, text_prefix: str, output_prefix: Path, lang: str,
                   target: bool, counts: Optional[Counter] = None, flag: str = "--trainpref") -> int:
    """Write ``output_prefix.LANG.{bin,idx}`` with fairseq's builder from ``text_prefix.LANG`` (given
    by ``flag``); returns the sentence count (``counts``, if given, counts the split's symbols)."""
    import torch
    from fairseq.data import indexed_dataset

    source = require_path(f"{text_prefix}.{lang}", flag, FILE)
    prefix = f"{output_prefix}.{lang}"
    builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(prefix), impl="mmap",
                                           vocab_size=len(dictionary))
    sentences = 0
    try:
        for chunk in read_lines(source):
            for row in encode_chunk(tokenizer, vocabulary, chunk, target):
                builder.add_item(torch.IntTensor(row + [dictionary.eos()]))
                if counts is not None:
                    counts.update(vocabulary.fairseq_symbols[i] for i in row)
                sentences += 1
    except UnicodeDecodeError as err:
        raise InputError(undecodable_text_message(err, source)) from None
    builder.finalize(indexed_dataset.index_file_path(prefix))
    return sentences


def given_splits(args) -> List[Tuple[str, str]]:
    """``(split, text prefix)`` of each split given."""
    return [(split, pref) for split, pref in (("train", args.trainpref), ("valid", args.validpref),
                                              ("test", args.testpref)) if pref]


def output_files(args) -> List[Path]:
    dest, pair = Path(args.destdir), f"{args.source_lang}-{args.target_lang}"
    files = [dest / f"dict.{lang}.txt" for lang in (args.source_lang, args.target_lang)]
    for split, pref in given_splits(args):
        files += [dest / f"{split}.{pair}.{lang}.{ext}" for lang in (args.source_lang, args.target_lang)
                  for ext in ("bin", "idx")]
    return files


@exits_on_user_error(PROG)
def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    from fairseq_kd.models.hf_teacher import load_tokenizer, read_checked_config, vocabulary_maps
    from fairseq_kd.models.teacher import TeacherCheckpointError

    teacher = require_path(args.teacher, "--teacher", FOLDER, "give the teacher's save_pretrained folder")
    if args.source_lang == args.target_lang:
        raise InputError("-s and -t must differ (fairseq names the files by language)")
    for split, pref in given_splits(args):
        for lang in (args.source_lang, args.target_lang):
            require_path(f"{pref}.{lang}", f"--{split}pref", FILE, f"--{split}pref PREFIX reads PREFIX.{lang}")
    require_path(args.destdir, "--destdir", OUTPUT_FOLDER)
    existing = [str(f) for f in output_files(args) if f.exists()]
    if existing and not args.overwrite:
        raise InputError(f"--destdir {args.destdir!r} already holds {existing[0]}"
                         f"{f' and {len(existing) - 1} more' if len(existing) > 1 else ''}; pass --overwrite "
                         "to replace them, or another --destdir")
    try:  # the teacher loader's refusals name training's flag; here the folder is --teacher
        config, _, _ = read_checked_config(teacher)
        tokenizer = load_tokenizer(teacher)
        source_vocabulary, target_vocabulary = vocabulary_maps(teacher, tokenizer, config)
    except TeacherCheckpointError as err:
        raise InputError(str(err).replace("--teacher-checkpoint", "--teacher", 1)) from None
    set_languages(tokenizer, args)
    try:
        write_data(args, teacher, tokenizer, source_vocabulary, target_vocabulary)
    except OSError as err:  # --destdir's files cannot be written
        raise FileAccessError(message_of(err)) from None


def write_data(args, teacher, tokenizer, source_vocabulary, target_vocabulary) -> None:
    """Binarise every split given into --destdir and write the dictionaries."""
    dest = Path(args.destdir)
    dest.mkdir(parents=True, exist_ok=True)
    pair = f"{args.source_lang}-{args.target_lang}"
    sides = ((args.source_lang, False, source_vocabulary), (args.target_lang, True, target_vocabulary))
    counts = {args.source_lang: Counter(), args.target_lang: Counter()}
    for split, pref in given_splits(args):
        sizes = [binarise_split(tokenizer, vocabulary, vocabulary.dictionary(), pref, dest / f"{split}.{pair}",
                                lang, target, counts[lang] if split == "train" else None, f"--{split}pref")
                 for lang, target, vocabulary in sides]
        if sizes[0] != sizes[1]:
            raise InputError(f"{pref}.{args.source_lang} has {sizes[0]} lines but {pref}.{args.target_lang} "
                             f"has {sizes[1]}; parallel files need one sentence per line on both sides")
        print(f"{PROG}: {split}: {sizes[0]} sentence pairs")
    for lang, _, vocabulary in sides:
        vocabulary.dictionary(counts[lang]).save(str(dest / f"dict.{lang}.txt"))
    if source_vocabulary is target_vocabulary:
        print(f"{PROG}: wrote {dest} ({len(target_vocabulary)} symbols, the vocabulary of {teacher})")
    else:
        print(f"{PROG}: wrote {dest} ({len(source_vocabulary)} source and {len(target_vocabulary)} target symbols, "
              f"the vocabularies of {teacher})")


if __name__ == "__main__":
    cli_main()
