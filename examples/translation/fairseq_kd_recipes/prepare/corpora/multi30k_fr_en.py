"""Multi30k task 1, French-English (Elliott et al. 2016, 2017): the real-corpus quality benchmark.

Flickr30k image descriptions with their French translations, as the Multi30k repository ships
them (``data/task1/raw``), untokenised and gzipped:

* ``train.{fr,en}.gz``: 29,000 pairs; ``val.{fr,en}.gz``: 1,014; ``test_2016_flickr.{fr,en}.gz``: 1,000.

Preparation: Moses tokenisation (sacremoses, case kept, XML escaping off so the text needs no
unescaping before scoring), joint subword-nmt BPE learned on the tokenised training text, a
joined dictionary. The training pairs are all kept (every Multi30k sentence is 1-80 words); valid
and test are never filtered. Scores are computed on detokenised output against ``raw/test.en``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..bpe import apply_bpe_file, learn_joint_bpe
from ..download import RemoteFile
from ..errors import PrepareError
from ..pipeline import Step
from ..textio import iter_lines, write_lines
from ..tokenize import MosesConfig, moses_preprocess
from .common import SPLITS, PrepareContext, binarize_stage, pair, write_raw_splits

CORPUS = "multi30k.fr-en"
SOURCE, TARGET = "fr", "en"
_BASE = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
_PROVENANCE = "Multi30k repository (Elliott et al.), data/task1/raw; no published checksum"

#: split -> file stem in the release
SETS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}


def remote(stem: str, lang: str) -> RemoteFile:
    name = f"{stem}.{lang}.gz"
    return RemoteFile(name=name, urls=(_BASE + name,), provenance=_PROVENANCE)


#: every file of the release the preparation reads (the names ``--archives`` must hold)
FILES = tuple(remote(stem, lang) for stem in SETS.values() for lang in (SOURCE, TARGET))


def moses_config(lang: str) -> MosesConfig:
    return MosesConfig(lang=lang, escape=False)


@dataclass(frozen=True)
class Settings:
    bpe_merges: int = 6000

    def __post_init__(self) -> None:
        if self.bpe_merges < 1:
            raise PrepareError(f"--bpe-merges must be >= 1, got {self.bpe_merges}")


def prepare(ctx: PrepareContext, settings: Settings = Settings()) -> None:
    ctx.check_destination()
    unpacked = {
        (split, lang): ctx.unpack(remote(stem, lang)) / f"{stem}.{lang}"
        for split, stem in SETS.items() for lang in (SOURCE, TARGET)
    }
    raw, tok, bpe = ctx.path("raw"), ctx.path("tok"), ctx.path("bpe")

    def extract_text() -> None:
        write_raw_splits({split: (unpacked[split, SOURCE], unpacked[split, TARGET]) for split in SPLITS},
                         raw, SOURCE, TARGET)

    raw_files = [path for split in SPLITS for path in pair(raw, split, SOURCE, TARGET)]
    ctx.run(Step("text", extract_text, inputs=list(unpacked.values()), outputs=raw_files, params=SETS))

    tok_files = [path for split in SPLITS for path in pair(tok, split, SOURCE, TARGET)]

    def tokenize_all() -> None:
        for source_path, destination in zip(raw_files, tok_files):
            lang = source_path.suffix[1:]
            write_lines(destination, moses_preprocess(iter_lines(source_path, progress=f"tokenize {source_path.name}"), moses_config(lang), ctx.workers))

    ctx.run(Step("tokenize", tokenize_all, inputs=raw_files, outputs=tok_files, params={"escape": False}))

    codes = bpe / "code"
    train_tok = list(pair(tok, "train", SOURCE, TARGET))
    ctx.run(Step("learn-bpe", lambda: learn_joint_bpe(train_tok, codes, settings.bpe_merges),
                 inputs=train_tok, outputs=[codes], params={"merges": settings.bpe_merges}))
    segmented = [bpe / path.name for path in tok_files]

    def apply_all() -> None:
        for source_path, destination in zip(tok_files, segmented):
            apply_bpe_file(codes, source_path, destination, ctx.workers)

    ctx.run(Step("apply-bpe", apply_all, inputs=[codes, *tok_files], outputs=segmented))
    binarize_stage(
        ctx, CORPUS, SOURCE, TARGET, bpe, (codes, "bpe.code"),
        metadata={
            "subword": {"kind": "subword-nmt", "merges": settings.bpe_merges},
            "moses": {"lowercase": False, "escape": False},
            "sets": SETS,
            "sacrebleu_tokenize": "13a",
        },
        tokenized_references=tok,
    )
