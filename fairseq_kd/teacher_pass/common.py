"""What every offline pass of the frozen teacher over a binarised split shares (sequence-level KD,
:mod:`.seqkd`; the top-k cache, :mod:`.teacher_cache`): set-up, shards and their records, the
pass's resumable record and identity, workers (job arrays, torchrun, srun), merging once, locks.
How and why: ``docs/design/teacher_passes.md``.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, List, Mapping, Optional, Tuple, Type

import numpy as np
import torch

from ..errors import FileAccessError, UserError, message_of
from ..fingerprint import bytes_sha256, content, file_sha256, read_json, write_json
from ..progress import print_above_bars, progress_bar

#: seed of the tie-breaking shuffle in ``ordered_indices`` (fairseq-generate's default --seed)
ORDER_SEED = 1


# ----------------------------------------------------------------------------- set-up
def infer_languages(data: Path, source_lang: Optional[str], target_lang: Optional[str],
                    error: Type[Exception]) -> Tuple[str, str]:
    """The languages given, else fairseq's TranslationTask.setup_task rule; ``error`` when none."""
    if source_lang and target_lang:
        return source_lang, target_lang
    from fairseq.data import data_utils

    src, tgt = data_utils.infer_language_pair(str(data))
    if src is None or tgt is None:
        raise error(f"--data {data}: cannot infer the language pair (no <split>.<src>-<tgt>.* files); pass "
                    "--source-lang and --target-lang")
    return src, tgt


def translation_task(data: Path, src: str, tgt: str, split: str):
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    return TranslationTask.setup_task(TranslationConfig(
        data=str(data), source_lang=src, target_lang=tgt, train_subset=split,
        dataset_impl=None, required_seq_len_multiple=1))  # dataset_impl None: inferred per file


def load_split(task, split: str):
    task.load_dataset(split, combine=True)
    return task.dataset(split)


def load_teacher(task, checkpoint, teacher_data: Optional[str], sha256: Optional[str]):
    from ..models.teachers import load_teacher as load  # registers the architectures

    return load(str(checkpoint), task, teacher_data=teacher_data, sha256=sha256)


def teacher_fingerprint(path: Path, recorded: Optional[dict] = None) -> Optional[dict]:
    """A teacher's fingerprint, ``sha256`` its digest (a folder's: ``folder_sha256``, as training
    binds it); ``recorded``'s checksums reused; None when unreadable (the loader says why)."""
    from ..fingerprint import fingerprint

    path = Path(path)
    if path.is_file() and os.access(path, os.R_OK):
        return fingerprint(path, recorded)
    if not path.is_dir():
        return None
    from ..models.hf_teacher import folder_sha256

    files = fingerprint(path, recorded)
    digests = {name: record["sha256"] for name, record in files["files"].items()}
    return {**files, "sha256": folder_sha256(path, digests)}


def device_kind(cpu: bool) -> str:
    return "cpu" if cpu or not torch.cuda.is_available() else "cuda"


def pick_device(cpu: bool, workers: Optional["Workers"] = None) -> torch.device:
    """A rank takes GPU ``LOCAL_RANK`` modulo the GPUs it sees (``--gpus-per-task=1``: one)."""
    if device_kind(cpu) == "cpu":
        return torch.device("cpu")
    if workers is None or not workers.ranks:
        return torch.device("cuda")
    index = workers.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def on_device(model, device: torch.device, fp16: bool):
    model = model.to(device)
    return model.half() if fp16 else model


# ----------------------------------------------------------------------------- shards
def shard_count(sentences: int, shard_size: int) -> int:
    return (sentences + shard_size - 1) // shard_size


def shard_range(index: int, shard_size: int, sentences: int) -> Tuple[int, int]:
    first = index * shard_size
    return first, min(sentences, first + shard_size)


def length_ordered_indices(dataset):
    """fairseq-generate's sentence order: by length, ties shuffled with a fixed seed."""
    from fairseq.data import data_utils

    with data_utils.numpy_seed(ORDER_SEED):
        return dataset.ordered_indices()


def shard_batches(dataset, ordered, first: int, last: int, max_tokens: Optional[int],
                  max_sentences: Optional[int] = None):
    """A shard's batches, independent of the other shards processed in the same run."""
    indices = ordered[(ordered >= first) & (ordered < last)]
    return dataset.batch_by_size(indices, max_tokens=max_tokens, max_sentences=max_sentences,
                                 required_batch_size_multiple=1)


