"""WMT'14 English-German as in Vaswani et al. (2017): ~4.5M training pairs, newstest2013 for
validation, newstest2014 for test, joint BPE.

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..archive import find_file
from ..bpe import apply_bpe_file, learn_joint_bpe
from ..download import RemoteFile
from ..errors import PrepareError
from ..iwslt import RIGHT_SINGLE_QUOTE, read_parallel_segments
from ..pipeline import Step
from ..textio import iter_lines, normalize_whitespace, write_lines
from ..tokenize import CleanRule, MosesConfig, moses_preprocess
from .common import PrepareContext, binarize_stage, clean_pair_files, pair, write_pair, zip_parallel

CORPUS = "wmt14.en-de"
SOURCE, TARGET = "en", "de"

EUROPARL = RemoteFile(
    name="training-parallel-europarl-v7.tgz",
    urls=("https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
          "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"),
    provenance="WMT'13/'14 training data (statmt.org); no published checksum",
)
COMMONCRAWL = RemoteFile(
    name="training-parallel-commoncrawl.tgz",
    urls=("https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
          "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz"),
    provenance="WMT'13/'14 training data (statmt.org); no published checksum",
)
NEWS_COMMENTARY = RemoteFile(
    name="training-parallel-nc-v9.tgz",
    urls=("https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
          "http://statmt.org/wmt14/training-parallel-nc-v9.tgz"),
    provenance="WMT'14 training data (statmt.org); no published checksum",
)
NEWSTEST2013 = RemoteFile(
    name="test.tgz",
    urls=("https://statmt.org/wmt13/test.tgz",),
    md5="48eca5d02f637af44e85186847141f67",
    provenance="WMT'13 test sets; address and md5 as registered in sacreBLEU's dataset list (wmt13)",
)
NEWSTEST2014 = RemoteFile(
    name="test-full.tgz",
    urls=("https://statmt.org/wmt14/test-full.tgz",),
    md5="a8cd784e006feb32ac6f3d9ec7eb389a",
    provenance="WMT'14 full test sets; address and md5 as registered in sacreBLEU's dataset list (wmt14/full)",
)

# (archive, file prefix); the files are PREFIX.de and PREFIX.en wherever they sit in the archive.
TRAINING = (
    (EUROPARL, "europarl-v7.de-en"),
    (COMMONCRAWL, "commoncrawl.de-en"),
    (NEWS_COMMENTARY, "news-commentary-v9.de-en"),
)
# (archive, {lang: sgm file name})
VALID = (NEWSTEST2013, {"en": "newstest2013-src.en.sgm", "de": "newstest2013-src.de.sgm"})
TEST = (NEWSTEST2014, {"en": "newstest2014-deen-src.en.sgm", "de": "newstest2014-deen-ref.de.sgm"})
CLEAN_RULE = CleanRule(min_tokens=1, max_tokens=250, ratio=1.5)


def moses_config(lang: str) -> MosesConfig:
    return MosesConfig(lang=lang, aggressive_dash_splits=True, normalize_punctuation=True, remove_non_printing=True)


@dataclass(frozen=True)
class Settings:
    bpe_merges: int = 37000

    def __post_init__(self) -> None:
        if self.bpe_merges < 1:
            raise PrepareError(f"--bpe-merges must be >= 1, got {self.bpe_merges}")


def prepare(ctx: PrepareContext, settings: Settings = Settings()) -> None:
    ctx.check_destination()
    training_files = []
    for remote, prefix in TRAINING:
        folder = ctx.unpack(remote)
        training_files.append(tuple(find_file(folder, f"{prefix}.{lang}", remote.name) for lang in (SOURCE, TARGET)))
    heldout_files = {}
    for split, (remote, names) in (("valid", VALID), ("test", TEST)):
        folder = ctx.unpack(remote)
        heldout_files[split] = tuple(find_file(folder, names[lang], remote.name) for lang in (SOURCE, TARGET))
    raw, tok, bpe = ctx.path("raw"), ctx.path("tok"), ctx.path("bpe")

    # 1. Raw text.
    raw_train = pair(raw, "train", SOURCE, TARGET)

    def concatenate_training() -> None:
        def lines(index: int):
            for files in training_files:
                for source_line, target_line in zip_parallel(*files):
                    yield normalize_whitespace((source_line, target_line)[index])

        # zip_parallel checks each corpus is parallel; each side is streamed separately.
        write_lines(raw_train[0], lines(0))
        write_lines(raw_train[1], lines(1))

    ctx.run(Step("train-text", concatenate_training, inputs=[p for files in training_files for p in files],
                 outputs=list(raw_train)))
    raw_heldout = [path for split in heldout_files for path in pair(raw, split, SOURCE, TARGET)]

    def extract_heldout() -> None:
        for split, (source_sgm, target_sgm) in heldout_files.items():
            source_lines, target_lines = read_parallel_segments(source_sgm, target_sgm, straighten_quotes=False)
            write_pair(pair(raw, split, SOURCE, TARGET),
                       [normalize_whitespace(line) for line in source_lines],
                       [normalize_whitespace(line) for line in target_lines])

    ctx.run(Step("heldout-text", extract_heldout, inputs=[p for files in heldout_files.values() for p in files],
                 outputs=raw_heldout, params={"straighten_quotes": False}))

    # 2. Moses.  ’ is straightened in the held-out sets before the chain (only the raw references
    #    keep it), so their tokenised text (the models' valid/test input) is unchanged.
    def tokenizer(split_names, straighten_quotes=False):
        def action() -> None:
            for split in split_names:
                for lang in (SOURCE, TARGET):
                    lines = iter_lines(raw / f"{split}.{lang}", progress=f"tokenize {split}.{lang}")
                    if straighten_quotes:
                        lines = (line.replace(RIGHT_SINGLE_QUOTE, "'") for line in lines)
                    write_lines(tok / f"{split}.{lang}", moses_preprocess(lines, moses_config(lang), ctx.workers))
        return action

    ctx.run(Step("tokenize-train", tokenizer(["train"]), inputs=list(raw_train),
                 outputs=list(pair(tok, "train", SOURCE, TARGET))))
    ctx.run(Step("tokenize-heldout", tokenizer(["valid", "test"], straighten_quotes=True), inputs=raw_heldout,
                 outputs=[p for split in ("valid", "test") for p in pair(tok, split, SOURCE, TARGET)],
                 params={"straighten_quotes": True}))

    # 3. Joint BPE, then cleaning of the segmented training pairs.
    codes = bpe / "code"
    train_tok = list(pair(tok, "train", SOURCE, TARGET))
    ctx.run(Step("learn-bpe", lambda: learn_joint_bpe(train_tok, codes, settings.bpe_merges),
                 inputs=train_tok, outputs=[codes], params={"merges": settings.bpe_merges}))
    to_segment = [(tok / f"{split}.{lang}", bpe / f"{'train.all' if split == 'train' else split}.{lang}")
                  for split in ("train", "valid", "test") for lang in (SOURCE, TARGET)]

    def apply_all() -> None:
        for source_path, destination in to_segment:
            apply_bpe_file(codes, source_path, destination, ctx.workers)

    ctx.run(Step("apply-bpe", apply_all, inputs=[codes] + [s for s, _ in to_segment], outputs=[d for _, d in to_segment]))
    all_pair, clean_pair = pair(bpe, "train.all", SOURCE, TARGET), pair(bpe, "train", SOURCE, TARGET)
    ctx.run(Step("clean-train", lambda: clean_pair_files(all_pair, clean_pair, CLEAN_RULE),
                 inputs=list(all_pair), outputs=list(clean_pair), params={"rule": dataclasses.asdict(CLEAN_RULE)}))

    # 4. fairseq-preprocess.
    binarize_stage(
        ctx, CORPUS, SOURCE, TARGET, bpe, (codes, "bpe.code"),
        metadata={
            "subword": {"kind": "subword-nmt", "merges": settings.bpe_merges},
            "moses": {"lowercase": False, "aggressive_dash_splits": True, "escape": True,
                      "normalize_punctuation": True, "remove_non_printing": True},
            "sacrebleu_tokenize": "13a",
        },
        tokenized_references=tok,
    )
