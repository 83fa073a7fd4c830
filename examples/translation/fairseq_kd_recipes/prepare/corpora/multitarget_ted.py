"""Turkish-English of the Multitarget TED Talks Task (Duh 2018): the CKD paper's Tr-En splits.

The CKD paper (Wu et al., 2020, section 4) calls its Tr-En data IWSLT-2014 but gives 142K / 1,958
/ 1,982 train/dev/test sentences and points to http://cs.jhu.edu/~kevinduh/a/multitarget-tedtalks/
in a footnote: 1,958 and 1,982 are that task's dev and test1 sets (TED talks taken from WIT3 and
split anew, the same 30 + 30 talks for every language).  So the splits are the release's own:

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..archive import find_file
from ..download import RemoteFile
from ..pipeline import Step
from ..spm import SentencePieceConfig
from ..textio import iter_lines, write_lines
from ..tokenize import CleanRule, MosesConfig, clean_indices, moses_preprocess
from .common import SPLITS, PrepareContext, binarize_stage, pair, sentencepiece_stage, write_raw_splits
from .iwslt14_de_en import CLEAN_RULE

_PAGE = "https://www.cs.jhu.edu/~kevinduh/a/multitarget-tedtalks/"
ARCHIVE = RemoteFile(
    name="multitarget-ted.tgz",
    urls=(_PAGE + "multitarget-ted.tgz", _PAGE.replace("https:", "http:", 1) + "multitarget-ted.tgz"),
    provenance="Multitarget TED Talks Task (Kevin Duh, 2018), address as in Duh's "
    "sockeye-recipes egs/ted/0_download_data.sh; no published checksum (about 575 MB).",
)

#: split -> the release's name of the set (``ted_dev`` in ``ted_dev_en-tr.raw.tr``)
SETS = {"train": "ted_train", "valid": "ted_dev", "test": "ted_test1"}


@dataclass(frozen=True)
class MultitargetTedCorpus:
    """One language of the release, translated into or out of English.

    The release names every folder and file ``en-<lang>`` whatever the direction, so
    ``foreign`` (the non-English code) names them; ``source``/``target`` are the prepared data's.
    """

    name: str
    source: str
    target: str
    archive: RemoteFile
    moses_clean: CleanRule
    spm_vocab_size: int
    spm_character_coverage: float
    sacrebleu_tokenize: str

    @property
    def foreign(self) -> str:
        return self.source if self.target == "en" else self.target

    def file_name(self, split: str, lang: str) -> str:
        """``ted_dev_en-tr.raw.tr``: the untokenised text of ``split`` in ``lang``."""
        return f"{SETS[split]}_en-{self.foreign}.raw.{lang}"


IWSLT14_TR_EN = MultitargetTedCorpus(
    name="iwslt14.spm.tr-en", source="tr", target="en", archive=ARCHIVE, moses_clean=CLEAN_RULE,
    spm_vocab_size=32000, spm_character_coverage=1.0, sacrebleu_tokenize="13a",
)


def prepare(ctx: PrepareContext, corpus: MultitargetTedCorpus, spm: SentencePieceConfig) -> None:
    ctx.check_destination()
    source, target = corpus.source, corpus.target
    extracted = ctx.unpack(corpus.archive)
    files: dict[str, tuple[Path, Path]] = {
        split: tuple(find_file(extracted, corpus.file_name(split, lang), corpus.archive.name)
                     for lang in (source, target))
        for split in SPLITS
    }
    raw, tok = ctx.path("raw"), ctx.path("tok")
    release_train = pair(raw, "train.release", source, target)

    # 1. The release's text: whitespace runs collapsed, empty training pairs dropped, dev and test1
    #    kept whole (the references).  The training text waits in raw/train.release.* for step 2.
    def extract_text() -> None:
        write_raw_splits(files, raw, source, target)
        for written, path in zip(pair(raw, "train", source, target), release_train):
            written.replace(path)

    ctx.run(Step("text", extract_text, inputs=[path for paths in files.values() for path in paths],
                 outputs=[*release_train, *pair(raw, "valid", source, target), *pair(raw, "test", source, target)],
                 params={split: corpus.file_name(split, "*") for split in SPLITS}))

    # 2. fairseq's cleaning of the training pairs by Moses token counts (the tokens only count).
    tok_train = pair(tok, "train.release", source, target)

    def tokenize_for_counting() -> None:
        for lang, source_path, destination in zip((source, target), release_train, tok_train):
            write_lines(destination, moses_preprocess(iter_lines(source_path, progress=f"tokenize {source_path.name}"), MosesConfig(lang=lang), ctx.workers))

    def select_training_pairs() -> None:
        kept = clean_indices(iter_lines(tok_train[0]), iter_lines(tok_train[1]), corpus.moses_clean)
        for lang, path in zip((source, target), release_train):
            lines = list(iter_lines(path))
            write_lines(raw / f"train.{lang}", [lines[i] for i in kept])

    ctx.run(Step("tokenize-train", tokenize_for_counting, inputs=list(release_train), outputs=list(tok_train)))
    ctx.run(Step("select-train", select_training_pairs, inputs=[*release_train, *tok_train],
                 outputs=list(pair(raw, "train", source, target)),
                 params={"moses_clean": dataclasses.asdict(corpus.moses_clean)}))

    # 3. SentencePiece and binarisation.
    segmented = sentencepiece_stage(ctx, source, target, spm, None)
    binarize_stage(
        ctx, corpus.name, source, target, segmented, (segmented / "spm.model", "spm.model"),
        metadata={
            "subword": {"kind": "sentencepiece", **spm.model_settings()},
            "release": "Multitarget TED Talks Task (Duh 2018), " + corpus.archive.name,
            "sets": {split: corpus.file_name(split, "{" + f"{source},{target}" + "}") for split in SPLITS},
            "moses_clean": dataclasses.asdict(corpus.moses_clean),
            "sacrebleu_tokenize": corpus.sacrebleu_tokenize,
        },
    )
