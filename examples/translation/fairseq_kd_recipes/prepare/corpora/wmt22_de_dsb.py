"""WMT'22 German-Lower Sorbian, the very-low-resource supervised task (Align-to-Distill's De-Dsb).

Data as released by the task organisers in their data repository (the addresses on
statmt.org/wmt22/unsup_and_very_low_res.html point there):

* training: ``40194_train_dsb_de.{de,dsb}.gz``, 40,194 sentence pairs (2022 release);
* development and development-test sets of 2021: ``devtest.dsb-de.tgz``;
* development set of 2022: ``valid.{de,dsb}.gz``.

Default split: validation = the 2021 development set, test = the 2021 development-test set
(``--valid-set``/``--test-set`` choose among the sets of :data:`SETS`).  The names of the files
inside ``devtest.dsb-de.tgz`` follow the organisers' 2020 Upper Sorbian release
(``devel.*``/``devel_test.*``); if an archive names them otherwise, the error lists what it holds.
Text is untokenised; one SentencePiece model is trained on both languages and the encoded
training pairs are filtered to 1..250 pieces per side.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..archive import find_file
from ..download import RemoteFile
from ..errors import PrepareError
from ..pipeline import Step
from ..spm import SentencePieceConfig
from ..tokenize import CleanRule
from .common import PrepareContext, binarize_stage, pair, sentencepiece_stage, write_raw_splits

CORPUS = "wmt22.spm.de-dsb"
SOURCE, TARGET = "de", "dsb"
_BASE = "https://github.com/mariondimarco/WMT22_UnsupVeryLowResMT_Data/raw/refs/heads/main/"
_PROVENANCE = "WMT'22 Unsupervised and Very Low Resource task data repository (organisers); no published checksum"


def _remote(name: str) -> RemoteFile:
    return RemoteFile(name=name, urls=(_BASE + name,), provenance=_PROVENANCE)


@dataclass(frozen=True)
class TextFile:
    """One side of a set: a downloaded file and the name of the text file it unpacks to."""

    remote: RemoteFile
    member: str


DEVTEST_2021 = _remote("devtest.dsb-de.tgz")
SETS: dict[str, dict[str, TextFile]] = {
    "train2022": {
        "de": TextFile(_remote("40194_train_dsb_de.de.gz"), "40194_train_dsb_de.de"),
        "dsb": TextFile(_remote("40194_train_dsb_de.dsb.gz"), "40194_train_dsb_de.dsb"),
    },
    "devel2021": {
        "de": TextFile(DEVTEST_2021, "devel.dsb-de.de"),
        "dsb": TextFile(DEVTEST_2021, "devel.dsb-de.dsb"),
    },
    "devel_test2021": {
        "de": TextFile(DEVTEST_2021, "devel_test.dsb-de.de"),
        "dsb": TextFile(DEVTEST_2021, "devel_test.dsb-de.dsb"),
    },
    "valid2022": {
        "de": TextFile(_remote("valid.de.gz"), "valid.de"),
        "dsb": TextFile(_remote("valid.dsb.gz"), "valid.dsb"),
    },
}
TRAIN_SET = "train2022"
DEFAULT_VALID_SET = "devel2021"
DEFAULT_TEST_SET = "devel_test2021"
PIECE_CLEAN = CleanRule(min_tokens=1, max_tokens=250, ratio=None)
SPM_VOCAB_SIZE = 8000


@dataclass(frozen=True)
class Settings:
    spm: SentencePieceConfig
    valid_set: str = DEFAULT_VALID_SET
    test_set: str = DEFAULT_TEST_SET
    piece_clean: CleanRule = PIECE_CLEAN


def _locate(ctx: PrepareContext, text_file: TextFile):
    return find_file(ctx.unpack(text_file.remote), text_file.member, text_file.remote.name)


def prepare(ctx: PrepareContext, settings: Settings) -> None:
    for flag, name in (("--valid-set", settings.valid_set), ("--test-set", settings.test_set)):
        if name not in SETS or name == TRAIN_SET:
            choices = ", ".join(n for n in SETS if n != TRAIN_SET)
            raise PrepareError(f"{flag} {name}: unknown set (choose from {choices})")
    if settings.valid_set == settings.test_set:
        raise PrepareError(f"--valid-set and --test-set are both {settings.valid_set}")
    ctx.check_destination()
    splits = {"train": TRAIN_SET, "valid": settings.valid_set, "test": settings.test_set}

    # Every file the chosen sets need, fetched and unpacked once each.
    files = {
        split: [_locate(ctx, SETS[set_name][lang]) for lang in (SOURCE, TARGET)]
        for split, set_name in splits.items()
    }
    raw = ctx.path("raw")

    def extract_text() -> None:
        write_raw_splits(files, raw, SOURCE, TARGET)

    ctx.run(Step("text", extract_text, inputs=[path for paths in files.values() for path in paths],
                 outputs=[path for split in splits for path in pair(raw, split, SOURCE, TARGET)],
                 params=splits))
    segmented = sentencepiece_stage(ctx, SOURCE, TARGET, settings.spm, settings.piece_clean)
    binarize_stage(
        ctx, CORPUS, SOURCE, TARGET, segmented, (segmented / "spm.model", "spm.model"),
        metadata={
            "subword": {"kind": "sentencepiece", **settings.spm.model_settings()},
            "sets": splits,
            "piece_clean": dataclasses.asdict(settings.piece_clean),
            "sacrebleu_tokenize": "13a",
        },
    )
