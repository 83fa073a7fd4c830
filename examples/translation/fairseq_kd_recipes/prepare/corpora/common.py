"""What every corpus recipe shares: the working folders, fetching and extraction as steps, the
SentencePiece stage, and the final binarisation into ``--dest``.

Layout of a working folder (``--workdir``)::

    downloads/          fetched files (unless --archives), checksums.json, digests.json
    extracted/NAME/     unpacked archives
    raw/                untokenised text: train/valid/test.<lang>
    tok/                Moses-tokenised text (recipes that use Moses)
    bpe/ or spm/        subword model and segmented splits
    stamps/             one JSON stamp per finished step

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..archive import extract
from ..binarize import SplitPrefixes, binarize
from ..download import Fetcher, RemoteFile
from ..errors import PrepareError
from ..pipeline import Step, StepRunner
from ..spm import SentencePieceConfig, encode_file, train_sentencepiece
from ..textio import count_lines, iter_lines, normalize_whitespace, parallel_pairs, write_lines
from ..tokenize import CleanRule, keep_pair

LOG = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
FINAL_STEP = "binarize"


@dataclass
class PrepareContext:
    """Where a recipe works and writes, and how it fetches and runs steps."""

    workdir: Path
    dest: Path
    fetcher: Fetcher
    runner: StepRunner
    workers: int = 1
    overwrite: bool = False
    _unpacked: dict[str, Path] = field(default_factory=dict, repr=False)

    def path(self, *parts: str) -> Path:
        return self.workdir.joinpath(*parts)

    def fetch(self, remote: RemoteFile) -> Path:
        return self.fetcher.fetch(remote)

    def run(self, step: Step) -> bool:
        return self.runner.run(step)

    def extract(self, archive: Path, name: str) -> Path:
        """Unpack ``archive`` into ``extracted/<name>`` as a step; return that folder."""
        folder = self.path("extracted", name)
        self.run(Step(f"extract-{name}", lambda: extract(archive, folder), inputs=[archive], outputs=[folder]))
        return folder

    def unpack(self, remote: RemoteFile) -> Path:
        """Fetch ``remote`` and extract it into ``extracted/<name without archive suffix>``."""
        if remote.name not in self._unpacked:
            stem = remote.name
            for suffix in (".tar.gz", ".tgz", ".tar", ".zip", ".gz"):
                if stem.endswith(suffix):
                    stem = stem[: -len(suffix)]
                    break
            self._unpacked[remote.name] = self.extract(self.fetch(remote), stem)
        return self._unpacked[remote.name]

    def check_destination(self) -> None:
        """Refuse a non-empty ``--dest`` this working folder did not write, unless ``--overwrite``.

        Called before any work starts.
        """
        if not self.dest.exists():
            return
        if not self.dest.is_dir():
            raise PrepareError(f"--dest {self.dest} exists and is not a directory")
        written_here = any(path.parent == self.dest for path in self.runner.recorded_outputs(FINAL_STEP))
        if not self.overwrite and not written_here and any(self.dest.iterdir()):
            raise PrepareError(
                f"--dest {self.dest} already contains files that this --workdir ({self.workdir}) did not "
                "write; choose another --dest or pass --overwrite to replace them"
            )


def pair(folder: Path, split: str, source: str, target: str) -> tuple[Path, Path]:
    """``folder/split.source``, ``folder/split.target``."""
    return folder / f"{split}.{source}", folder / f"{split}.{target}"


def write_pair(paths: tuple[Path, Path], source_lines: Sequence[str], target_lines: Sequence[str]) -> None:
    if len(source_lines) != len(target_lines):
        raise PrepareError(f"{paths[0]} and {paths[1]} would not be parallel ({len(source_lines)} vs {len(target_lines)})")
    write_lines(paths[0], source_lines)
    write_lines(paths[1], target_lines)


def drop_empty_pairs(source_lines: Sequence[str], target_lines: Sequence[str]) -> tuple[list[str], list[str]]:
    """Pairs where both sides have text (an empty side teaches nothing and breaks length ratios)."""
    kept = [(s, t) for s, t in parallel_pairs(source_lines, target_lines) if s.strip() and t.strip()]
    return [s for s, _ in kept], [t for _, t in kept]


def write_raw_splits(files: Mapping[str, tuple[Path, Path]], raw: Path, source: str, target: str) -> None:
    """``raw/{split}.{source,target}`` from each split's two release files: whitespace normalised,
    checked to be parallel, empty training pairs dropped (held-out sets are kept whole)."""
    for split, (source_file, target_file) in files.items():
        source_lines = [normalize_whitespace(line) for line in iter_lines(source_file)]
        target_lines = [normalize_whitespace(line) for line in iter_lines(target_file)]
        if len(source_lines) != len(target_lines):
            raise PrepareError(f"{source_file} and {target_file} are not parallel "
                               f"({len(source_lines)} vs {len(target_lines)} lines)")
        if split == "train":
            source_lines, target_lines = drop_empty_pairs(source_lines, target_lines)
        write_pair(pair(raw, split, source, target), source_lines, target_lines)


def clean_pair_files(inputs: tuple[Path, Path], outputs: tuple[Path, Path], rule: CleanRule) -> int:
    """``clean-corpus-n`` on two files of whitespace-separated tokens, streamed; returns pairs kept."""
    kept = total = 0
    temporaries = [path.with_name(path.name + ".tmp") for path in outputs]
    for path in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(temporaries[0], "w", encoding="utf-8", newline="\n") as source_out, \
                open(temporaries[1], "w", encoding="utf-8", newline="\n") as target_out:
            for source_line, target_line in zip_parallel(*inputs):
                total += 1
                source_tokens, target_tokens = source_line.split(), target_line.split()
                if keep_pair(source_tokens, target_tokens, rule):
                    source_out.write(" ".join(source_tokens) + "\n")
                    target_out.write(" ".join(target_tokens) + "\n")
                    kept += 1
        for temporary, path in zip(temporaries, outputs):
            os.replace(temporary, path)
    finally:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)
    LOG.info("cleaning kept %d of %d pairs of %s", kept, total, inputs[0])
    return kept


def zip_parallel(source: Path, target: Path) -> Iterator[tuple[str, str]]:
    """Line pairs of two files; raises PrepareError naming both if their lengths differ."""
    sentinel = object()
    for source_line, target_line in itertools.zip_longest(iter_lines(source), iter_lines(target), fillvalue=sentinel):
        if source_line is sentinel or target_line is sentinel:
            raise PrepareError(f"{source} and {target} do not have the same number of lines")
        yield source_line, target_line


def sentencepiece_stage(
    ctx: PrepareContext,
    source: str,
    target: str,
    config: SentencePieceConfig,
    clean_rule: CleanRule | None,
) -> Path:
    """Train a joint model on ``raw/train.*``, encode ``raw/{train,valid,test}.*`` into ``spm/``.

    ``clean_rule`` (counted in pieces) filters the encoded training pairs; ``None`` keeps all.
    Returns the ``spm`` folder (holding ``spm.model`` and the splits).
    """
    raw, out = ctx.path("raw"), ctx.path("spm")
    model = out / "spm.model"
    train_inputs = list(pair(raw, "train", source, target))
    ctx.run(Step(
        "spm-train",
        lambda: train_sentencepiece(train_inputs, model, config),
        inputs=train_inputs,
        outputs=[model],
        params={"config": config.model_settings()},
    ))
    encoded: list[Path] = []
    sources: list[Path] = []
    for split in SPLITS:
        destination_split = "train.all" if (split == "train" and clean_rule is not None) else split
        for lang in (source, target):
            sources.append(raw / f"{split}.{lang}")
            encoded.append(out / f"{destination_split}.{lang}")

    def encode_all() -> None:
        for src_path, dst_path in zip(sources, encoded):
            encode_file(model, src_path, dst_path, ctx.workers)

    ctx.run(Step("spm-encode", encode_all, inputs=[model, *sources], outputs=encoded))
    if clean_rule is not None:
        all_pair = pair(out, "train.all", source, target)
        clean_pair = pair(out, "train", source, target)
        ctx.run(Step(
            "spm-clean-train",
            lambda: clean_pair_files(all_pair, clean_pair, clean_rule),
            inputs=list(all_pair),
            outputs=list(clean_pair),
            params={"rule": dataclasses.asdict(clean_rule)},
        ))
    return out


def binarize_stage(
    ctx: PrepareContext,
    corpus: str,
    source: str,
    target: str,
    segmented: Path,
    subword_model: tuple[Path, str],
    metadata: Mapping[str, Any],
    tokenized_references: Path | None = None,
) -> None:
    """fairseq-preprocess ``segmented/{train,valid,test}.*`` into ``--dest``, plus the extras.

    ``subword_model``: (file, name in --dest).  Raw references come from ``raw/``; Moses recipes
    also pass their tokenised folder as ``tokenized_references``.
    """
    dest = ctx.dest
    inputs = [path for split in SPLITS for path in pair(segmented, split, source, target)]
    extras: dict[str, Path] = {subword_model[1]: subword_model[0]}
    for split in ("valid", "test"):
        for lang in (source, target):
            extras[f"raw/{split}.{lang}"] = ctx.path("raw", f"{split}.{lang}")
            if tokenized_references is not None:
                extras[f"tok/{split}.{lang}"] = tokenized_references / f"{split}.{lang}"
    fairseq_files = [dest / f"dict.{lang}.txt" for lang in (source, target)] + [
        dest / f"{split}.{source}-{target}.{lang}.{kind}"
        for split in SPLITS for lang in (source, target) for kind in ("bin", "idx")
    ]
    outputs = fairseq_files + [dest / name for name in extras] + [dest / "prepare.json"]

    def action() -> None:
        if dest.exists() and any(dest.iterdir()):
            if not ctx.overwrite:
                raise PrepareError(
                    f"--dest {dest} holds the output of an earlier run made from different inputs or "
                    "settings; the new intermediate results are kept in --workdir, so re-running with "
                    "--overwrite only replaces --dest (or choose another --dest)"
                )
            # fairseq-preprocess refuses to replace dictionaries; remove only what this step writes.
            for path in outputs:
                path.unlink(missing_ok=True)
        binarize(
            source, target,
            SplitPrefixes(*(segmented / split for split in SPLITS)),
            dest, workers=ctx.workers,
        )
        for name, path in extras.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / name)
        sizes = {split: count_lines(segmented / f"{split}.{source}") for split in SPLITS}
        record = {
            "corpus": corpus,
            "source_lang": source,
            "target_lang": target,
            "sizes": sizes,
            "subword_model": subword_model[1],
            "raw_references": {split: f"raw/{split}.{target}" for split in ("valid", "test")},
            **metadata,
        }
        if tokenized_references is not None:
            record["tokenized_references"] = {split: f"tok/{split}.{target}" for split in ("valid", "test")}
        (dest / "prepare.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        LOG.info("%s: train %d, valid %d, test %d pairs in %s", corpus, sizes["train"], sizes["valid"], sizes["test"], dest)

    ctx.run(Step(FINAL_STEP, action, inputs=inputs + list(extras.values()), outputs=outputs,
                 params={"corpus": corpus, **{k: v for k, v in metadata.items()}}))
