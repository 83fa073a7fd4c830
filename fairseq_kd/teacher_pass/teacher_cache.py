"""An offline teacher: its top-k next-token log-probabilities for every target token of a training
set (Tan et al. 2019, ICLR, arXiv:1902.10461, and Wang et al. 2021, ACL-IJCNLP, arXiv:2105.12967,
distil from the top 8).

:func:`build_cache` runs the teacher once over a binarised split with teacher forcing and stores,
per target token in sentence-id order, the ``k`` largest log-probabilities (float32, temperature 1)
and their token ids (int32) as ``.npy`` arrays beside ``cache.json``, written last. Resumable and
splittable over workers in shards (:mod:`.common`). Training reads it through
:mod:`fairseq_kd.data.teacher_cache_reader`. Layout and checks: ``docs/design/teacher_passes.md``.
"""
from __future__ import annotations

import io
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from ..data.teacher_cache_reader import (  # noqa: F401  (TeacherCache: the reader, named here too)
    ARRAYS, CACHE_FORMAT, DTYPES, LOGPROBS, MANIFEST, OFFSETS, PROGRESS, SETTINGS, TOKEN_IDS, TeacherCache,
    TeacherCacheError, _logprob_problem, _token_id_problem, cache_split_files, check_cache, read_manifest)
from ..fingerprint import dictionary_sha256, fingerprint, fingerprint_files, record_sha256, write_json
from .common import (Workers, check_max_tokens, check_shards, create_record, device_kind, identity,
                     identity_differences, infer_languages, is_temporary, job_array_worker, length_ordered_indices,
                     load_split, load_teacher, merge_lock, merge_when_complete, missing_shards, num_shards_field,
                     on_device, own_pending_shards, pick_device, rank_group, read_record, refuse_shard, shard_batches,
                     shard_count, shard_id_field, shard_progress, shard_range, translation_task, user_folders,
                     wait_for_ranks, workers_for, write_shard)
from .common import teacher_fingerprint as fingerprint_of_teacher

LABELS = {"format": "the format", "k": "--k", "split": "--split", "source_lang": "--source-lang",
          "target_lang": "--target-lang", "source_dictionary_sha256": "the source dictionary (--data)",
          "target_dictionary_sha256": "the target dictionary (--data)", "max_tokens": "--max-tokens",
          "shard_size": "--shard-size", "fp16": "--fp16", "device": "the device (--cpu)",
          "teacher": "--teacher-checkpoint", "data": "the split's files (--data)"}
INPUTS = ("teacher", "data")
SHARDS = "shards"
BUILD_ANEW = "delete the folder (or choose another --output) and run again to build the cache anew"


@dataclass
class CacheConfig:
    """Inputs of :func:`build_cache`, one flag of ``fairseq-kd-teacher-cache`` each."""

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


def _identity(record: dict) -> dict:
    return identity({key: record.get(key) for key in SETTINGS}, record.get("inputs") or {})


def _refuse_other_identity(recorded: dict, parameters: dict, what: str, path: Path) -> None:
    differences = identity_differences(_identity(recorded), _identity(parameters), LABELS, INPUTS)
    if differences:
        raise TeacherCacheError(f"{what} made with other settings or inputs: {'; '.join(differences)} ({path}); "
                                "run with the recorded settings (every worker of a cache needs them), or choose "
                                "another --output")


def _shard_path(output: Path, shard: int) -> Path:
    return Path(output) / SHARDS / f"shard{shard:06d}.npz"


