"""One pass of the frozen teacher over a binarised split, the part every offline teacher job shares
(sequence-level KD, :mod:`.seqkd`, with its fairseq and CTranslate2 engines; the top-k cache,
:mod:`.teacher_cache`):

* set-up: the language pair (given, or inferred as fairseq does), the split's files, fairseq's
  translation task over the data with the split loaded, the :class:`FrozenTeacher` checked against
  its dictionaries, the device and the precision;
* shards: the split cut into shards of consecutive sentence ids, each batched as fairseq-generate
  batches (sorted by length, ``batch_by_size``) independently of the other shards, so a resumed
  pass batches as an uninterrupted one;
* the resumable record: a job's record (its manifest) holds its settings and its inputs'
  fingerprints (:mod:`fairseq_kd.fingerprint`); two records describe the same output when their
  :func:`identity` is equal; a record of an older format is refused in one line
  (:func:`refuse_older_format`);
* progress: per-sentence progress bar on a terminal, shard lines above it (:func:`shard_progress`).

Building a model from a checkpoint needs the plugin's architectures registered: importing
:mod:`fairseq_kd.models` (here, through :mod:`fairseq_kd.models.teacher`) does it.
"""
from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Callable, Iterator, List, Mapping, Optional, Tuple, Type

import numpy as np
import torch

from ..fingerprint import content, read_json
from ..progress import print_above_bars, progress_bar

#: seed of the tie-breaking shuffle in ``ordered_indices`` (fairseq-generate's default --seed)
ORDER_SEED = 1


# ----------------------------------------------------------------------------- set-up
def infer_languages(data: Path, source_lang: Optional[str], target_lang: Optional[str],
                    error: Type[Exception]) -> Tuple[str, str]:
    """``(source, target)``: the languages given, or, when either is missing, fairseq's own rule
    (TranslationTask.setup_task: the first ``<split>.<a>-<b>.*`` file found); ``error`` when the
    folder tells none."""
    if source_lang and target_lang:
        return source_lang, target_lang
    from fairseq.data import data_utils

    src, tgt = data_utils.infer_language_pair(str(data))
    if src is None or tgt is None:
        raise error(f"--data {data}: cannot infer the language pair (no <split>.<src>-<tgt>.* files); pass "
                    "--source-lang and --target-lang")
    return src, tgt


def split_files(data: Path, split: str, src: str, tgt: str) -> List[Path]:
    """Binary files of ``split`` and its fairseq continuation parts ``split1``, ``split2``, ...
    (either language-pair naming), in the order fairseq's translation task concatenates them."""
    data = Path(data)
    files: List[Path] = []
    for k in itertools.count():
        name = split + (str(k) if k > 0 else "")
        found = False
        for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
            stem = data / f"{name}.{pair}"
            if (data / f"{stem.name}.{src}.idx").is_file():
                files += sorted(p for p in data.glob(f"{stem.name}.*") if p.suffix in (".bin", ".idx"))
                found = True
                break
        if not found:
            return files


def translation_task(data: Path, src: str, tgt: str, split: str):
    """fairseq's translation task over the binarised folder ``data`` (dictionaries loaded; the
    split read by :func:`load_split`)."""
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    return TranslationTask.setup_task(TranslationConfig(
        data=str(data), source_lang=src, target_lang=tgt, train_subset=split,
        dataset_impl=None, required_seq_len_multiple=1))  # dataset_impl None: inferred per file


def load_split(task, split: str):
    """``split`` of ``task``'s data (continuation parts included), as a LanguagePairDataset."""
    task.load_dataset(split, combine=True)
    return task.dataset(split)


def load_teacher(task, checkpoint, teacher_data: Optional[str], sha256: Optional[str]):
    """The frozen teacher of ``checkpoint`` for ``task``'s dictionaries (checked symbol for symbol,
    see :func:`fairseq_kd.models.teacher.check_dictionaries`); ``sha256``: the checkpoint's digest
    when the caller has just fingerprinted it."""
    from ..models.teacher import FrozenTeacher  # importing fairseq_kd.models registers the architectures

    return FrozenTeacher.load(str(checkpoint), task, teacher_data=teacher_data, sha256=sha256)


