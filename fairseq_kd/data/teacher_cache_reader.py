"""Training's side of the teacher cache (``--teacher-cache DIR``, written by
:mod:`fairseq_kd.teacher_pass.teacher_cache`): :meth:`TeacherCache.open` checks it against the run
before training starts, :meth:`TeacherCache.lookup` serves a batch's top-k log-probabilities and ids.

The teacher distribution at temperature tau is the stored top-k one renormalised,
``q_i = exp(l_i / tau) / sum_j exp(l_j / tau)``: exact when the teacher's mass lies within its top
k, else the top-k approximation of Tan et al. 2019 (ICLR, arXiv:1902.10461) and Wang et al. 2021
(ACL-IJCNLP, arXiv:2105.12967). What is checked and why: ``docs/design/teacher_passes.md``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..errors import FileAccessError, InputError, UserError, message_of
from ..fingerprint import content, dictionary_sha256, fingerprint, fingerprint_files
from .binarised import split_files

CACHE_FORMAT = "fairseq-kd-teacher-cache/4"
SETTINGS = ("format", "k", "split", "source_lang", "target_lang", "source_dictionary_sha256",
            "target_dictionary_sha256", "max_tokens", "shard_size", "fp16", "device")
MANIFEST = "cache.json"
PROGRESS = "progress.json"
OFFSETS, LOGPROBS, TOKEN_IDS = "offsets.npy", "topk_logprobs.npy", "topk_ids.npy"
ARRAYS = (OFFSETS, LOGPROBS, TOKEN_IDS)
DTYPES = {OFFSETS: np.dtype(np.int64), LOGPROBS: np.dtype(np.float32), TOKEN_IDS: np.dtype(np.int32)}
REQUIRED = SETTINGS + ("inputs", "n_sentences", "n_tokens", "arrays")
LOGPROB_TOLERANCE = 1e-4  # above 0: spares a teacher whose kernels round differently
CHECK_ROWS = 1 << 20  # rows per chunk of the value checks (k = 8: 32 MB)
FLAG = "--teacher-cache"
REBUILD = "rebuild the cache with fairseq-kd-teacher-cache"


class TeacherCacheError(InputError):
    """A cache cannot be built or used as asked; the message names the flag or file and what to do."""


def cache_split_files(data: Path, split: str, src: str, tgt: str) -> List[Path]:
    files = split_files(Path(data), split, src, tgt)
    if not files:
        raise TeacherCacheError(f"--data {data}: no binarised {split} split for {src}-{tgt}")
    return files


def read_manifest(folder: Path, what: str, fix: str = REBUILD) -> dict:
    """``folder``'s ``cache.json`` with every key, else an error starting with ``what``, ending with ``fix``."""
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
    problem = _manifest_problem(manifest)
    if problem:
        raise TeacherCacheError(f"{what}: {MANIFEST} {problem}; {fix}")
    return manifest


def _manifest_problem(manifest: dict) -> Optional[str]:
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
    """``({name: memory-mapped array}, {name: its fingerprint now})`` once every check of
    ``docs/design/teacher_passes.md`` passes, else an error starting with ``what``, ending with ``fix``."""
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
    """``path`` memory-mapped, once its header and size agree with the cache and the manifest."""
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
    """``(shape, dtype, offset of the data)`` of a plain numeric ``.npy``, never unpickled."""
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
    values = np.asarray(offsets)
    if values.min() < 0:
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


def _first_bad(array: np.ndarray, is_bad) -> Optional[tuple]:
    """``(row, value)`` of the first value ``is_bad`` marks, read ``CHECK_ROWS`` rows at a time."""
    for start in range(0, len(array), CHECK_ROWS):
        chunk = np.asarray(array[start:start + CHECK_ROWS])
        bad = np.argwhere(is_bad(chunk))
        if len(bad):
            return start + int(bad[0][0]), chunk[tuple(bad[0])]
    return None


def _logprob_problem(logprobs: np.ndarray) -> Optional[str]:
    found = _first_bad(logprobs, lambda chunk: ~np.isfinite(chunk) | (chunk > LOGPROB_TOLERANCE))
    if found is None:
        return None
    kind = "not a finite number" if not np.isfinite(found[1]) else "a log-probability above 0"
    return f"holds {float(found[1]):g} at row {found[0]} ({kind})"


def _token_id_problem(token_ids: np.ndarray, vocabulary: int) -> Optional[str]:
    found = _first_bad(token_ids, lambda chunk: (chunk < 0) | (chunk >= vocabulary))
    return None if found is None else (f"holds token id {int(found[1])} at row {found[0]}, outside the target "
                                       f"dictionary (0..{vocabulary - 1})")


def _same_data(manifest: dict, files: List[Path]) -> bool:
    """Whether ``files`` hold the data the cache was built from (only changed times are hashed)."""
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
        return self.manifest["inputs"]["teacher"]["sha256"]

    @classmethod
    def open(cls, path: str, task, teacher_sha256: Optional[str] = None) -> "TeacherCache":
        """Open ``path`` for ``task``'s data; refuse another teacher, data or dictionaries, or damage."""
        folder, what = Path(path), f"{FLAG} {path}"
        try:
            manifest = read_manifest(folder, what)
            split = task.cfg.train_subset
            if manifest["split"] != split:
                raise TeacherCacheError(f"{what} holds the {manifest['split']!r} split, but training reads "
                                        f"{split!r} (--train-subset)")
            for side, dictionary in (("source", task.source_dictionary), ("target", task.target_dictionary)):
                if manifest[f"{side}_dictionary_sha256"] != dictionary_sha256(dictionary):
                    raise TeacherCacheError(f"{what} was made with another {side} dictionary than the data's "
                                            f"({task.cfg.data}): its token ids would index other symbols")
            data = Path(task.cfg.data.split(os.pathsep)[0])
            if not _same_data(manifest, cache_split_files(data, split, task.cfg.source_lang, task.cfg.target_lang)):
                raise TeacherCacheError(f"{what} was made for other {split} data than {task.cfg.data} holds "
                                        "(the binarised files differ); rebuild it for this data")
            recorded_teacher = manifest["inputs"]["teacher"]["sha256"]
            if teacher_sha256 is not None and teacher_sha256 != recorded_teacher:
                raise TeacherCacheError(
                    f"{what} was made by teacher sha256 {recorded_teacher[:12]} "
                    f"({manifest.get('teacher_path')}), not by --teacher-checkpoint (sha256 {teacher_sha256[:12]})")
            arrays, _ = check_cache(folder, manifest, len(task.target_dictionary), what)
            return cls(folder, manifest, arrays)
        except OSError as error:  # the system's refusal to read the cache or the data
            if isinstance(error, UserError):
                raise
            raise FileAccessError(f"{what}: {message_of(error)}") from error

    def lookup(self, sentence_ids: torch.Tensor, target_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The top-k ``(log-probabilities, token ids)``, ``(batch, tgt_len, k)`` each, zeros at padding."""
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