# ----------------------------------------------------------------------------- building
def build_cache(config: CacheConfig, log: Callable[[str], None] = print) -> Path:
    """Write the cache of ``config`` (this worker's shards; the arrays once every shard exists)."""
    workers = workers_for(config.num_shards, config.shard_id, TeacherCacheError)
    log = workers.log(log)
    if config.k < 1:
        raise TeacherCacheError(f"--k must be at least 1, got {config.k}")
    if config.shard_size < 1 or config.max_tokens < 1:
        raise TeacherCacheError("--shard-size and --max-tokens must be positive")
    output = Path(config.output)
    with user_folders({"--output": output, "--data": Path(config.data)}):
        task, teacher, parameters, existing, interrupted = _set_up(config)
        vocabulary = len(task.target_dictionary)
        if not _start_or_resume(output, parameters, existing, interrupted, vocabulary, log):
            return output
        pass_identity = record_sha256(_identity(parameters))
        dataset = load_split(task, config.split)
        check_max_tokens(dataset, config.max_tokens, config.split, TeacherCacheError)
        offsets = np.zeros(len(dataset) + 1, dtype=np.int64)
        np.cumsum(np.asarray(dataset.tgt_sizes, dtype=np.int64), out=offsets[1:])
        n_shards, shard_path = shard_count(len(dataset), config.shard_size), partial(_shard_path, output)
        with rank_group(workers):
            with job_array_worker(output / SHARDS, workers, TeacherCacheError):  # --shard-id claimed until done
                _cache_own_shards(config, workers, task, teacher, dataset, offsets, pass_identity, log)
            wait_for_ranks(workers)
            merge_when_complete(output, workers, n_shards, missing=lambda: missing_shards(shard_path, n_shards),
                                merged=lambda: (output / MANIFEST).is_file(),
                                merge=lambda: _merge(config, parameters, offsets, vocabulary, pass_identity, log),
                                log=log)
    return output


def _set_up(config: CacheConfig):
    """``(task, teacher, parameters, existing cache.json, interrupted progress.json)``, inputs checked."""
    data, output = Path(config.data), Path(config.output)
    src, tgt = infer_languages(data, config.source_lang, config.target_lang, TeacherCacheError)
    data_files = cache_split_files(data, config.split, src, tgt)
    existing = read_manifest(output, f"--output {output}", BUILD_ANEW) if (output / MANIFEST).exists() else None
    interrupted = read_record(output / PROGRESS)
    recorded = (existing or (interrupted or {}).get("parameters") or {}).get("inputs") or {}
    # before loading: a recorded checksum spares reading an unchanged checkpoint (None: the loader says why)
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
                     vocabulary: int, log: Callable[[str], None]) -> bool:
    """Whether shards remain to be made or merged (False: this cache, complete and sound)."""
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
        _refuse_other_identity(interrupted.get("parameters") or {}, parameters,
                               f"--output {output}: holds an interrupted cache", output / PROGRESS)
        if progress != interrupted:  # inputs touched since: their fingerprints now
            write_json(output / PROGRESS, progress)
    return True


def _confirm_complete(output: Path, manifest: dict, parameters: dict, vocabulary: int) -> None:
    """Check a finished cache as training would, refresh its fingerprints, tidy a killed merge's rest."""
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


def _cache_own_shards(config: CacheConfig, workers: Workers, task, teacher, dataset, offsets: np.ndarray,
                      pass_identity: str, log: Callable[[str], None]) -> None:
    """Run the teacher over this worker's shards not written yet (those done checked first)."""
    output = Path(config.output)
    n_sentences = len(offsets) - 1
    n_shards = shard_count(n_sentences, config.shard_size)
    pending = own_pending_shards(workers, n_shards, partial(_shard_path, output), (output / MANIFEST).is_file,
                                 lambda done: _check_shards(done, output, n_sentences, config.shard_size,
                                                            pass_identity))
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
    """Shard ``shard``'s top-k ``(log-probabilities, token ids)``."""
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
    check_shards(partial(_shard_path, output), shards, pass_identity, shard_size, n_sentences,
                 f"--output {output}: {SHARDS}", TeacherCacheError)


def _merge(config: CacheConfig, parameters: dict, offsets: np.ndarray, vocabulary: int, pass_identity: str,
           log: Callable[[str], None]) -> None:
    """Every shard exists (one worker, under the merge lock): check them, write the arrays (staged in
    ``shards/``), then ``cache.json``, then delete the shards and ``progress.json``."""
    output, k = Path(config.output), config.k
    staging = output / SHARDS
    n_sentences, n_tokens = len(offsets) - 1, int(offsets[-1])
    shards = range(shard_count(n_sentences, config.shard_size))
    _check_shards(list(shards), output, n_sentences, config.shard_size, pass_identity)
    logprobs = np.lib.format.open_memmap(staging / LOGPROBS, mode="w+", dtype=np.float32, shape=(n_tokens, k))
    token_ids = np.lib.format.open_memmap(staging / TOKEN_IDS, mode="w+", dtype=np.int32, shape=(n_tokens, k))
    for shard in shards:
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
    """A shard's ``(log-probabilities, token ids)``, checked like a cache's arrays, else refused."""
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