def pick_device(cpu: bool) -> torch.device:
    """CUDA when torch sees a GPU and ``cpu`` is not asked, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def on_device(model, device: torch.device, fp16: bool):
    """``model`` on ``device``, in half precision with ``fp16``."""
    model = model.to(device)
    return model.half() if fp16 else model


# ----------------------------------------------------------------------------- shards
def shard_count(sentences: int, shard_size: int) -> int:
    return (sentences + shard_size - 1) // shard_size


def shard_range(index: int, shard_size: int, sentences: int) -> Tuple[int, int]:
    """Sentence ids ``[first, last)`` of shard ``index``."""
    first = index * shard_size
    return first, min(sentences, first + shard_size)


def length_ordered_indices(dataset):
    """fairseq-generate's sentence order: by length, ties shuffled with a fixed seed."""
    from fairseq.data import data_utils

    with data_utils.numpy_seed(ORDER_SEED):
        return dataset.ordered_indices()


def shard_batches(dataset, ordered, first: int, last: int, max_tokens: Optional[int],
                  max_sentences: Optional[int] = None):
    """fairseq's ``batch_by_size`` over the sentence ids ``first..last-1`` of a shard, taken in the
    order ``ordered`` (:func:`length_ordered_indices`): a shard's batches do not depend on which
    other shards are processed in the same run, so a resumed run batches as an uninterrupted one."""
    indices = ordered[(ordered >= first) & (ordered < last)]
    return dataset.batch_by_size(indices, max_tokens=max_tokens, max_sentences=max_sentences,
                                 required_batch_size_multiple=1)


def check_max_tokens(dataset, max_tokens: Optional[int], split: str) -> Optional[str]:
    """Why ``--max-tokens`` cannot batch ``dataset`` (fairseq's ``batch_by_size`` asserts that
    every sentence fits in one batch), or None."""
    if max_tokens is None or len(dataset) == 0:
        return None
    lengths = dataset.num_tokens_vec(np.arange(len(dataset)))
    longest = int(lengths.argmax())
    if lengths[longest] <= max_tokens:
        return None
    return (f"--max-tokens {max_tokens} is smaller than sentence {longest} of --split {split} "
            f"({int(lengths[longest])} tokens); raise it to at least that")


@contextlib.contextmanager
def shard_progress(shards: List[int], shard_size: int, sentences: int, desc: str,
                   log: Callable[[str], None]) -> Iterator[Tuple[Callable[[int], None], Callable[[str], None]]]:
    """``(on_batch, log_line)`` for a pass over ``shards``: a per-sentence progress bar with rate
    and time left on stderr, only when it is a terminal (``on_batch(n)`` after each batch of ``n``
    sentences), and ``log`` printing above it."""
    total = sum(last - first for first, last in (shard_range(i, shard_size, sentences) for i in shards))
    with progress_bar(total=total, desc=desc, unit="sent") as bar:
        yield bar.update, (print_above_bars(log) if not bar.disable else log)


# ----------------------------------------------------------------------------- the resumable record
def read_record(path: Path) -> Optional[dict]:
    """A job's record (manifest), or None when there is none (or an unreadable one)."""
    path = Path(path)
    return read_json(path) if path.is_file() else None


def identity(settings: Mapping, inputs: Mapping) -> dict:
    """What a job's output is a function of: its settings and its inputs' contents (not the
    files' modification times)."""
    return {**settings, **{name: content(recorded) for name, recorded in inputs.items()}}


def refuse_older_format(found, current, what: str, rerun: str, error: Type[Exception]) -> None:
    """Refuse, in one line, a record ``what`` whose ``format`` ``found`` is not ``current``."""
    if found != current:
        raise error(f"{what} is of an older or unknown format ({found or 'no format'}; this version writes "
                    f"{current}); {rerun}")