def check_max_tokens(dataset, max_tokens: Optional[int], split: str, error: Type[Exception]) -> None:
    """Refuse a ``--max-tokens`` that cannot batch ``dataset`` (``batch_by_size`` would assert)."""
    if max_tokens is None or len(dataset) == 0:
        return
    lengths = dataset.num_tokens_vec(np.arange(len(dataset)))
    longest = int(lengths.argmax())
    if lengths[longest] > max_tokens:
        raise error(f"--max-tokens {max_tokens} is smaller than sentence {longest} of --split {split} "
                    f"({int(lengths[longest])} tokens); raise it to at least that")


@contextlib.contextmanager
def shard_progress(shards: List[int], shard_size: int, sentences: int, desc: str,
                   log: Callable[[str], None], shown: bool = True
                   ) -> Iterator[Tuple[Callable[[int], None], Callable[[str], None]]]:
    """``(on_batch, log_line)``: a per-sentence bar on a terminal when ``shown``, ``log`` above it."""
    total = sum(last - first for first, last in (shard_range(i, shard_size, sentences) for i in shards))
    silent = None if shown else io.StringIO()  # not a terminal: the bar stays off
    with progress_bar(total=total, desc=desc, unit="sent", stream=silent) as bar:
        yield bar.update, (print_above_bars(log) if not bar.disable else log)


# ----------------------------------------------------------------------------- the resumable record
def read_record(path: Path) -> Optional[dict]:
    path = Path(path)
    return read_json(path) if path.is_file() else None


def identity(settings: Mapping, inputs: Mapping) -> dict:
    """What a job's output is a function of: its settings and its inputs' contents (not times)."""
    return {**settings, **{name: content(recorded) for name, recorded in inputs.items()}}


