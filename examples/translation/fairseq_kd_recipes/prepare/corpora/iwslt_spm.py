"""IWSLT (WIT3 release) corpora segmented with a joint SentencePiece model.

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..archive import find_file
from ..download import RemoteFile
from ..errors import PrepareError
from ..iwslt import available_xml_sets, read_parallel_segments, read_parallel_train_tags, xml_set_path
from ..pipeline import Step
from ..spm import SentencePieceConfig
from ..textio import iter_lines, normalize_whitespace, write_lines
from ..tokenize import CleanRule, MosesConfig, clean_indices, moses_preprocess
from .common import PrepareContext, binarize_stage, drop_empty_pairs, pair, sentencepiece_stage, write_pair
from .iwslt14_de_en import VALID_EVERY, split_every
from . import multitarget_ted
from .multitarget_ted import IWSLT14_TR_EN, MultitargetTedCorpus

FAIRSEQ_CLEAN_RULE = CleanRule(min_tokens=1, max_tokens=175, ratio=1.5)


@dataclass(frozen=True)
class IwsltCorpus:
    """A WIT3 archive and how it is split and cleaned.

    ``source``/``target`` are the codes of the prepared data (``train.pt``); ``archive_codes``
    spells them as the archive's file names do where that differs (``("pt-br", "en")``), and
    ``archive_pair`` joins those (``pt-br-en``, ``en-zh``): it names the folder and the files.
    ``valid_sets=None``: every 23rd cleaned training pair; ``test_sets=None``:
    every XML set of the archive.  ``moses_clean`` filters the raw training pairs by Moses token
    counts before any split; ``piece_clean`` filters the encoded training pairs.
    """

    name: str
    release: str
    source: str
    target: str
    archive: RemoteFile
    valid_sets: tuple[str, ...] | None
    test_sets: tuple[str, ...] | None
    moses_clean: CleanRule | None
    piece_clean: CleanRule | None
    spm_vocab_size: int
    spm_character_coverage: float
    sacrebleu_tokenize: str
    archive_codes: tuple[str, str] | None = None

    @property
    def archive_languages(self) -> tuple[str, str]:
        """Source and target as the archive's file names spell them."""
        return self.archive_codes or (self.source, self.target)

    @property
    def archive_pair(self) -> str:
        return "-".join(self.archive_languages)


def _wit3_2014(first: str, second: str) -> RemoteFile:
    """A pair's archive of the 2014-01 release, the languages spelt as WIT3 does (``pt-br``)."""
    pair = f"{first}-{second}"
    return RemoteFile(
        name=f"{pair}.tgz",
        urls=(
            f"https://wit3.fbk.eu/archive/2014-01/texts/{first}/{second}/{pair}.tgz",
            f"https://raw.githubusercontent.com/hlt-mt/WIT3/master/archive/2014-01/texts/{first}/{second}/{pair}.tgz",
        ),
        provenance="WIT3 2014-01 release (original address) and the WIT3 archive mirror on GitHub "
        "(the mirror sacreBLEU uses for the 2017 release; not verified for 2014). No published checksum.",
    )


