"""An offline teacher: its top-k next-token log-probabilities for every target token of a training set.

Word-level KD needs, per target token, the teacher's distribution over the vocabulary. Running the
teacher at every step costs a forward pass per update and per epoch; the distribution barely
changes what the student learns outside its k most likely tokens (both Tan et al. 2019,
"Multilingual Neural Machine Translation with Knowledge Distillation", ICLR, arXiv:1902.10461, and
Wang et al. 2021, "Selective Knowledge Distillation for Neural Machine Translation", ACL-IJCNLP,
arXiv:2105.12967, distil from the top 8). :func:`build_cache` runs the teacher once over a
binarised split with teacher forcing (the references as decoder input, as during KD training) and
stores, per target token in sentence-id order, the ``k`` largest log-probabilities (float32, at
temperature 1) and their token ids (int32), memory-mapped numpy arrays beside a manifest::

    DIR/cache.json          format, k, split, sentence and token counts, the dictionaries' hashes,
                            and ``inputs``: the fingerprints (:mod:`fairseq_kd.fingerprint`: size,
                            modification time, SHA-256) of the teacher checkpoint and of the
                            split's binarised files
    DIR/offsets.npy         int64 (sentences + 1,): sentence i's tokens are rows offsets[i]:offsets[i+1]
    DIR/topk_logprobs.npy   float32 (tokens, k)
    DIR/topk_ids.npy        int32 (tokens, k)

The build is resumable: sentences are processed in shards of ``shard_size`` ids, each recorded in
``progress.json`` once its rows are flushed; ``cache.json`` is written last, so a folder without it
is never read as a cache. A re-run passes the recorded fingerprints back, so an unchanged teacher
checkpoint or split is not read again. Training with ``--teacher-cache DIR`` (:class:`TeacherCache`)
refuses a cache of another teacher, other data or other dictionaries before any work. The data check
costs no hashing at every start-up: when the split's files have the names, sizes and modification
times recorded at build time they are the files that were hashed (a rewrite changes the time; copies
made with ``cp -p``, ``rsync -a`` or a move keep it); other sizes are refused at once, and only files
of the same sizes but other times (e.g. a plain ``cp``) are hashed again and compared by content.

A cache (or ``progress.json``) of another format (``fairseq-kd-teacher-cache/1`` before
fingerprints) is refused in one line, by training and by the build: build it anew. Set-up, shards
and the record's identity are the teacher pass's (:mod:`fairseq_kd.teacher_pass.common`), shared
with sequence-level KD.

With the cache, the teacher distribution at temperature tau is the top-k one renormalised,
``q_i = exp(l_i / tau) / sum_j exp(l_j / tau)`` over the stored log-probabilities ``l``: exact when
the teacher's mass lies within its top k, and otherwise the top-k approximation of the papers above.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from ..fingerprint import content, dictionary_sha256, fingerprint, fingerprint_files, write_json
from .common import (check_max_tokens, identity, infer_languages, length_ordered_indices, load_split,
                     load_teacher, on_device, pick_device, read_record, refuse_older_format, shard_batches,
                     shard_count, shard_progress, shard_range, split_files, translation_task)

CACHE_FORMAT = "fairseq-kd-teacher-cache/2"
#: what a cache is made with besides its inputs (whose contents are compared: :func:`_identity`)
SETTINGS = ("format", "k", "split", "source_lang", "target_lang", "source_dictionary_sha256",
            "target_dictionary_sha256")
MANIFEST = "cache.json"
PROGRESS = "progress.json"
ARRAYS = ("offsets.npy", "topk_logprobs.npy", "topk_ids.npy")
FLAG = "--teacher-cache"
logger = logging.getLogger(__name__)


class TeacherCacheError(ValueError):
    """A cache cannot be built or used as asked; the message names the flag or file and what to do."""


@dataclass
class CacheConfig:
    """Inputs of :func:`build_cache`, one flag of ``fairseq-kd-teacher-cache`` each (``--field-name``)."""

    data: Path = field(metadata={"help": "fairseq-preprocess --destdir of the training data"})
    teacher_checkpoint: Path = field(metadata={"help": "the teacher (fairseq checkpoint)"})
    output: Path = field(metadata={"help": "folder of the cache (created)"})
    k: int = field(default=8, metadata={"help": "log-probabilities kept per token"})
    split: str = field(default="train", metadata={"help": "binarised split to cover"})
    max_tokens: int = field(default=8192, metadata={"help": "tokens per teacher batch"})
    shard_size: int = field(default=5000, metadata={"help": "sentences per resumable shard"})
    cpu: bool = field(default=False, metadata={"help": "run on the CPU even if a GPU is visible"})
    fp16: bool = field(default=False, metadata={"help": "run the teacher in half precision (GPU)"})
    teacher_data: Optional[str] = field(default=None, metadata={
        "help": "folder with the teacher's dictionaries, when its checkpoint's data folder is elsewhere"})
    source_lang: Optional[str] = field(default=None, metadata={
        "help": "source language (default: inferred from --data)"})
    target_lang: Optional[str] = field(default=None, metadata={
        "help": "target language (default: inferred from --data)"})


def _split_of(data: Path, split: str, src: str, tgt: str) -> List[Path]:
    """The split's binarised files (both languages, continuation parts included)."""
    files = split_files(Path(data), split, src, tgt)
    if not files:
        raise TeacherCacheError(f"--data {data}: no binarised {split} split for {src}-{tgt}")
    return files