def identity_differences(recorded: Mapping, current: Mapping, labels: Mapping[str, str],
                         inputs: Iterable[str]) -> List[str]:
    """A phrase per differing key, sorted, naming it by ``labels``: ``--beam 4 here, 5 in the record``."""
    inputs = set(inputs)
    phrases = []
    for key in sorted(set(recorded) | set(current)):
        here, there, label = current.get(key), recorded.get(key), labels.get(key, key)
        if here != there and key in inputs:
            phrases.append(f"{label}: other content here than in the record")
        elif here != there:
            phrases.append(f"{label} {_shown(here)} here, {_shown(there)} in the record")
    return phrases


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def create_record(path: Path, record: dict) -> Optional[dict]:
    """Write ``record`` as ``path`` unless one is there: None when written here, else the one found
    (``{}`` when unreadable); hard link of a complete temporary file, else ``O_EXCL``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode("utf-8")
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    temporary.write_bytes(text)
    try:
        os.link(temporary, path)
        return None
    except FileExistsError:
        return _settled_record(path)
    except OSError:  # no hard links here
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return _settled_record(path)
        with os.fdopen(handle, "wb") as written:
            written.write(text)
        return None
    finally:
        temporary.unlink(missing_ok=True)


def _settled_record(path: Path) -> dict:
    for _attempt in range(50):  # only a record created without hard links is seen half-written
        record = read_json(path)
        if isinstance(record, dict):
            return record
        time.sleep(0.1)
    return {}


# ----------------------------------------------------------------------------- files several workers write
def replace_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` (``write(handle)``) through this process's temporary file, renamed over it."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


@contextlib.contextmanager
def user_folders(folders: Mapping[str, Path]) -> Iterator[None]:
    """An OSError on a file in one of ``folders`` (``{flag: folder}``), or a full disk, as a
    FileAccessError naming the flag and folder; any other keeps its traceback."""
    try:
        yield
    except UserError:
        raise
    except OSError as error:
        flag = _flag_of(error, folders)
        if flag is None:
            raise
        words = message_of(error) if error.filename is not None else (error.strerror or str(error))
        raise FileAccessError(f"{flag} {folders[flag]}: {words}") from error


def _flag_of(error: OSError, folders: Mapping[str, Path]) -> Optional[str]:
    if error.filename is None:  # a full disk or quota: the output's
        return next(iter(folders)) if error.errno in (errno.ENOSPC, errno.EDQUOT) else None
    path = Path(os.path.abspath(os.fsdecode(error.filename)))
    for flag, folder in folders.items():
        folder = Path(os.path.abspath(folder))
        if path == folder or folder in path.parents:
            return flag
    return None


# ----------------------------------------------------------------------------- shards and their records
SHARD_RECORD_FORMAT = "fairseq-kd-teacher-pass-shard/1"


def write_shard(path: Path, payload: bytes, pass_identity: str, index: int, sentences: Tuple[int, int]) -> None:
    """Shard ``index`` (sentences ``[first, last)``) of pass ``pass_identity``: its record, then it."""
    write_json(Path(path).with_suffix(".json"), {
        "format": SHARD_RECORD_FORMAT, "pass": pass_identity, "shard": index, "sentences": list(sentences),
        "size": len(payload), "sha256": bytes_sha256(payload)})
    replace_atomically(path, lambda handle: handle.write(payload))


def shard_problem(path: Path, pass_identity: str, index: int, sentences: Tuple[int, int]) -> Optional[str]:
    """Why the done shard ``path`` is not what this pass wrote there (hashed whole), or None."""
    record_path = Path(path).with_suffix(".json")
    record = read_json(record_path)
    if not isinstance(record, dict) or record.get("format") != SHARD_RECORD_FORMAT:
        found = "missing" if not record_path.exists() else "unreadable or of another format"
        return f"has no valid record beside it ({record_path.name} {found})"
    if record.get("pass") != pass_identity:
        return f"was written by a pass of other settings or inputs (its record {record_path.name} says so)"
    if record.get("shard") != index or record.get("sentences") != list(sentences):
        return (f"is recorded in {record_path.name} as another shard than {index} "
                f"(sentences {sentences[0]}..{sentences[1] - 1})")
    size = path.stat().st_size
    if size != record.get("size"):
        return f"is {size} bytes where its record {record_path.name} says {record.get('size')}: truncated or changed"
    if file_sha256(path) != record.get("sha256"):
        return f"is not the shard this pass wrote (its SHA-256 differs from {record_path.name}'s): changed on disk"
    return None


def refuse_shard(path: Path, problem: str, what: str, error: Type[Exception]) -> None:
    """Delete a refused shard and its record; ``error`` naming it (``what``) and the fix."""
    Path(path).unlink(missing_ok=True)
    Path(path).with_suffix(".json").unlink(missing_ok=True)
    raise error(f"{what} {problem}; it was deleted: re-run the same command to compute it again")


def missing_shards(path_of: Callable[[int], Path], count: int) -> List[int]:
    return [index for index in range(count) if not path_of(index).is_file()]


def check_shards(path_of: Callable[[int], Path], shards: Iterable[int], pass_identity: str, shard_size: int,
                 sentences: int, where: str, error: Type[Exception], vanished_ok: bool = False) -> None:
    """Refuse the first of these done shards that is not what its record says this pass wrote
    (``where``: the flag, folder and work folder); ``vanished_ok``: skip one removed meanwhile."""
    for index in shards:
        path = path_of(index)
        try:
            problem = shard_problem(path, pass_identity, index, shard_range(index, shard_size, sentences))
        except FileNotFoundError:  # removed meanwhile by a merge of another worker
            if vanished_ok:
                continue
            raise
        if problem is not None:
            refuse_shard(path, problem, f"{where}/{path.name}", error)


def own_pending_shards(workers: "Workers", count: int, path_of: Callable[[int], Path], merged: Callable[[], bool],
                       check: Callable[[List[int]], None]) -> List[int]:
    """This worker's shards not written yet, once those done pass ``check``; none once ``merged()``."""
    owned = workers.owned(range(count))
    if merged():
        return []
    check([index for index in owned if path_of(index).is_file()])
    return [index for index in owned if not path_of(index).is_file()]


# ----------------------------------------------------------------------------- workers
ONE_PROCESS, JOB_ARRAY, TORCHRUN, SRUN = "one process", "job array", "torchrun", "srun"
BARRIER_TIMEOUT = datetime.timedelta(days=2)
MERGE_LOCK = "merge.lock"


def num_shards_field():
    return field(default=None, metadata={"help": (
        "split the pass over N workers of a job array (fairseq's --num-shards), all writing into the same "
        "--output on a shared filesystem with the same flags (a worker whose settings or N differ from the "
        "first's is refused); each processes the resumable shards i with i %% N == --shard-id, and the one "
        "that writes the last shard merges them. Not with torchrun or srun, whose ranks split the pass by "
        "themselves (rank 0 merges)"), "metavar": "N"})


def shard_id_field():
    return field(default=None, metadata={"help": (
        "with --num-shards N: this worker's index, 0 <= I < N (e.g. $SLURM_ARRAY_TASK_ID of an array "
        "counted from 0)"), "metavar": "I"})