IWSLT14_PT_EN = IwsltCorpus(
    name="iwslt14.spm.pt-en", release="IWSLT14", source="pt", target="en", archive=_wit3_2014("pt-br", "en"),
    valid_sets=None, test_sets=None, moses_clean=FAIRSEQ_CLEAN_RULE, piece_clean=None,
    spm_vocab_size=32000, spm_character_coverage=1.0, sacrebleu_tokenize="13a",
    archive_codes=("pt-br", "en"),
)
IWSLT17_EN_ZH = IwsltCorpus(
    name="iwslt17.spm.en-zh", release="IWSLT17", source="en", target="zh",
    archive=RemoteFile(
        name="en-zh.tgz",
        urls=(
            "https://raw.githubusercontent.com/hlt-mt/WIT3/master/archive/2017-01-trnted/texts/en/zh/en-zh.tgz",
            "https://wit3.fbk.eu/archive/2017-01-trnted/texts/en/zh/en-zh.tgz",
        ),
        md5="575b788dad6c5b9c5cee636f9ac1094a",
        provenance="WIT3 2017-01-trnted release; address and md5 as registered in sacreBLEU's dataset "
        "list (iwslt17/dev2010 ... iwslt17/tst2015).",
    ),
    valid_sets=("TED.dev2010",),
    test_sets=tuple(f"TED.tst{year}" for year in range(2010, 2016)),
    moses_clean=None,
    piece_clean=CleanRule(min_tokens=1, max_tokens=250, ratio=None),
    spm_vocab_size=16000, spm_character_coverage=0.9995, sacrebleu_tokenize="zh",
)
#: every pair of the SentencePiece IWSLT recipes; Tr-En is the Multitarget TED release
CORPORA: dict[str, IwsltCorpus | MultitargetTedCorpus] = {
    "pt-en": IWSLT14_PT_EN, "tr-en": IWSLT14_TR_EN, "en-zh": IWSLT17_EN_ZH,
}


@dataclass(frozen=True)
class Settings:
    """User choices on top of an :class:`IwsltCorpus` (``None`` keeps the corpus default)."""

    spm: SentencePieceConfig
    valid_sets: tuple[str, ...] | None = None
    test_sets: tuple[str, ...] | None = None
    piece_clean: CleanRule | None = None
    keep_talk_headers: bool = True


def _check_sets(requested: tuple[str, ...], available: list[str], flag: str, folder) -> None:
    missing = [name for name in requested if name not in available]
    if missing:
        raise PrepareError(
            f"{flag}: set(s) {', '.join(missing)} not in {folder} (available: {', '.join(available) or 'none'})"
        )


