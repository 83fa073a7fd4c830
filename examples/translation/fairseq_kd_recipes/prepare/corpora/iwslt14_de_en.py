"""IWSLT'14 German-English, prepared exactly as fairseq's ``prepare-iwslt14.sh``.

* training data: ``train.tags.de-en.{de,en}`` without metadata lines, Moses-tokenised,
  cleaned with ``clean-corpus-n`` (ratio 1.5, 1 to 175 tokens), lowercased;
* valid: every 23rd line of the cleaned training data (7,283 pairs), train: the rest (160,239);
* test: IWSLT14.TED.dev2010, IWSLT14.TEDX.dev2012, IWSLT14.TED.tst2010, tst2011, tst2012
  concatenated in this order (6,750 pairs), ``’`` replaced by ``'`` (as fairseq's script does),
  tokenised and lowercased the same way.  ``raw/test.*`` keep the segments as the XML files have
  them (``’`` included): they are the references detokenised output is scored against;
* joint subword-nmt BPE with 10,000 merges learned on train.de + train.en, then fairseq-preprocess
  with a joined dictionary.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..archive import find_file
from ..bpe import apply_bpe_file, learn_joint_bpe
from ..download import RemoteFile
from ..errors import PrepareError
from ..iwslt import RIGHT_SINGLE_QUOTE, read_parallel_segments, read_parallel_train_tags, xml_set_path
from ..pipeline import Step
from ..textio import iter_lines, normalize_whitespace, write_lines
from ..tokenize import CleanRule, MosesConfig, clean_indices, moses_preprocess
from .common import SPLITS, PrepareContext, binarize_stage, pair, write_pair

CORPUS = "iwslt14.tokenized.de-en"
SOURCE, TARGET = "de", "en"
PAIR = f"{SOURCE}-{TARGET}"
RELEASE = "IWSLT14"

ARCHIVE = RemoteFile(
    name="de-en.tgz",
    urls=(
        "https://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
        "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
        "https://wit3.fbk.eu/archive/2014-01/texts/de/en/de-en.tgz",
    ),
    provenance="fairseq's copy of the WIT3 2014-01 release used by prepare-iwslt14.sh; the original "
    "WIT3 address no longer serves it. No published checksum: verified by length, sha256 printed.",
)

# fairseq's concatenation order for test.{de,en}.
TEST_SETS = ("TED.dev2010", "TEDX.dev2012", "TED.tst2010", "TED.tst2011", "TED.tst2012")
VALID_EVERY = 23
CLEAN_RULE = CleanRule(min_tokens=1, max_tokens=175, ratio=1.5)


def moses_config(lang: str) -> MosesConfig:
    """``tokenizer.perl -l LANG`` (escaping on, no -a) followed by ``lowercase.perl``."""
    return MosesConfig(lang=lang, lowercase=True)


@dataclass(frozen=True)
class Settings:
    bpe_merges: int = 10000
    keep_talk_headers: bool = True  # fairseq keeps <title>/<description> text in the training data

    def __post_init__(self) -> None:
        if self.bpe_merges < 1:
            raise PrepareError(f"--bpe-merges must be >= 1, got {self.bpe_merges}")


def split_every(lines: list[str], every: int) -> tuple[list[str], list[str]]:
    """(lines whose 1-based number is not a multiple of ``every``, lines whose number is).

    ``awk 'NR % 23 != 0'`` and ``awk 'NR % 23 == 0'`` of fairseq's script.
    """
    rest = [line for number, line in enumerate(lines, start=1) if number % every != 0]
    picked = [line for number, line in enumerate(lines, start=1) if number % every == 0]
    return rest, picked


def xml_test_files(folder, lang: str, sets=TEST_SETS):
    """The XML files of the test concatenation for ``lang``, in order."""
    return [xml_set_path(folder, RELEASE, name, PAIR, lang) for name in sets]


def prepare(ctx: PrepareContext, settings: Settings = Settings()) -> None:
    ctx.check_destination()
    extracted = ctx.unpack(ARCHIVE)
    tags = [find_file(extracted, f"train.tags.{PAIR}.{lang}", ARCHIVE.name) for lang in (SOURCE, TARGET)]
    folder = tags[0].parent
    raw, tok, bpe = ctx.path("raw"), ctx.path("tok"), ctx.path("bpe")

    # 1. Training text without metadata lines (the raw side is kept for the raw references).
    raw_tags = pair(raw, "train.tags", SOURCE, TARGET)

    def extract_train() -> None:
        source_lines, target_lines = read_parallel_train_tags(*tags, keep_talk_headers=settings.keep_talk_headers)
        write_pair(raw_tags, [normalize_whitespace(l) for l in source_lines], [normalize_whitespace(l) for l in target_lines])

    ctx.run(Step("train-text", extract_train, inputs=tags, outputs=list(raw_tags),
                 params={"keep_talk_headers": settings.keep_talk_headers}))

    # 2. Moses tokenisation + lowercasing (lowercasing after cleaning, as fairseq does, keeps the
    #    same pairs: it changes no token boundaries).
    tok_tags = pair(tok, "train.tags", SOURCE, TARGET)

    def tokenize_train() -> None:
        for lang, source_path, destination in zip((SOURCE, TARGET), raw_tags, tok_tags):
            write_lines(destination, moses_preprocess(iter_lines(source_path, progress=f"tokenize {source_path.name}"), moses_config(lang), ctx.workers))

    ctx.run(Step("tokenize-train", tokenize_train, inputs=list(raw_tags), outputs=list(tok_tags)))

    # 3. clean-corpus-n, then valid = every 23rd cleaned pair.
    split_outputs = [*pair(tok, "train", SOURCE, TARGET), *pair(tok, "valid", SOURCE, TARGET),
                     *pair(raw, "train", SOURCE, TARGET), *pair(raw, "valid", SOURCE, TARGET)]

    def clean_and_split() -> None:
        tokenized = [list(iter_lines(path)) for path in tok_tags]
        untokenized = [list(iter_lines(path)) for path in raw_tags]
        kept = clean_indices(tokenized[0], tokenized[1], CLEAN_RULE)
        for out_folder, sides in ((tok, tokenized), (raw, untokenized)):
            for lang, lines in zip((SOURCE, TARGET), sides):
                train, valid = split_every([" ".join(lines[i].split()) for i in kept], VALID_EVERY)
                write_lines(out_folder / f"train.{lang}", train)
                write_lines(out_folder / f"valid.{lang}", valid)

    ctx.run(Step("clean-split", clean_and_split, inputs=[*tok_tags, *raw_tags], outputs=split_outputs,
                 params={"rule": dataclasses.asdict(CLEAN_RULE), "valid_every": VALID_EVERY}))

    # 4. Test: the XML sets, concatenated, kept untouched in raw/ (the references); the tokenised
    #    copy has ’ straightened first, as fairseq's script, then is tokenised and lowercased.
    xml_files = {lang: xml_test_files(folder, lang) for lang in (SOURCE, TARGET)}
    raw_test = pair(raw, "test", SOURCE, TARGET)

    def extract_test() -> None:
        source_lines, target_lines = [], []
        for source_xml, target_xml in zip(xml_files[SOURCE], xml_files[TARGET]):
            source_part, target_part = read_parallel_segments(source_xml, target_xml, straighten_quotes=False)
            source_lines += source_part
            target_lines += target_part
        write_pair(raw_test, [normalize_whitespace(l) for l in source_lines], [normalize_whitespace(l) for l in target_lines])

    ctx.run(Step("test-text", extract_test, inputs=xml_files[SOURCE] + xml_files[TARGET], outputs=list(raw_test),
                 params={"sets": list(TEST_SETS), "straighten_quotes": False}))
    tok_test = pair(tok, "test", SOURCE, TARGET)

    def tokenize_test() -> None:
        for lang, source_path, destination in zip((SOURCE, TARGET), raw_test, tok_test):
            straightened = (line.replace(RIGHT_SINGLE_QUOTE, "'") for line in iter_lines(source_path, progress=f"tokenize {source_path.name}"))
            write_lines(destination, moses_preprocess(straightened, moses_config(lang), ctx.workers))

    ctx.run(Step("tokenize-test", tokenize_test, inputs=list(raw_test), outputs=list(tok_test),
                 params={"straighten_quotes": True}))

    # 5. Joint BPE.
    codes = bpe / "code"
    train_tok = list(pair(tok, "train", SOURCE, TARGET))
    ctx.run(Step("learn-bpe", lambda: learn_joint_bpe(train_tok, codes, settings.bpe_merges),
                 inputs=train_tok, outputs=[codes], params={"merges": settings.bpe_merges}))
    to_segment = [(tok / f"{split}.{lang}", bpe / f"{split}.{lang}") for split in SPLITS for lang in (SOURCE, TARGET)]

    def apply_all() -> None:
        for source_path, destination in to_segment:
            apply_bpe_file(codes, source_path, destination, ctx.workers)

    ctx.run(Step("apply-bpe", apply_all, inputs=[codes] + [s for s, _ in to_segment], outputs=[d for _, d in to_segment]))

    # 6. fairseq-preprocess.
    binarize_stage(
        ctx, CORPUS, SOURCE, TARGET, bpe, (codes, "bpe.code"),
        metadata={
            "subword": {"kind": "subword-nmt", "merges": settings.bpe_merges},
            "moses": {"lowercase": True, "aggressive_dash_splits": False, "escape": True},
            "keep_talk_headers": settings.keep_talk_headers,
            "sacrebleu_tokenize": "13a",
            "note": "IWSLT'14 De-En results are usually reported as BLEU on the tokenised, lowercased "
            "references (tok/), after removing BPE.",
        },
        tokenized_references=tok,
    )