@dataclass(frozen=True)
class Workers:
    """This process's part of a pass over ``count`` workers: the shards ``i % count == index``."""

    index: int = 0
    count: int = 1
    launcher: str = ONE_PROCESS
    local_rank: int = 0
    init_method: Optional[str] = None

    @property
    def ranks(self) -> bool:
        return self.launcher in (TORCHRUN, SRUN)

    @property
    def reports(self) -> bool:
        return not self.ranks or self.index == 0

    def owned(self, shards: Iterable[int]) -> List[int]:
        return [shard for shard in shards if shard % self.count == self.index]

    @property
    def label(self) -> str:
        if self.count == 1:
            return ""
        return f"{'rank' if self.ranks else 'worker'} {self.index} of {self.count} ({self.launcher}): "

    def log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        return log if self.reports else (lambda line: None)


def workers_for(num_shards: Optional[int], shard_id: Optional[int], error: Type[Exception],
                environ: Optional[Mapping[str, str]] = None) -> Workers:
    """This process's :class:`Workers`, from ``--num-shards/--shard-id`` or the launcher's environment."""
    environ = os.environ if environ is None else environ
    ranks = _ranks_of(environ, error)
    if shard_id is not None and num_shards is None:
        raise error(f"--shard-id {shard_id} needs --num-shards N, the number of workers of the job array")
    if num_shards is None:
        return ranks or Workers()
    if num_shards < 1:
        raise error(f"--num-shards must be >= 1, got {num_shards}")
    if shard_id is None:
        raise error(f"--num-shards {num_shards} needs --shard-id I, 0 <= I < {num_shards} (this worker's index)")
    if not 0 <= shard_id < num_shards:
        raise error(f"--shard-id {shard_id} is outside 0..{num_shards - 1} (--num-shards {num_shards})")
    if ranks is not None:
        raise error(f"--num-shards/--shard-id split a job array, but this process is rank {ranks.index} of "
                    f"{ranks.count} started by {ranks.launcher}, whose ranks split the pass by themselves: drop "
                    "--num-shards and --shard-id")
    return Workers(shard_id, num_shards, JOB_ARRAY) if num_shards > 1 else Workers()


def _ranks_of(environ: Mapping[str, str], error: Type[Exception]) -> Optional[Workers]:
    """The ranks of torchrun (checked first: it may run inside SLURM) or srun, or None."""
    def number(name: str, default: Optional[int] = None) -> int:
        value = environ.get(name)
        if value is None and default is not None:
            return default
        try:
            return int(value)
        except (TypeError, ValueError):
            raise error(f"{name}={value!r} in the environment is not a whole number") from None

    if "RANK" in environ or "WORLD_SIZE" in environ:
        rank, world = number("RANK"), number("WORLD_SIZE")
        launcher, local, init_method = TORCHRUN, number("LOCAL_RANK", rank), "env://"
    elif number("SLURM_STEP_NUM_TASKS", 1) > 1:
        rank, world = number("SLURM_PROCID"), number("SLURM_STEP_NUM_TASKS")
        launcher, local, init_method = SRUN, number("SLURM_LOCALID", 0), _srun_init_method(environ, error)
    else:
        return None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise error(f"rank {rank} is outside 0..{world - 1} ({launcher}'s environment: world size {world})")
    return Workers(rank, world, launcher, local, init_method)


def _srun_init_method(environ: Mapping[str, str], error: Type[Exception]) -> str:
    address = environ.get("MASTER_ADDR")
    if address is None:
        if environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")) != "1":
            raise error("srun started the ranks on several nodes: export MASTER_ADDR (the first node, e.g. "
                        "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)) and "
                        "MASTER_PORT (a free port) before srun")
        address = "127.0.0.1"
    port = environ.get("MASTER_PORT")
    if port is None:
        job, step = (int(environ.get(name, "0") or 0) for name in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
        port = str(20000 + (job * 16 + step) % 40000)
    return f"tcp://{address}:{port}"


@contextlib.contextmanager
def rank_group(workers: Workers) -> Iterator[None]:
    """torch.distributed (gloo) among the ranks for the block; nothing for other workers."""
    if not workers.ranks:
        yield
        return
    import torch.distributed as dist

    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", init_method=workers.init_method, rank=workers.index,
                                world_size=workers.count, timeout=BARRIER_TIMEOUT)
    try:
        yield
    finally:
        if started_here:
            dist.destroy_process_group()


def wait_for_ranks(workers: Workers) -> None:
    if workers.ranks:
        import torch.distributed as dist

        dist.barrier()


JOB_ARRAY_RECORD = "job_array.json"


