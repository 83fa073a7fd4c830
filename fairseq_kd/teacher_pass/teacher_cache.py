"""An offline teacher: its top-k next-token log-probabilities for every target token of a training set.

Word-level KD needs, per target token, the teacher's distribution over the vocabulary. Running the
teacher at every step costs a forward pass per update and per epoch; the distribution barely
changes what the student learns outside its k most likely tokens (both Tan et al. 2019,
"Multilingual Neural Machine Translation with Knowledge Distillation", ICLR, arXiv:1902.10461, and
Wang et al. 2021, "Selective Knowledge Distillation for Neural Machine Translation", ACL-IJCNLP,
arXiv:2105.12967, distil from the top 8). :func:`build_cache` runs the teacher once over a
binarised split with teacher forcing (the references as decoder input, as during KD training) and
stores, per target token in sentence-id order, the ``k`` largest log-probabilities (float32, at
temperature 1) and their token ids (int32), plain ``.npy`` arrays beside a manifest::

    DIR/cache.json          format, k, split, sentence and token counts, the dictionaries' hashes,
                            ``inputs``: the fingerprints (:mod:`fairseq_kd.fingerprint`: size,
                            modification time, SHA-256) of the teacher checkpoint and of the split's
                            binarised files, and ``arrays``: each array's dtype, shape and fingerprint
    DIR/offsets.npy         int64 (sentences + 1,): sentence i's tokens are rows offsets[i]:offsets[i+1]
    DIR/topk_logprobs.npy   float32 (tokens, k)
    DIR/topk_ids.npy        int32 (tokens, k)

The build is resumable at any moment: ``progress.json`` (the cache's settings and inputs) is
written first, by the first worker (the others are refused by name when their settings differ);
sentences are processed in shards of ``shard_size`` ids, each written whole as
``DIR/shards/shardNNNNNN.npz`` (a temporary file renamed once complete: a shard that exists is
complete) after its record ``shardNNNNNN.json`` (its SHA-256 and the cache's identity), and once
every shard exists they are merged into the three arrays (staged in ``shards/``, renamed into
place), ``cache.json`` is written last and the shards are deleted; a folder without ``cache.json``
is never read as a cache. A shard skipped as done and every shard merged is hashed and compared
with its record first: a changed, truncated or foreign one is deleted and refused by name. The
merge needs the cache's size twice on disk for a moment. A re-run passes the recorded fingerprints
back, so an unchanged teacher checkpoint or split is not read again. The pass can be split over
workers (``--num-shards --shard-id``, torchrun, srun: :mod:`fairseq_kd.teacher_pass.common`), into
the same arrays.

Training with ``--teacher-cache DIR`` (:meth:`TeacherCache.open`) refuses, before training starts
and in one line naming ``--teacher-cache``, the file and what is wrong, a cache of another teacher,
other data or other dictionaries, and a damaged one (:func:`check_cache`, which a re-run of the
build applies to a finished cache too): ``cache.json`` must be a JSON object with every key; each
array a plain ``.npy`` (its header read without unpickling anything: an array of Python objects
is refused, never loaded) of the dtype and shape the manifest and ``k``, ``n_tokens`` and
``n_sentences`` give, and of the size its header announces; offsets start at 0, never decrease
and end at ``n_tokens``; token ids lie in the target dictionary; log-probabilities are finite and
at most ``LOGPROB_TOLERANCE`` (1e-4) above 0 (log_softmax in float32 gives at most 0; the margin
only spares a teacher whose kernels round differently). The cost at start-up: the offsets and
both top-k arrays are read once, in chunks of :data:`CHECK_ROWS` rows, vectorised (0.3 s per GiB
of arrays from the page cache, measured on the development machine's CPU; reading them from disk
first costs what the disk takes, and warms the page cache for training's own reads). The
checksums follow the data's rule below: an array of the recorded size and modification time is
the one that was hashed and is not read again; another size is refused at once; the same size
with another time (a plain ``cp``) is hashed and compared.

The data check costs no hashing at every start-up either: when the split's files have the names,
sizes and modification times recorded at build time they are the files that were hashed (a
rewrite changes the time; copies made with ``cp -p``, ``rsync -a`` or a move keep it); other sizes
are refused at once, and only files of the same sizes but other times are hashed again and
compared by content.

What a cache is made with (its identity): the teacher's and the split's contents, the
dictionaries, ``k``, and the settings that change its bytes: ``max_tokens`` (the batches' padding),
``shard_size`` (the batches), ``fp16`` and the device (CPU or CUDA). A cache (or ``progress.json``)
of another format (``fairseq-kd-teacher-cache/1`` before fingerprints, ``/2`` before atomic shards
and array checksums, ``/3`` before those settings and the shards' records) is refused in one line,
by training and by the build: build it anew. Set-up, shards, workers and the record's identity
are the teacher pass's (:mod:`fairseq_kd.teacher_pass.common`), shared with sequence-level KD.

With the cache, the teacher distribution at temperature tau is the top-k one renormalised,
``q_i = exp(l_i / tau) / sum_j exp(l_j / tau)`` over the stored log-probabilities ``l``: exact when
the teacher's mass lies within its top k, and otherwise the top-k approximation of the papers above.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..fingerprint import (content, dictionary_sha256, fingerprint, fingerprint_files, record_sha256,
                           write_json)
from .common import (Workers, agree_on_num_shards, check_max_tokens, create_record, device_kind, identity,
                     identity_differences, infer_languages, is_temporary, length_ordered_indices, load_split,
                     load_teacher, merge_lock, merge_when_complete, num_shards_field, on_device, pick_device,
                     rank_group, read_record, refuse_older_format, refuse_shard, shard_batches, shard_count,
                     shard_id_field, shard_problem, shard_progress, shard_range, split_files,
                     translation_task, wait_for_ranks, workers_for, write_shard)
from .common import teacher_fingerprint as fingerprint_of_teacher

CACHE_FORMAT = "fairseq-kd-teacher-cache/4"
#: what a cache is made with besides its inputs (whose contents are compared: :func:`_identity`):
#: every setting that changes its bytes
SETTINGS = ("format", "k", "split", "source_lang", "target_lang", "source_dictionary_sha256",
            "target_dictionary_sha256", "max_tokens", "shard_size", "fp16", "device")
#: how a refusal names each setting and input of the identity
LABELS = {"format": "the format", "k": "--k", "split": "--split", "source_lang": "--source-lang",
          "target_lang": "--target-lang", "source_dictionary_sha256": "the source dictionary (--data)",
          "target_dictionary_sha256": "the target dictionary (--data)", "max_tokens": "--max-tokens",
          "shard_size": "--shard-size", "fp16": "--fp16", "device": "the device (--cpu)",
          "teacher": "--teacher-checkpoint", "data": "the split's files (--data)"}
INPUTS = ("teacher", "data")
MANIFEST = "cache.json"
PROGRESS = "progress.json"
SHARDS = "shards"
OFFSETS, LOGPROBS, TOKEN_IDS = "offsets.npy", "topk_logprobs.npy", "topk_ids.npy"
ARRAYS = (OFFSETS, LOGPROBS, TOKEN_IDS)
DTYPES = {OFFSETS: np.dtype(np.int64), LOGPROBS: np.dtype(np.float32), TOKEN_IDS: np.dtype(np.int32)}
#: keys every cache.json holds
REQUIRED = SETTINGS + ("inputs", "n_sentences", "n_tokens", "arrays")
#: how far above 0 a stored log-probability may be (float rounding), see the module's docstring
LOGPROB_TOLERANCE = 1e-4
#: rows per chunk of the value checks (a chunk of a k = 8 array: 32 MB)
CHECK_ROWS = 1 << 20
FLAG = "--teacher-cache"
REBUILD = "rebuild the cache with fairseq-kd-teacher-cache"
#: what a re-run of the build on a damaged finished cache says to do
BUILD_ANEW = "delete the folder (or choose another --output) and run again to build the cache anew"
logger = logging.getLogger(__name__)


class TeacherCacheError(ValueError):
    """A cache cannot be built or used as asked; the message names the flag or file and what to do."""


@dataclass
class CacheConfig:
    """Inputs of :func:`build_cache`, one flag of ``fairseq-kd-teacher-cache`` each (``--field-name``)."""

    data: Path = field(metadata={"help": "fairseq-preprocess --destdir of the training data"})
    teacher_checkpoint: Path = field(metadata={"help": "the teacher: a fairseq checkpoint, or a Hugging Face "
                                                       "save_pretrained folder (the hf extra)"})
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
    num_shards: Optional[int] = num_shards_field()
    shard_id: Optional[int] = shard_id_field()


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


def _refuse_other_identity(recorded: dict, parameters: dict, what: str, path: Path) -> None:
    """Refuse, naming each setting that differs, a record (``path``) of another cache than
    ``parameters`` describe."""
    differences = identity_differences(_identity(recorded), _identity(parameters), LABELS, INPUTS)
    if differences:
        raise TeacherCacheError(f"{what} made with other settings or inputs: {'; '.join(differences)} ({path}); "
                                "run with the recorded settings (every worker of a cache needs them), or choose "
                                "another --output")


def _refuse_older_format(record: dict, what: str) -> None:
    refuse_older_format(record.get("format"), CACHE_FORMAT, what,
                        "build the cache anew: re-run fairseq-kd-teacher-cache into another folder", TeacherCacheError)


def _shard_path(output: Path, shard: int) -> Path:
    return Path(output) / SHARDS / f"shard{shard:06d}.npz"


# ----------------------------------------------------------------------------- building
def build_cache(config: CacheConfig, log: Callable[[str], None] = print) -> Path:
    """Run the teacher over ``config.split`` of ``config.data`` and write the cache (resumably;
    this worker's shards of it when the pass is split, and the arrays once every shard exists)."""
    workers = workers_for(config.num_shards, config.shard_id, TeacherCacheError)
    log = workers.log(log)
    if config.k < 1:
        raise TeacherCacheError(f"--k must be at least 1, got {config.k}")
    if config.shard_size < 1 or config.max_tokens < 1:
        raise TeacherCacheError("--shard-size and --max-tokens must be positive")
    output = Path(config.output)
    task, teacher, parameters, existing, interrupted = _set_up(config)
    vocabulary = len(task.target_dictionary)
    if not _start_or_resume(output, parameters, existing, interrupted, vocabulary, workers, log):
        return output
    pass_identity = record_sha256(_identity(parameters))
    dataset = load_split(task, config.split)
    too_small = check_max_tokens(dataset, config.max_tokens, config.split)
    if too_small:
        raise TeacherCacheError(too_small)
    offsets = np.zeros(len(dataset) + 1, dtype=np.int64)
    np.cumsum(np.asarray(dataset.tgt_sizes, dtype=np.int64), out=offsets[1:])
    n_shards = shard_count(len(dataset), config.shard_size)
    with rank_group(workers):
        _cache_own_shards(config, workers, task, teacher, dataset, offsets, pass_identity, log)
        wait_for_ranks(workers)
        merge_when_complete(output, workers, n_shards, missing=lambda: _missing_shards(output, n_shards),
                            merged=lambda: (output / MANIFEST).is_file(),
                            merge=lambda: _merge(config, parameters, offsets, vocabulary, pass_identity, log),
                            log=log)
    return output


def _set_up(config: CacheConfig):
    """``(task, teacher, parameters, existing cache.json, interrupted progress.json)``, every input
    checked; the recorded fingerprints are reused for unchanged inputs."""
    data, output = Path(config.data), Path(config.output)
    src, tgt = infer_languages(data, config.source_lang, config.target_lang, TeacherCacheError)
    data_files = _split_of(data, config.split, src, tgt)
    existing = read_manifest(output, f"--output {output}", BUILD_ANEW) if (output / MANIFEST).exists() else None
    interrupted = read_record(output / PROGRESS)
    if interrupted is not None:
        _refuse_older_format(interrupted.get("parameters") or {}, f"--output {output}: {PROGRESS}")
    recorded = (existing or (interrupted or {}).get("parameters") or {}).get("inputs") or {}
    # fingerprinted first, so that a recorded checksum saves reading an unchanged checkpoint (a
    # Hugging Face folder: its files' and its digest, what TeacherCache.open compares); a missing or
    # unreadable one is left to the teacher loader's message
    teacher_fingerprint = fingerprint_of_teacher(Path(config.teacher_checkpoint), recorded.get("teacher"))
    task = translation_task(data, src, tgt, config.split)
    teacher = load_teacher(task, config.teacher_checkpoint, config.teacher_data,
                           teacher_fingerprint and teacher_fingerprint["sha256"])
    if config.k > len(task.target_dictionary):
        raise TeacherCacheError(f"--k {config.k} exceeds the target vocabulary ({len(task.target_dictionary)} symbols)")
    parameters = {
        "format": CACHE_FORMAT, "k": config.k, "split": config.split, "source_lang": src, "target_lang": tgt,
        "source_dictionary_sha256": dictionary_sha256(task.source_dictionary),
        "target_dictionary_sha256": dictionary_sha256(task.target_dictionary),
        "max_tokens": config.max_tokens, "shard_size": config.shard_size, "fp16": config.fp16,
        "device": device_kind(config.cpu),
        "inputs": {"teacher": teacher_fingerprint, "data": fingerprint_files(data_files, recorded.get("data"))},
        "teacher_path": str(config.teacher_checkpoint),
    }
    return task, teacher, parameters, existing, interrupted


def _start_or_resume(output: Path, parameters: dict, existing: Optional[dict], interrupted: Optional[dict],
                     vocabulary: int, workers: Workers, log: Callable[[str], None]) -> bool:
    """Whether shards remain to be made or merged: False when ``output`` holds this cache,
    complete and sound; refuses a folder that holds anything else, and a worker whose settings
    (or, in a job array, ``--num-shards``) differ from those recorded by the first."""
    if existing is not None:
        _refuse_other_identity(existing, parameters, f"--output {output}: holds a cache", output / MANIFEST)
        _confirm_complete(output, existing, parameters, vocabulary)
        log(f"{output}: the cache is already complete (same teacher, data and settings; its arrays checked); "
            "nothing to do")
        return False
    theirs = [path.name for path in output.iterdir() if not is_temporary(path)] if output.is_dir() else []
    if theirs and PROGRESS not in theirs:
        raise TeacherCacheError(f"--output {output}: the folder is not empty and holds no cache; choose another folder")
    progress = {"parameters": parameters}
    if interrupted is None:  # a new cache, unless a worker started at the same time created it
        interrupted = create_record(output / PROGRESS, progress)
        if interrupted is not None:
            _refuse_older_format(interrupted.get("parameters") or {}, f"--output {output}: {PROGRESS}")
    if interrupted is not None:
        _refuse_other_identity(interrupted.get("parameters") or {}, parameters,
                               f"--output {output}: holds an interrupted cache", output / PROGRESS)
        if progress != interrupted:  # inputs touched since: their fingerprints now
            write_json(output / PROGRESS, progress)
    agree_on_num_shards(output / SHARDS, workers, TeacherCacheError)
    return True


def _confirm_complete(output: Path, manifest: dict, parameters: dict, vocabulary: int) -> None:
    """A re-run on a finished cache: check it as training would, record the fingerprints as
    they are now, and remove what a merge killed after writing ``cache.json`` left."""
    _, array_fingerprints = check_cache(output, manifest, vocabulary, f"--output {output}", fix=BUILD_ANEW)
    arrays = {name: {**record, "fingerprint": array_fingerprints[name]} for name, record in manifest["arrays"].items()}
    refreshed = {**manifest, **parameters, "arrays": arrays}
    if refreshed != manifest:  # inputs or arrays touched since: their fingerprints now
        write_json(output / MANIFEST, refreshed)
    if (output / SHARDS).exists() or (output / PROGRESS).exists():
        with merge_lock(output) as holder:
            if holder is None:
                shutil.rmtree(output / SHARDS, ignore_errors=True)
                (output / PROGRESS).unlink(missing_ok=True)


def _missing_shards(output: Path, n_shards: int) -> List[int]:
    return [shard for shard in range(n_shards) if not _shard_path(output, shard).is_file()]


def _cache_own_shards(config: CacheConfig, workers: Workers, task, teacher, dataset, offsets: np.ndarray,
                      pass_identity: str, log: Callable[[str], None]) -> None:
    """Run the teacher over this worker's shards not written yet, each written whole with its
    record (:func:`fairseq_kd.teacher_pass.common.write_shard`) once computed; those done are
    checked against their records first."""
    output = Path(config.output)
    n_sentences = len(offsets) - 1
    n_shards = shard_count(n_sentences, config.shard_size)
    owned = workers.owned(range(n_shards))
    if (output / MANIFEST).is_file():  # merged meanwhile by another worker
        return
    _check_shards([shard for shard in owned if _shard_path(output, shard).is_file()], output, n_sentences,
                  config.shard_size, pass_identity)
    pending = [shard for shard in owned if not _shard_path(output, shard).is_file()]
    if not pending:
        return
    (output / SHARDS).mkdir(exist_ok=True)
    device = pick_device(config.cpu, workers)
    model = on_device(teacher.model, device, config.fp16)
    pad = task.target_dictionary.pad()
    ordered = length_ordered_indices(dataset)
    with shard_progress(pending, config.shard_size, n_sentences, "teacher cache", log,
                        shown=workers.reports) as (on_batch, log_line):
        for shard in pending:
            logprobs, token_ids = _teacher_on_shard(model, dataset, ordered, offsets, pad, device, config, shard,
                                                    on_batch)
            payload = io.BytesIO()
            np.savez(payload, logprobs=logprobs, token_ids=token_ids)
            first, last = shard_range(shard, config.shard_size, n_sentences)
            write_shard(_shard_path(output, shard), payload.getvalue(), pass_identity, shard, (first, last))
            log_line(f"{workers.label}shard {shard + 1}/{n_shards}: sentences {first}..{last - 1}")


def _teacher_on_shard(model, dataset, ordered, offsets, pad: int, device, config: CacheConfig, shard: int,
                      on_batch: Callable[[int], None]) -> Tuple[np.ndarray, np.ndarray]:
    """The top-k rows of the sentences of shard ``shard``: ``(log-probabilities, token ids)``."""
    first, last = shard_range(shard, config.shard_size, len(offsets) - 1)
    base, rows = int(offsets[first]), int(offsets[last] - offsets[first])
    logprobs = np.zeros((rows, config.k), dtype=np.float32)
    token_ids = np.zeros((rows, config.k), dtype=np.int32)
    for batch_ids in shard_batches(dataset, ordered, first, last, config.max_tokens):
        sample = dataset.collater([dataset[int(i)] for i in batch_ids])
        net_input = {key: value.to(device) for key, value in sample["net_input"].items()}
        with torch.no_grad():
            logits = model(**net_input)[0]
        values, indices = torch.log_softmax(logits.float(), dim=-1).topk(config.k, dim=-1)
        target = sample["target"]
        mask = target.ne(pad).numpy()
        positions = offsets[sample["id"].numpy()][:, None] - base + np.arange(target.size(1))[None, :]
        logprobs[positions[mask]] = values.cpu().numpy()[mask]
        token_ids[positions[mask]] = indices.cpu().numpy().astype(np.int32)[mask]
        on_batch(len(batch_ids))
    return logprobs, token_ids


def _check_shards(shards: List[int], output: Path, n_sentences: int, shard_size: int, pass_identity: str) -> None:
    """Refuse (:func:`fairseq_kd.teacher_pass.common.refuse_shard`) the first of these done
    shards that is not what its record says this cache wrote."""
    for shard in shards:
        path = _shard_path(output, shard)
        problem = shard_problem(path, pass_identity, shard, shard_range(shard, shard_size, n_sentences))
        if problem is not None:
            refuse_shard(path, problem, f"--output {output}: {SHARDS}/{path.name}", TeacherCacheError)


def _merge(config: CacheConfig, parameters: dict, offsets: np.ndarray, vocabulary: int, pass_identity: str,
           log: Callable[[str], None]) -> None:
    """Every shard exists: check each against its record, assemble the three arrays (staged in
    ``shards/``, renamed into place), write ``cache.json`` with their fingerprints, then delete
    the shards and ``progress.json`` (one worker, under the merge lock)."""
    output, k = Path(config.output), config.k
    staging = output / SHARDS
    n_sentences, n_tokens = len(offsets) - 1, int(offsets[-1])
    _check_shards(list(range(shard_count(n_sentences, config.shard_size))), output, n_sentences, config.shard_size,
                  pass_identity)
    logprobs = np.lib.format.open_memmap(staging / LOGPROBS, mode="w+", dtype=np.float32, shape=(n_tokens, k))
    token_ids = np.lib.format.open_memmap(staging / TOKEN_IDS, mode="w+", dtype=np.int32, shape=(n_tokens, k))
    for shard in range(shard_count(n_sentences, config.shard_size)):
        first, last = shard_range(shard, config.shard_size, n_sentences)
        rows = slice(int(offsets[first]), int(offsets[last]))
        logprobs[rows], token_ids[rows] = _read_shard(output, shard, rows.stop - rows.start, k, vocabulary)
    logprobs.flush()
    token_ids.flush()
    del logprobs, token_ids
    np.save(staging / OFFSETS, offsets)
    for name in ARRAYS:
        os.replace(staging / name, output / name)
    arrays = {name: {"dtype": DTYPES[name].name, "shape": list(shape), "fingerprint": fingerprint(output / name)}
              for name, shape in ((OFFSETS, (n_sentences + 1,)), (LOGPROBS, (n_tokens, k)), (TOKEN_IDS, (n_tokens, k)))}
    write_json(output / MANIFEST, {**parameters, "n_sentences": n_sentences, "n_tokens": n_tokens, "arrays": arrays})
    shutil.rmtree(staging)
    (output / PROGRESS).unlink(missing_ok=True)
    log(f"{output}: top-{k} teacher log-probabilities of {n_tokens} target tokens "
        f"({n_sentences} sentences of the {config.split} split)")


def _read_shard(output: Path, shard: int, rows: int, k: int, vocabulary: int) -> Tuple[np.ndarray, np.ndarray]:
    """A shard's ``(log-probabilities, token ids)``, checked like a cache's arrays; a damaged shard
    is deleted (the next run computes it again) and refused."""
    path = _shard_path(output, shard)
    try:
        with np.load(path, allow_pickle=False) as stored:
            logprobs, token_ids = stored["logprobs"], stored["token_ids"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        problem = f"unreadable ({str(error).splitlines()[0]})"
    else:
        problem = next((found for found in (
            _shape_problem("log-probabilities", logprobs, DTYPES[LOGPROBS], (rows, k)),
            _shape_problem("token ids", token_ids, DTYPES[TOKEN_IDS], (rows, k)),
            _logprob_problem(logprobs), _token_id_problem(token_ids, vocabulary)) if found), None)
    if problem is None:
        return logprobs, token_ids
    refuse_shard(path, f"is damaged: {problem}", f"--output {output}: {SHARDS}/{path.name}", TeacherCacheError)


def _shape_problem(what: str, array: np.ndarray, dtype: np.dtype, shape: tuple) -> Optional[str]:
    if array.dtype != dtype:
        return f"its {what} are {array.dtype}, not {dtype}"
    if array.shape != shape:
        return f"its {what} have shape {array.shape}, not {shape}"
    return None


# ----------------------------------------------------------------------------- checking a cache
def read_manifest(folder: Path, what: str, fix: str = REBUILD) -> dict:
    """``folder``'s ``cache.json``, a JSON object of this format with every key
    (:data:`REQUIRED`), or a one-line :class:`TeacherCacheError` starting with ``what`` (the flag
    and the folder) and ending with ``fix``."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        why = ("an interrupted build: run fairseq-kd-teacher-cache again to finish it"
               if (Path(folder) / PROGRESS).is_file() else "run fairseq-kd-teacher-cache to make one")
        raise TeacherCacheError(f"{what}: no finished cache there ({MANIFEST} missing; {why})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise TeacherCacheError(f"{what}: {MANIFEST} is not valid JSON ({error}); {fix}") from None
    if not isinstance(manifest, dict):
        raise TeacherCacheError(f"{what}: {MANIFEST} holds no JSON object; {fix}")
    _refuse_older_format(manifest, f"{what}: {MANIFEST}")
    problem = _manifest_problem(manifest)
    if problem:
        raise TeacherCacheError(f"{what}: {MANIFEST} {problem}; {fix}")
    return manifest


def _manifest_problem(manifest: dict) -> Optional[str]:
    """What a cache.json of this format lacks or holds wrongly, or None."""
    missing = [key for key in REQUIRED if key not in manifest]
    if missing:
        return f"lacks the key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
    for key, least in (("k", 1), ("n_sentences", 0), ("n_tokens", 0)):
        value = manifest[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            return f"holds {key} {value!r}, not a whole number >= {least}"
    inputs, arrays = manifest["inputs"], manifest["arrays"]
    if not (isinstance(inputs, dict) and isinstance(inputs.get("teacher"), dict) and "sha256" in inputs["teacher"]
            and isinstance(inputs.get("data"), dict) and isinstance(inputs["data"].get("files"), dict)):
        return "lacks the inputs' fingerprints ('inputs': 'teacher' with its 'sha256', 'data' with its 'files')"
    for name in ARRAYS:
        record = arrays.get(name) if isinstance(arrays, dict) else None
        if not (isinstance(record, dict) and {"dtype", "shape", "fingerprint"} <= set(record)
                and isinstance(record["fingerprint"], dict) and "sha256" in record["fingerprint"]):
            return f"lacks the record of {name} ('arrays': its 'dtype', 'shape' and 'fingerprint')"
    return None


def check_cache(folder: Path, manifest: dict, vocabulary: int, what: str, fix: str = REBUILD
                ) -> Tuple[Dict[str, np.ndarray], Dict[str, dict]]:
    """``({name: memory-mapped array}, {name: its fingerprint now})`` of a cache whose
    ``manifest`` :func:`read_manifest` accepted, once every check of the module's docstring
    passes (``vocabulary``: the target dictionary's size), else a one-line
    :class:`TeacherCacheError` starting with ``what`` that names the file and what is wrong, and
    ends with ``fix``. Training's start-up and a re-run of the build check alike."""
    folder = Path(folder)
    k, n_sentences, n_tokens = manifest["k"], manifest["n_sentences"], manifest["n_tokens"]
    shapes = {OFFSETS: (n_sentences + 1,), LOGPROBS: (n_tokens, k), TOKEN_IDS: (n_tokens, k)}
    arrays = {name: _open_array(folder / name, manifest["arrays"][name], shapes[name], what, fix) for name in ARRAYS}
    checks = ((OFFSETS, lambda: _offsets_problem(arrays[OFFSETS], n_tokens)),
              (LOGPROBS, lambda: _logprob_problem(arrays[LOGPROBS])),
              (TOKEN_IDS, lambda: _token_id_problem(arrays[TOKEN_IDS], vocabulary)))
    for name, problem_of in checks:
        problem = problem_of()
        if problem:
            raise TeacherCacheError(f"{what}: {name} {problem}; {fix}")
    fingerprints = {}
    for name in ARRAYS:
        recorded = manifest["arrays"][name]["fingerprint"]
        fingerprints[name] = fingerprint(folder / name, recorded)  # hashed only when size or time changed
        if content(fingerprints[name]) != content(recorded):
            raise TeacherCacheError(f"{what}: {name} is not the file the cache was built with (its SHA-256 differs "
                                    f"from {MANIFEST}'s); {fix}")
    return arrays, fingerprints


def _open_array(path: Path, record: dict, shape: tuple, what: str, fix: str) -> np.ndarray:
    """``path`` memory-mapped, once its header (read without unpickling) gives the dtype and shape
    the cache needs and the manifest records, and the file is the size its header announces."""
    name, dtype = path.name, DTYPES[path.name]
    if not path.is_file():
        raise TeacherCacheError(f"{what}: {name} missing; {fix}")
    found_shape, found_dtype, data_offset = _npy_header(path, what, fix)
    problem = None
    if found_dtype != dtype:
        problem = f"holds {found_dtype} values where a cache holds {dtype} ({MANIFEST} records {record['dtype']})"
    elif tuple(found_shape) != shape:
        problem = f"has shape {tuple(found_shape)} but {MANIFEST} (k, n_tokens, n_sentences) makes it {shape}"
    elif record["dtype"] != dtype.name or tuple(record["shape"]) != shape:
        problem = (f"is recorded in {MANIFEST} as {record['dtype']} {tuple(record['shape'])}, not as the "
                   f"{dtype.name} {shape} its k, n_tokens and n_sentences give")
    elif path.stat().st_size != data_offset + int(np.prod(shape)) * dtype.itemsize:
        problem = (f"is {path.stat().st_size} bytes where its header announces "
                   f"{data_offset + int(np.prod(shape)) * dtype.itemsize}: truncated or damaged")
    if problem:
        raise TeacherCacheError(f"{what}: {name} {problem}; {fix}")
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _npy_header(path: Path, what: str, fix: str) -> Tuple[tuple, np.dtype, int]:
    """``(shape, dtype, offset of the data)`` from a ``.npy`` header, parsed as a literal (never
    unpickled); a file that is no plain numeric ``.npy`` is refused."""
    with open(path, "rb") as handle:
        try:
            version = np.lib.format.read_magic(handle)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f".npy version {version[0]}.{version[1]}")
            shape, _fortran_order, dtype = read_header(handle)
        except ValueError as error:
            raise TeacherCacheError(f"{what}: {path.name} is not a plain .npy array ({str(error).splitlines()[0]}); "
                                    f"{fix}") from None
        offset = handle.tell()
    if dtype.hasobject:
        raise TeacherCacheError(f"{what}: {path.name} holds Python objects (a pickle), not numbers; it is not read; "
                                f"{fix}")
    return shape, dtype, offset


def _offsets_problem(offsets: np.ndarray, n_tokens: int) -> Optional[str]:
    """Offsets must start at 0, never decrease and end at ``n_tokens``."""
    values = np.asarray(offsets)
    if len(values) and values.min() < 0:
        return f"holds a negative offset ({int(values.min())}, sentence {int(values.argmin())})"
    if values[0] != 0:
        return f"starts at {int(values[0])}, not 0"
    decreasing = np.flatnonzero(np.diff(values) < 0)
    if len(decreasing):
        return f"decreases after sentence {int(decreasing[0])} ({int(values[decreasing[0]])} then " \
               f"{int(values[decreasing[0] + 1])})"
    if values[-1] != n_tokens:
        return f"ends at {int(values[-1])}, not at n_tokens {n_tokens}"
    return None


def _logprob_problem(logprobs: np.ndarray) -> Optional[str]:
    """Log-probabilities must be finite and at most :data:`LOGPROB_TOLERANCE`."""
    for start in range(0, len(logprobs), CHECK_ROWS):
        chunk = np.asarray(logprobs[start:start + CHECK_ROWS])
        bad = ~np.isfinite(chunk) | (chunk > LOGPROB_TOLERANCE)
        if bad.any():
            row, column = np.argwhere(bad)[0]
            value = float(chunk[row, column])
            kind = "not a finite number" if not np.isfinite(value) else "a log-probability above 0"
            return f"holds {value:g} at row {start + int(row)} ({kind})"
    return None


def _token_id_problem(token_ids: np.ndarray, vocabulary: int) -> Optional[str]:
    """Token ids must index the target dictionary: ``0 <= id < vocabulary``."""
    for start in range(0, len(token_ids), CHECK_ROWS):
        chunk = np.asarray(token_ids[start:start + CHECK_ROWS])
        bad = (chunk < 0) | (chunk >= vocabulary)
        if bad.any():
            row, column = np.argwhere(bad)[0]
            return (f"holds token id {int(chunk[row, column])} at row {start + int(row)}, outside the target "
                    f"dictionary (0..{vocabulary - 1})")
    return None


def _same_data(manifest: dict, files: List[Path]) -> bool:
    """Whether ``files`` hold the data the cache was built from (see the module's docstring);
    re-hashes only files of the recorded sizes whose modification times differ."""
    recorded = manifest["inputs"]["data"]
    sizes = {path.name: path.stat().st_size for path in files}
    if {name: fp.get("size") for name, fp in recorded["files"].items()} != sizes:
        return False  # other names or sizes: other data, known without reading a file
    return content(fingerprint_files(files, recorded)) == content(recorded)


class TeacherCache:
    """A finished cache, checked against the training run that reads it (``--teacher-cache``)."""

    def __init__(self, path: Path, manifest: dict, arrays: Dict[str, np.ndarray]):
        self.path = Path(path)
        self.manifest = manifest
        self.k = int(manifest["k"])
        self.offsets, self.logprobs, self.token_ids = (arrays[name] for name in ARRAYS)

    @property
    def teacher_sha256(self) -> str:
        """The teacher checkpoint's SHA-256 (the digest of its fingerprint)."""
        return self.manifest["inputs"]["teacher"]["sha256"]

    @classmethod
    def open(cls, path: str, task, teacher_sha256: Optional[str] = None) -> "TeacherCache":
        """Open ``path`` for ``task``'s training data: refuse another teacher, data or dictionaries
        and a damaged cache (:func:`check_cache`), in one line, before training starts."""
        folder, what = Path(path), f"{FLAG} {path}"
        manifest = read_manifest(folder, what)
        split = task.cfg.train_subset
        if manifest["split"] != split:
            raise TeacherCacheError(f"{what} holds the {manifest['split']!r} split, but training reads "
                                    f"{split!r} (--train-subset)")
        for side, dictionary in (("source", task.source_dictionary), ("target", task.target_dictionary)):
            if manifest[f"{side}_dictionary_sha256"] != dictionary_sha256(dictionary):
                raise TeacherCacheError(f"{what} was made with another {side} dictionary than the data's "
                                        f"({task.cfg.data}): its token ids would index other symbols")
        if not _same_data(manifest, _split_of(Path(task.cfg.data.split(os.pathsep)[0]), split,
                                              task.cfg.source_lang, task.cfg.target_lang)):
            raise TeacherCacheError(f"{what} was made for other {split} data than {task.cfg.data} holds "
                                    "(the binarised files differ); rebuild it for this data")
        recorded_teacher = manifest["inputs"]["teacher"]["sha256"]
        if teacher_sha256 is not None and teacher_sha256 != recorded_teacher:
            raise TeacherCacheError(
                f"{what} was made by teacher sha256 {recorded_teacher[:12]} "
                f"({manifest.get('teacher_path')}), not by --teacher-checkpoint (sha256 {teacher_sha256[:12]})")
        arrays, _ = check_cache(folder, manifest, len(task.target_dictionary), what)
        return cls(folder, manifest, arrays)

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