def _identity(record: dict) -> dict:
    """What a cache (``cache.json``, or ``progress.json``'s parameters) is a function of: its
    settings and its inputs' contents, not the files' times."""
    return identity({key: record.get(key) for key in SETTINGS}, record.get("inputs") or {})


def _refuse_older_format(record: dict, what: str) -> None:
    refuse_older_format(record.get("format"), CACHE_FORMAT, what,
                        "build the cache anew: re-run fairseq-kd-teacher-cache into another folder", TeacherCacheError)


def build_cache(config: CacheConfig, log: Callable[[str], None] = print) -> Path:
    """Run the teacher over ``config.split`` of ``config.data`` and write the cache (resumably)."""
    if config.k < 1:
        raise TeacherCacheError(f"--k must be at least 1, got {config.k}")
    if config.shard_size < 1 or config.max_tokens < 1:
        raise TeacherCacheError("--shard-size and --max-tokens must be positive")
    data, output = Path(config.data), Path(config.output)
    src, tgt = infer_languages(data, config.source_lang, config.target_lang, TeacherCacheError)
    data_files = _split_of(data, config.split, src, tgt)
    existing, interrupted = read_record(output / MANIFEST), read_record(output / PROGRESS)
    if existing is not None:
        _refuse_older_format(existing, f"--output {output}: {MANIFEST}")
    if interrupted is not None:
        _refuse_older_format(interrupted.get("parameters") or {}, f"--output {output}: {PROGRESS}")
    recorded = (existing or (interrupted or {}).get("parameters") or {}).get("inputs") or {}
    teacher_path = Path(config.teacher_checkpoint)
    # fingerprinted first, so that a recorded checksum saves reading an unchanged checkpoint; a
    # missing or unreadable one is left to FrozenTeacher.load's message
    teacher_fingerprint = (fingerprint(teacher_path, recorded.get("teacher"))
                           if teacher_path.is_file() and os.access(teacher_path, os.R_OK) else None)
    task = translation_task(data, src, tgt, config.split)
    teacher = load_teacher(task, config.teacher_checkpoint, config.teacher_data,
                           teacher_fingerprint and teacher_fingerprint["sha256"])
    if config.k > len(task.target_dictionary):
        raise TeacherCacheError(f"--k {config.k} exceeds the target vocabulary ({len(task.target_dictionary)} symbols)")
    parameters = {
        "format": CACHE_FORMAT, "k": config.k, "split": config.split, "source_lang": src, "target_lang": tgt,
        "source_dictionary_sha256": dictionary_sha256(task.source_dictionary),
        "target_dictionary_sha256": dictionary_sha256(task.target_dictionary),
        "inputs": {"teacher": teacher_fingerprint, "data": fingerprint_files(data_files, recorded.get("data"))},
    }
    progress = _start_or_resume(output, parameters, existing, interrupted, log)
    if progress is None:
        return output
    dataset = load_split(task, config.split)
    too_small = check_max_tokens(dataset, config.max_tokens, config.split)
    if too_small:
        raise TeacherCacheError(too_small)
    sizes = np.asarray(dataset.tgt_sizes, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    n_tokens = int(offsets[-1])
    _cache_pending_shards(config, task, teacher, dataset, offsets, progress, log)
    write_json(output / MANIFEST, {**parameters, "n_sentences": len(sizes), "n_tokens": n_tokens,
                                   "teacher_path": str(config.teacher_checkpoint)})
    os.remove(output / PROGRESS)
    log(f"{output}: top-{config.k} teacher log-probabilities of {n_tokens} target tokens "
        f"({len(sizes)} sentences of the {config.split} split)")
    return output


def _start_or_resume(output: Path, parameters: dict, existing: Optional[dict], interrupted: Optional[dict],
                     log: Callable[[str], None]) -> Optional[dict]:
    """The progress record to continue from (``done_shards`` empty for a new cache), or None when
    ``output`` already holds this complete cache; refuses a folder that holds anything else."""

    def same_cache(record: dict) -> bool:
        return _identity(record) == _identity(parameters)

    if existing is not None:
        if same_cache(existing):
            refreshed = {**existing, **parameters}
            if refreshed != existing:  # inputs touched since: their fingerprints now
                write_json(output / MANIFEST, refreshed)
            log(f"{output}: the cache is already complete (same teacher, data and k); nothing to do")
            return None
        raise TeacherCacheError(f"--output {output}: holds a cache of another teacher, data or k; choose another folder")
    if output.exists() and any(output.iterdir()) and not (output / PROGRESS).is_file():
        raise TeacherCacheError(f"--output {output}: the folder is not empty and holds no cache; choose another folder")
    output.mkdir(parents=True, exist_ok=True)
    progress = {"parameters": parameters, "done_shards": []}
    if (output / PROGRESS).is_file():
        if interrupted is None or not same_cache(interrupted.get("parameters") or {}):
            raise TeacherCacheError(f"--output {output}: holds an interrupted cache of another teacher, data or k; "
                                    "choose another folder")
        progress = {"parameters": parameters, "done_shards": interrupted["done_shards"]}
        if progress != interrupted:  # inputs touched since
            write_json(output / PROGRESS, progress)
    return progress


def _cache_pending_shards(config: CacheConfig, task, teacher, dataset, offsets: np.ndarray, progress: dict,
                          log: Callable[[str], None]) -> None:
    """Open (a new cache: create) the top-k arrays and fill the shards ``progress`` has not done,
    recording each in ``progress.json`` once its rows are flushed."""
    output = Path(config.output)
    n_sentences, n_tokens = len(offsets) - 1, int(offsets[-1])
    fresh = not progress["done_shards"]
    mode = "w+" if fresh else "r+"
    if fresh:
        np.save(output / "offsets.npy", offsets)
    logprobs = np.lib.format.open_memmap(output / "topk_logprobs.npy", mode=mode, dtype=np.float32,
                                         shape=(n_tokens, config.k))
    token_ids = np.lib.format.open_memmap(output / "topk_ids.npy", mode=mode, dtype=np.int32, shape=(n_tokens, config.k))
    device = pick_device(config.cpu)
    model = on_device(teacher.model, device, config.fp16)
    pad = task.target_dictionary.pad()
    n_shards = shard_count(n_sentences, config.shard_size)
    ordered = length_ordered_indices(dataset)
    pending = [shard for shard in range(n_shards) if shard not in progress["done_shards"]]
    with shard_progress(pending, config.shard_size, n_sentences, "teacher cache", log) as (on_batch, log_line):
        for shard in pending:
            _cache_shard(model, dataset, ordered, offsets, logprobs, token_ids, pad, device, config, shard, on_batch)
            progress["done_shards"].append(shard)
            write_json(output / PROGRESS, progress)
            first, last = shard_range(shard, config.shard_size, n_sentences)
            log_line(f"shard {shard + 1}/{n_shards}: sentences {first}..{last - 1}")
    del logprobs, token_ids


def _cache_shard(model, dataset, ordered, offsets, logprobs, token_ids, pad: int, device, config: CacheConfig,
             shard: int, on_batch: Callable[[int], None]) -> None:
    """Run the teacher over shard ``shard`` and write its rows of the top-k arrays (flushed)."""
    first, last = shard_range(shard, config.shard_size, len(offsets) - 1)
    for batch_ids in shard_batches(dataset, ordered, first, last, config.max_tokens):
        sample = dataset.collater([dataset[int(i)] for i in batch_ids])
        net_input = {key: value.to(device) for key, value in sample["net_input"].items()}
        with torch.no_grad():
            logits = model(**net_input)[0]
        values, indices = torch.log_softmax(logits.float(), dim=-1).topk(config.k, dim=-1)
        target = sample["target"]
        mask = target.ne(pad).numpy()
        rows = offsets[sample["id"].numpy()][:, None] + np.arange(target.size(1))[None, :]
        logprobs[rows[mask]] = values.cpu().numpy()[mask]
        token_ids[rows[mask]] = indices.cpu().numpy().astype(np.int32)[mask]
        on_batch(len(batch_ids))
    logprobs.flush()
    token_ids.flush()


def _same_data(manifest: dict, files: List[Path]) -> bool:
    """Whether ``files`` hold the data the cache was built from (see the module's docstring);
    re-hashes only files of the recorded sizes whose modification times differ."""
    recorded = manifest["inputs"]["data"]
    sizes = {path.name: path.stat().st_size for path in files}
    if {name: fp["size"] for name, fp in recorded["files"].items()} != sizes:
        return False  # other names or sizes: other data, known without reading a file
    return content(fingerprint_files(files, recorded)) == content(recorded)


class TeacherCache:
    """A finished cache, checked against the training run that reads it (``--teacher-cache``)."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self.k = int(manifest["k"])
        self.offsets = np.load(self.path / "offsets.npy", mmap_mode="r")
        self.logprobs = np.load(self.path / "topk_logprobs.npy", mmap_mode="r")
        self.token_ids = np.load(self.path / "topk_ids.npy", mmap_mode="r")

    @property
    def teacher_sha256(self) -> str:
        """The teacher checkpoint's SHA-256 (the digest of its fingerprint)."""
        return self.manifest["inputs"]["teacher"]["sha256"]

    @classmethod
    def open(cls, path: str, task, teacher_sha256: Optional[str] = None) -> "TeacherCache":
        """Open ``path`` for ``task``'s training data; refuse another teacher, data or dictionaries."""
        folder = Path(path)
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            why = ("an interrupted build: run fairseq-kd-teacher-cache again to finish it"
                   if (folder / PROGRESS).is_file() else "run fairseq-kd-teacher-cache to make one")
            raise TeacherCacheError(f"{FLAG} {path}: no finished cache there ({MANIFEST} missing; {why})")
        manifest = json.loads(manifest_path.read_text())
        _refuse_older_format(manifest, f"{FLAG} {path}: {MANIFEST}")
        missing = [name for name in ARRAYS if not (folder / name).is_file()]
        if missing:
            raise TeacherCacheError(f"{FLAG} {path}: {', '.join(missing)} missing; rebuild the cache")
        split = task.cfg.train_subset
        if manifest["split"] != split:
            raise TeacherCacheError(f"{FLAG} {path} holds the {manifest['split']!r} split, but training reads "
                                    f"{split!r} (--train-subset)")
        for side, dictionary in (("source", task.source_dictionary), ("target", task.target_dictionary)):
            if manifest[f"{side}_dictionary_sha256"] != dictionary_sha256(dictionary):
                raise TeacherCacheError(f"{FLAG} {path} was made with another {side} dictionary than the data's "
                                        f"({task.cfg.data}): its token ids would index other symbols")
        if not _same_data(manifest, _split_of(Path(task.cfg.data.split(os.pathsep)[0]), split,
                                              task.cfg.source_lang, task.cfg.target_lang)):
            raise TeacherCacheError(f"{FLAG} {path} was made for other {split} data than {task.cfg.data} holds "
                                    "(the binarised files differ); rebuild it for this data")
        cache = cls(folder, manifest)
        if teacher_sha256 is not None and teacher_sha256 != cache.teacher_sha256:
            raise TeacherCacheError(
                f"{FLAG} {path} was made by teacher sha256 {cache.teacher_sha256[:12]} "
                f"({manifest.get('teacher_path')}), not by --teacher-checkpoint (sha256 {teacher_sha256[:12]})")
        return cache

    def lookup(self, sentence_ids: torch.Tensor, target_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ``(log-probabilities, token ids)`` at every target position:
        ``(batch, tgt_len, k)`` each, zeros (ids 0) at padding. ``target_mask``: True at real tokens."""
        ids = sentence_ids.cpu().numpy()
        mask = target_mask.cpu().numpy()
        lengths = self.offsets[ids + 1] - self.offsets[ids]
        if not np.array_equal(lengths, mask.sum(1)):
            raise TeacherCacheError(f"{FLAG} {self.path}: a batch's target lengths differ from the cache's; the "
                                    "cache belongs to other data")
        rows = self.offsets[ids][:, None] + np.arange(mask.shape[1])[None, :]
        logprobs = np.zeros(mask.shape + (self.k,), dtype=np.float32)
        token_ids = np.zeros(mask.shape + (self.k,), dtype=np.int64)
        logprobs[mask] = self.logprobs[rows[mask]]
        token_ids[mask] = self.token_ids[rows[mask]]
        device = target_mask.device
        return torch.from_numpy(logprobs).to(device), torch.from_numpy(token_ids).to(device)