@contextlib.contextmanager
def job_array_worker(folder: Path, workers: Workers, error: Type[Exception]) -> Iterator[None]:
    """For the block (not the merge, which removes ``folder``), a job-array worker's ``--num-shards``
    recorded in the work ``folder`` and its ``--shard-id`` claimed, or refused."""
    if workers.launcher != JOB_ARRAY:
        yield
        return
    path = Path(folder) / JOB_ARRAY_RECORD
    found = create_record(path, {"num_shards": workers.count})
    if found is not None and found.get("num_shards") != workers.count:
        raise error(f"--num-shards {workers.count} here, {found.get('num_shards')} in the job array's record at "
                    f"{path}: give every worker of the array the same --num-shards (a run without --num-shards "
                    f"finishes the rest alone; once no worker of that array runs, deleting {path} lets another "
                    "split start)")
    claim = Path(folder) / f"worker{workers.index:06d}.lock"
    with held_lock(claim) as holder:
        if holder is not None:
            raise error(f"--shard-id {workers.index}: another worker of this job array runs with the same index "
                        f"({holder}: {claim}); give each worker its own --shard-id 0..{workers.count - 1} (if no "
                        f"worker of the array is running, delete {claim} and re-run)")
        yield


# ----------------------------------------------------------------------------- merging once
MERGED, MERGED_BEFORE, SHARDS_REMAIN, MERGING_ELSEWHERE, RANK_ZERO_MERGES = (
    "merged", "merged before", "shards remain", "merging elsewhere", "rank 0 merges")


def merge_when_complete(folder: Path, workers: Workers, total: int, missing: Callable[[], List[int]],
                        merged: Callable[[], bool], merge: Callable[[], None], log: Callable[[str], None]) -> str:
    """``merge()`` once every shard exists, in one worker only; one of :data:`MERGED` ...
    :data:`RANK_ZERO_MERGES`. A worker finding shards missing leaves it to the last writer."""
    if workers.ranks and workers.index != 0:
        return RANK_ZERO_MERGES
    absent = missing()
    if absent:
        if merged():
            log(f"{workers.label}another worker has merged the shards; the output is complete")
            return MERGED_BEFORE
        shown = ", ".join(str(shard + 1) for shard in absent[:8]) + (", ..." if len(absent) > 8 else "")
        log(f"{workers.label}{len(absent)} of {total} shards remain ({shown}); "
            + ("re-run to decode them" if workers.count == 1 or workers.ranks
               else "the worker that writes the last one merges (or re-run without --num-shards)"))
        return SHARDS_REMAIN
    with merge_lock(folder) as holder:
        if holder is not None:
            log(f"{workers.label}every shard is done; {holder}")
            return MERGING_ELSEWHERE
        if merged():
            return MERGED_BEFORE
        merge()
        return MERGED


@contextlib.contextmanager
def merge_lock(folder: Path) -> Iterator[Optional[str]]:
    """Hold ``folder``'s merge lock (yields None), or yield who holds it and what to do."""
    path = Path(folder) / MERGE_LOCK
    with held_lock(path) as holder:
        yield None if holder is None else (f"another worker merges ({holder}: {path}); if no worker is running, "
                                           f"delete {path} and re-run")


@contextlib.contextmanager
def held_lock(path: Path) -> Iterator[Optional[str]]:
    """Hold the lock file ``path`` for the block (yields None), or yield who holds it (a phrase)."""
    path = Path(path)
    handle = _take_lock(path)
    if handle is None:
        yield _lock_holder(path)
        return
    try:
        yield None
    finally:
        with contextlib.suppress(FileNotFoundError):  # the merge may have removed the folder
            if os.stat(path).st_ino == os.fstat(handle).st_ino:
                path.unlink()
        os.close(handle)


def _take_lock(path: Path) -> Optional[int]:
    for _attempt in range(3):
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            handle = _stale_lock(path)
            if handle == -1:
                continue  # released meanwhile: try to create it again
            if handle is None:
                return None
        else:
            with contextlib.suppress(OSError):  # a filesystem without flock: the pid tells
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        os.ftruncate(handle, 0)
        os.pwrite(handle, record.encode(), 0)
        return handle
    return None


def _stale_lock(path: Path) -> Optional[int]:
    """A handle of lock ``path`` whose holder is gone, None when held, -1 when it vanished."""
    try:
        handle = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        flocked = True
    except BlockingIOError:
        os.close(handle)
        return None
    except OSError:
        flocked = False
    try:
        same_file = os.stat(path).st_ino == os.fstat(handle).st_ino
    except FileNotFoundError:
        same_file = False
    if not same_file:
        os.close(handle)
        return -1
    holder = _read_lock(path)
    if holder.get("host") == socket.gethostname() and (flocked or not _alive(holder.get("pid"))):
        return handle
    os.close(handle)
    return None


def _read_lock(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        pass
    return True


def _lock_holder(path: Path) -> str:
    holder = _read_lock(path)
    return (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}" if holder
            else "a worker that is starting")