def prepare(ctx: PrepareContext, corpus: IwsltCorpus | MultitargetTedCorpus, settings: Settings) -> None:
    if isinstance(corpus, MultitargetTedCorpus):
        # The release has one train/dev/test1 split and no XML sets or talk headers to choose.
        chosen = [flag for flag, value in (("--valid-sets", settings.valid_sets), ("--test-sets", settings.test_sets),
                                           ("--drop-talk-headers", not settings.keep_talk_headers))
                  if value]
        if chosen:
            raise PrepareError(
                f"{', '.join(chosen)}: only for the WIT3 archives (pt-en); {corpus.source}-{corpus.target} "
                f"takes the dev and test1 sets of the Multitarget TED Talks release ({corpus.archive.name}): "
                "drop the flag"
            )
        multitarget_ted.prepare(ctx, corpus, settings.spm)
        return
    ctx.check_destination()
    source, target, archive_pair = corpus.source, corpus.target, corpus.archive_pair
    spelt = dict(zip((source, target), corpus.archive_languages))  # pt -> pt-br in file names
    extracted = ctx.unpack(corpus.archive)
    tags = [find_file(extracted, f"train.tags.{archive_pair}.{spelt[lang]}", corpus.archive.name)
            for lang in (source, target)]
    folder = tags[0].parent
    available = available_xml_sets(folder, corpus.release, archive_pair, spelt[source])
    valid_sets = settings.valid_sets if settings.valid_sets is not None else corpus.valid_sets
    test_sets = settings.test_sets if settings.test_sets is not None else corpus.test_sets
    test_sets = tuple(available) if test_sets is None else test_sets
    _check_sets(test_sets, available, "--test-sets", folder)
    if valid_sets is not None:
        _check_sets(valid_sets, available, "--valid-sets", folder)
        overlap = set(valid_sets) & set(test_sets)
        if overlap:
            raise PrepareError(f"--valid-sets and --test-sets share {', '.join(sorted(overlap))}")
    raw, tok = ctx.path("raw"), ctx.path("tok")

    # 1. Training text.
    raw_tags = pair(raw, "train.tags", source, target)

    def extract_train() -> None:
        source_lines, target_lines = read_parallel_train_tags(*tags, keep_talk_headers=settings.keep_talk_headers)
        source_lines = [normalize_whitespace(line) for line in source_lines]
        target_lines = [normalize_whitespace(line) for line in target_lines]
        write_pair(raw_tags, *drop_empty_pairs(source_lines, target_lines))

    ctx.run(Step("train-text", extract_train, inputs=tags, outputs=list(raw_tags),
                 params={"keep_talk_headers": settings.keep_talk_headers}))

    # 2. fairseq's cleaning by Moses token counts (Pt-En), then the validation split.
    selection_inputs = list(raw_tags)
    if corpus.moses_clean is not None:
        tok_tags = pair(tok, "train.tags", source, target)

        def tokenize_for_counting() -> None:
            for lang, source_path, destination in zip((source, target), raw_tags, tok_tags):
                write_lines(destination, moses_preprocess(iter_lines(source_path, progress=f"tokenize {source_path.name}"), MosesConfig(lang=lang), ctx.workers))

        ctx.run(Step("tokenize-train", tokenize_for_counting, inputs=list(raw_tags), outputs=list(tok_tags)))
        selection_inputs += list(tok_tags)
    split_outputs = list(pair(raw, "train", source, target))
    if valid_sets is None:
        split_outputs += list(pair(raw, "valid", source, target))

    def select_training_pairs() -> None:
        untokenized = [list(iter_lines(path)) for path in raw_tags]
        if corpus.moses_clean is not None:
            tokenized = [list(iter_lines(path)) for path in tok_tags]
            kept = clean_indices(tokenized[0], tokenized[1], corpus.moses_clean)
        else:
            kept = range(len(untokenized[0]))
        for lang, lines in zip((source, target), untokenized):
            selected = [lines[i] for i in kept]
            if valid_sets is None:
                selected, valid = split_every(selected, VALID_EVERY)
                write_lines(raw / f"valid.{lang}", valid)
            write_lines(raw / f"train.{lang}", selected)

    ctx.run(Step("select-train", select_training_pairs, inputs=selection_inputs, outputs=split_outputs,
                 params={"moses_clean": dataclasses.asdict(corpus.moses_clean) if corpus.moses_clean else None,
                         "valid_every": VALID_EVERY if valid_sets is None else None}))

    # 3. Held-out sets from the XML files.
    heldout = {"test": test_sets} if valid_sets is None else {"valid": valid_sets, "test": test_sets}
    xml_inputs = [xml_set_path(folder, corpus.release, name, archive_pair, spelt[lang])
                  for names in heldout.values() for name in names for lang in (source, target)]
    heldout_outputs = [path for split in heldout for path in pair(raw, split, source, target)]

    def extract_heldout() -> None:
        for split, names in heldout.items():
            source_lines, target_lines = [], []
            for name in names:
                source_part, target_part = read_parallel_segments(
                    xml_set_path(folder, corpus.release, name, archive_pair, spelt[source]),
                    xml_set_path(folder, corpus.release, name, archive_pair, spelt[target]),
                    straighten_quotes=False,
                )
                source_lines += [normalize_whitespace(line) for line in source_part]
                target_lines += [normalize_whitespace(line) for line in target_part]
            write_pair(pair(raw, split, source, target), source_lines, target_lines)

    ctx.run(Step("heldout-text", extract_heldout, inputs=xml_inputs, outputs=heldout_outputs,
                 params={split: list(names) for split, names in heldout.items()}))

    # 4. SentencePiece and binarisation.
    piece_clean = settings.piece_clean if settings.piece_clean is not None else corpus.piece_clean
    segmented = sentencepiece_stage(ctx, source, target, settings.spm, piece_clean)
    binarize_stage(
        ctx, corpus.name, source, target, segmented, (segmented / "spm.model", "spm.model"),
        metadata={
            "subword": {"kind": "sentencepiece", **settings.spm.model_settings()},
            "valid_sets": list(valid_sets) if valid_sets is not None else f"every {VALID_EVERY}th cleaned training pair",
            "test_sets": list(test_sets),
            "keep_talk_headers": settings.keep_talk_headers,
            "sacrebleu_tokenize": corpus.sacrebleu_tokenize,
        },
    )
