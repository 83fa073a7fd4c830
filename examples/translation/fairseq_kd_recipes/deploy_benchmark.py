"""Deploy benchmark: quality, speed, size and memory of a teacher and its students as shipped.

    fairseq-kd-deploy-benchmark --data data-bin/multi30k.de-en --teacher teacher.pt \\
        --student small=checkpoints/word_kd/checkpoint_best.pt --quantizations float32,int8 \\
        --remove-bpe subword_nmt --detok-moses en --ref raw/test.en --ref-is-plain \\
        --workdir deploy-work --output-md deploy.md --output-json deploy.json

(also ``python -m fairseq_kd_recipes.deploy_benchmark``). On one binarised split it compares the
teacher under fairseq, every ``--student`` under fairseq, and every student under CTranslate2 at
each ``--quantizations`` weight type.

How each number is obtained, and what the tables hold: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from fairseq_kd.errors import FILE, FOLDER, InputError, path_problem
from fairseq_kd.fingerprint import file_sha256  # the one hasher; imports neither torch nor fairseq

PROG = "fairseq-kd-deploy-benchmark"
FORMAT = "fairseq-kd-deploy-benchmark/1"
LOGGER = "fairseq_kd_recipes.deploy_benchmark"
DEFAULT_QUANTIZATIONS = "float32,int8"
DEVICES = ("cpu", "cuda")
#: the fairseq rows' precisions and the fairseq-generate flag that gives each
FAIRSEQ_WEIGHTS = {"float32": [], "float16": ["--fp16"], "bfloat16": ["--bf16"]}
TEACHER = "teacher"
FAIRSEQ, CT2 = "fairseq", "ctranslate2"
ENGINE_NAMES = {FAIRSEQ: "fairseq", CT2: "CTranslate2"}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                        r"\(([\d.]+|inf|nan) sentences/s, ([\d.]+|inf|nan) tokens/s\)")
MEMORY_NOTE = ("peak MB: maximum resident set size of the decoding process (os.wait4), i.e. the whole process: "
               "Python, torch, fairseq or CTranslate2, the model and the data, in MiB")


class BenchmarkError(InputError):
    """A decode or an export failed: one line naming the log to read."""


# --------------------------------------------------------------------------- command line


def _csv(value: str) -> List[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    from fairseq_kd.cli.score import add_scoring_arguments

    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    systems = parser.add_argument_group("data and systems")
    systems.add_argument("--data", metavar="DIR", help="binarised data folder (fairseq-preprocess --destdir)")
    systems.add_argument("--gen-subset", default="test", help="split to decode (default: %(default)s)")
    systems.add_argument("-s", "--source-lang", default=None, help="source language (default: from the file names)")
    systems.add_argument("-t", "--target-lang", default=None, help="target language (default: from the file names)")
    systems.add_argument("--teacher", metavar="CKPT", help="the teacher's checkpoint (any fairseq checkpoint the "
                                                          "plugin reads); decoded under fairseq")
    systems.add_argument("--student", metavar="NAME=CKPT", action="append", default=[],
                         help="a student checkpoint and its name in the table (repeat for several; the first is "
                              "the teacher row's baseline); decoded under fairseq and under CTranslate2")
    systems.add_argument("--quantizations", default=DEFAULT_QUANTIZATIONS, metavar="Q,Q",
                         help="CTranslate2 weight types, comma-separated (default: %(default)s; any of "
                              "fairseq-kd-export --quantization's; 'none' for no CTranslate2 rows)")
    systems.add_argument("--int8-weight-bits", type=int, default=None, metavar="BITS",
                         help="bits of the int8 rows' weights, as fairseq-kd-export --int8-weight-bits: 7 (the "
                              "default: exact integer products on every x86 CPU) or 8 (CTranslate2's own "
                              "rounding, exact only on CPUs with VNNI and on GPUs)")
    timing = parser.add_argument_group("decoding")
    timing.add_argument("--device", default="cpu", choices=DEVICES,
                        help="where every system decodes: cpu (at each --threads count) or cuda (the first visible "
                             "GPU, one process at a time) (default: %(default)s)")
    timing.add_argument("--fairseq-weights", default="float32", metavar="W,W",
                        help="precision of the fairseq rows, comma-separated: float32, and with --device cuda "
                             "float16 (fairseq-generate --fp16) or bfloat16 (--bf16); each gives a teacher row and a "
                             "row per student, the first is the baseline (default: %(default)s)")
    timing.add_argument("--threads", default=None, metavar="T,T",
                        help="thread counts, comma-separated (default: 1 and every core this process may use, "
                             "deduplicated; --device cpu only)")
    timing.add_argument("--batch-sizes", default="32", metavar="B,B",
                        help="sentences per batch, comma-separated (default: %(default)s)")
    timing.add_argument("--beam", type=int, default=5, help="beam size (default: %(default)s)")
    timing.add_argument("--lenpen", type=float, default=1.0, help="length penalty (default: %(default)s)")
    timing.add_argument("--max-len-a", type=float, default=0.0,
                        help="at most max_len_a * S + max_len_b target tokens (default: %(default)s)")
    timing.add_argument("--max-len-b", type=int, default=200, help="see --max-len-a (default: %(default)s)")
    parser.add_argument("--ref", type=Path, metavar="FILE", default=None,
                        help="references, line i for sentence id i (e.g. the untouched raw/test.LANG), instead "
                             "of the outputs' T- lines")
    add_scoring_arguments(parser)
    out = parser.add_argument_group("outputs")
    out.add_argument("--workdir", type=Path, default=Path("deploy_benchmark_work"),
                     help="exports, decoding outputs and logs; re-running with the same settings reuses them "
                          "(default: %(default)s)")
    out.add_argument("--output-md", type=Path, metavar="FILE", default=None, help="write the Markdown table here")
    out.add_argument("--output-json", type=Path, metavar="FILE", default=None,
                     help="write every number, setting and path here (JSON)")
    out.add_argument("--overwrite", action="store_true", help="replace existing --output-md/--output-json files")
    out.add_argument("--title", default=None, help="the Markdown table's title (default: from --data and --gen-subset)")
    return parser


@dataclass
class Row:
    """One line of the table: a system under one engine with one weight type."""

    name: str  # the system: "teacher" or a student's name
    role: str  # "teacher" or "student"
    engine: str  # FAIRSEQ or CT2
    weights: str  # "float32" for fairseq, the quantisation for CTranslate2
    checkpoint: Path
    baseline: Optional[str] = None  # id of the row it is compared with
    model: Optional[Path] = None
    checkpoint_sha256: str = ""
    measurements: List[Dict] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.name}/{self.engine}/{self.weights}"


def _positive_ints(value: Optional[str], flag: str, errors: List[str], upper: Optional[int] = None) -> List[int]:
    if value is None:
        return []
    items, result = _csv(value), []
    if not items:
        errors.append(f"{flag}: give at least one value, comma-separated")
    for item in items:
        try:
            number = int(item)
        except ValueError:
            errors.append(f"{flag}: {item!r} is not a whole number")
            continue
        if number < 1:
            errors.append(f"{flag}: {number} must be at least 1")
        elif upper is not None and number > upper:
            errors.append(f"{flag}: {number} is more than the {upper} cores this process may use; timings with "
                          "more threads than cores measure the scheduler")
        elif number not in result:
            result.append(number)
    return result


def _checkpoint_problem(path: str, flag: str) -> Optional[str]:
    problem = path_problem(path, FILE)
    if problem is None:
        return None
    hint = f"; give the checkpoint file (e.g. {path.rstrip('/')}/checkpoint_best.pt)" if Path(path).is_dir() else ""
    return f"{flag} {path!r}: {problem}{hint}"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def validate(args: argparse.Namespace) -> List[str]:
    """Check every input before any work; returns one message per problem (empty: all good).
    Fills in the parsed values (args.rows, args.thread_counts, ...)."""
    errors: List[str] = []
    # data
    if args.data is None:
        errors.append("--data: give the binarised data folder (fairseq-preprocess --destdir)")
    else:
        problem = path_problem(args.data, FOLDER)
        if problem is not None:
            errors.append(f"--data {args.data!r}: {problem}; give the binarised data folder")
        else:
            errors.extend(_check_split(args))
    # systems
    if args.teacher is None:
        errors.append("--teacher: give the teacher's checkpoint")
    else:
        problem = _checkpoint_problem(args.teacher, "--teacher")
        if problem:
            errors.append(problem)
    if not args.student:
        errors.append("--student: give at least one NAME=CKPT")
    students: List[Tuple[str, str]] = []
    for value in args.student:
        name, separator, path = value.partition("=")
        if not separator or not name or not path:
            errors.append(f"--student: expected NAME=CKPT, got {value!r}")
            continue
        if not NAME_PATTERN.match(name):
            errors.append(f"--student {value!r}: NAME may hold letters, digits and _ . + - (starting with a letter "
                          "or digit)")
        elif name == TEACHER:
            errors.append(f"--student {value!r}: the name {TEACHER!r} is the teacher row's; choose another")
        elif name in [n for n, _ in students]:
            errors.append(f"--student: the name {name!r} is given twice")
        problem = _checkpoint_problem(path, f"--student {name}")
        if problem:
            errors.append(problem)
        students.append((name, path))
    # quantisations
    quantizations = [] if args.quantizations.strip().lower() == "none" else _csv(args.quantizations)
    if args.quantizations.strip().lower() != "none" and not quantizations:
        errors.append("--quantizations: give at least one weight type, or 'none' for no CTranslate2 rows")
    from fairseq_kd.deploy.export_ctranslate2 import (DEFAULT_INT8_WEIGHT_BITS, INT8_QUANTIZATIONS, INT8_WEIGHT_BITS,
                                                      QUANTIZATIONS)

    if quantizations:
        unknown = [q for q in quantizations if q not in QUANTIZATIONS]
        if unknown:
            errors.append(f"--quantizations: unknown {', '.join(map(repr, unknown))}; choose from "
                          f"{', '.join(QUANTIZATIONS)} (or 'none')")
        try:
            from fairseq_kd.deploy import import_ctranslate2

            import_ctranslate2()
        except ImportError as error:
            errors.append(f"--quantizations: {error}; or pass --quantizations none")
    args.quantization_list = list(dict.fromkeys(quantizations))
    if args.int8_weight_bits is not None and args.int8_weight_bits not in INT8_WEIGHT_BITS:
        errors.append(f"--int8-weight-bits {args.int8_weight_bits}: choose 7 or 8")
    elif args.int8_weight_bits is not None and not set(args.quantization_list) & set(INT8_QUANTIZATIONS):
        errors.append("--int8-weight-bits applies to int8 rows: add an int8 weight type to --quantizations, or drop it")
    args.int8_bits = args.int8_weight_bits or DEFAULT_INT8_WEIGHT_BITS
    args.int8_rows = bool(set(args.quantization_list) & set(INT8_QUANTIZATIONS))
    # decoding
    args.fairseq_weight_list = list(dict.fromkeys(_csv(args.fairseq_weights)))
    unknown = [w for w in args.fairseq_weight_list if w not in FAIRSEQ_WEIGHTS]
    if not args.fairseq_weight_list or unknown:
        errors.append(f"--fairseq-weights: {', '.join(map(repr, unknown)) or 'nothing given'}; choose from "
                      f"{', '.join(FAIRSEQ_WEIGHTS)}, comma-separated")
    elif args.device == "cpu" and args.fairseq_weight_list != ["float32"]:
        errors.append(f"--fairseq-weights {args.fairseq_weights}: fairseq decodes in half precision on CUDA only; "
                      "pass --device cuda, or float32")
    if args.device == "cuda":
        errors.extend(_cuda_problems(args))
        args.thread_counts = [1]  # one process on the GPU; CPU threads are not what is measured
    else:
        cores = available_cores()
        if args.threads is None:
            args.thread_counts = list(dict.fromkeys([1, cores]))
        else:
            args.thread_counts = _positive_ints(args.threads, "--threads", errors, upper=cores)
    args.batch_size_list = _positive_ints(args.batch_sizes, "--batch-sizes", errors)
    if args.beam < 1:
        errors.append(f"--beam: {args.beam} must be at least 1")
    if args.max_len_a < 0:
        errors.append(f"--max-len-a: {args.max_len_a} must be >= 0")
    if args.max_len_b < 1:
        errors.append(f"--max-len-b: {args.max_len_b} must be >= 1")
    # scoring
    problem = path_problem(args.ref, FILE) if args.ref is not None else None
    if problem is not None:
        errors.append(f"--ref {str(args.ref)!r}: {problem}")
    if args.bootstrap == 0:
        errors.append("--bootstrap 0: the table's 95% CI and paired p-values need resampling; give at least 40")
    else:
        try:
            from fairseq_kd.cli.score import scoring_settings

            args.processing, args.settings = scoring_settings(args)
        except InputError as error:
            errors.append(str(error))
    # outputs
    if args.workdir.exists() and not args.workdir.is_dir():
        errors.append(f"--workdir: {str(args.workdir)!r} is a file; give a folder")
    outputs = [(flag, path) for flag, path in (("--output-md", args.output_md), ("--output-json", args.output_json))
               if path is not None]
    if len(outputs) == 2 and outputs[0][1].resolve() == outputs[1][1].resolve():
        errors.append("--output-md and --output-json name the same file")
    inputs = [p for p in [args.teacher, args.ref, *(path for _, path in students)] if p is not None]
    for flag, path in outputs:
        if path.is_dir():
            errors.append(f"{flag}: {str(path)!r} is a folder; give a file path")
        elif path.exists() and not args.overwrite:
            errors.append(f"{flag}: {str(path)!r} already exists; pass --overwrite to replace it")
        elif any(Path(p).resolve() == path.resolve() for p in inputs):
            errors.append(f"{flag}: {str(path)!r} is one of the inputs; choose another path")
    if errors:
        return errors
    args.rows = build_rows(args.teacher, students, args.quantization_list, args.fairseq_weight_list)
    return errors


def _cuda_problems(args) -> List[str]:
    errors = []
    if args.threads is not None:
        errors.append("--threads: applies to --device cpu; with --device cuda each system decodes in one process "
                      "on the GPU")
    import torch

    if not torch.cuda.is_available():
        errors.append("--device cuda: torch sees no CUDA device here; pass --device cpu")
    elif args.quantization_list:
        try:
            from fairseq_kd.deploy import import_ctranslate2

            if import_ctranslate2().get_cuda_device_count() < 1:
                errors.append("--device cuda: this CTranslate2 build sees no CUDA device (a CPU-only wheel, or its "
                              "CUDA libraries missing); pass --quantizations none for fairseq rows only")
        except ImportError:
            pass  # said under --quantizations
    return errors


def _check_split(args) -> List[str]:
    from fairseq.data import data_utils

    data = Path(args.data)
    src, tgt = args.source_lang, args.target_lang
    if src is None or tgt is None:
        src, tgt = data_utils.infer_language_pair(str(data))
        if src is None or tgt is None:
            return [f"--data: cannot infer the language pair of {args.data!r}; pass --source-lang and --target-lang"]
    errors = [f"--data: {args.data!r} has no dict.{lang}.txt" for lang in (src, tgt)
              if not (data / f"dict.{lang}.txt").is_file()]
    prefix = None
    for a, b in ((src, tgt), (tgt, src)):
        if (data / f"{args.gen_subset}.{a}-{b}.{src}.idx").is_file():
            prefix = data / f"{args.gen_subset}.{a}-{b}"
    if prefix is None:
        errors.append(f"--gen-subset: no binarised {args.gen_subset!r} split for {src}-{tgt} in {args.data!r}")
    args.langs, args.split_prefix = (src, tgt), prefix
    return errors


def build_rows(teacher: str, students: Sequence[Tuple[str, str]], quantizations: Sequence[str],
               fairseq_weights: Sequence[str] = ("float32",)) -> List[Row]:
    """Teacher (fairseq) first, one row per fairseq precision, each compared with the first student at
    that precision; then per student its fairseq rows (the later precisions compared with the first)
    and its CTranslate2 rows (compared with the student's first fairseq row)."""
    first_student = students[0][0]
    rows = [Row(TEACHER, TEACHER, FAIRSEQ, w, Path(teacher), baseline=f"{first_student}/{FAIRSEQ}/{w}")
            for w in fairseq_weights]
    for name, path in students:
        student = Row(name, "student", FAIRSEQ, fairseq_weights[0], Path(path))
        rows.append(student)
        rows.extend(Row(name, "student", FAIRSEQ, w, Path(path), baseline=student.id) for w in fairseq_weights[1:])
        rows.extend(Row(name, "student", CT2, q, Path(path), baseline=student.id) for q in quantizations)
    return rows


# --------------------------------------------------------------------------- machine and hashing


def _version(module: str) -> Optional[str]:
    """The module's ``__version__`` (fairseq's distribution may be named otherwise, e.g. a fork)."""
    import importlib

    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return None


def gpu_name() -> Optional[str]:
    """The first visible GPU's name (NVML, which opens no CUDA context; torch where NVML is missing)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(_first_visible_gpu()))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - NVML absent or refusing: ask torch
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _first_visible_gpu() -> int:
    """NVML counts every GPU; CUDA_VISIBLE_DEVICES=3,1 makes the children's GPU 0 NVML's 3."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


class GpuMemoryPeak:
    """The most GPU memory in use while a child decodes, above what was in use when it started (NVML's
    device total, polled every 10 ms from a thread): the child's CUDA context, model, caches and
    activations. None where NVML is not installed."""

    def __init__(self):
        import threading

        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(_first_visible_gpu())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.before = self.peak = self._used()

    def _used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _poll(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._used())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def bytes(self) -> int:
        return self.peak - self.before


#: environment variables that choose the CPU kernels (and so the numbers) of torch, MKL, oneDNN and
#: CTranslate2; the demo sets some of them to pin every kernel to AVX2
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                    "DNNL_MAX_CPU_ISA", "CT2_FORCE_CPU_ISA", "CT2_USE_MKL")


def int8_dot_product(flags: Sequence[str]) -> str:
    """How this CPU multiplies int8 vectors: 'VNNI' (AVX-512 VNNI or AVX-VNNI: int32 sums) or 'AVX2'
    (no VNNI: adjacent u8*s8 products summed in saturating int16, see
    fairseq_kd.deploy.export_ctranslate2.round_int8_weights); kernels pinned to AVX2 (MKL_CBWR=AVX2,
    ONEDNN_MAX_CPU_ISA=AVX2) take the AVX2 path on any CPU."""
    return "VNNI" if {"avx512_vnni", "avx_vnni"} & set(flags) else "AVX2"


def cpu_model_and_flags() -> tuple:
    """The CPU's model name (None if unknown) and its feature flags, from /proc/cpuinfo."""
    cpu, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and cpu is None:
                cpu = line.split(":", 1)[1].strip()
            elif line.lower().startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return cpu, flags


def machine_info(device: str = "cpu") -> Dict:
    cpu, flags = cpu_model_and_flags()
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores_available": available_cores(),
            "int8_dot_product": int8_dot_product(flags),
            "kernel_pins": {name: os.environ[name] for name in KERNEL_VARIABLES if os.environ.get(name)},
            "cores_total": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": _version("torch"), "fairseq": _version("fairseq"), "ctranslate2": _version("ctranslate2"),
            **({"gpu": gpu_name()} if device == "cuda" else {})}


def data_fingerprint(args) -> str:
    """SHA-256 over the dictionaries and the decoded split's files."""
    data = Path(args.data)
    files = [data / f"dict.{lang}.txt" for lang in args.langs]
    files += sorted(args.split_prefix.parent.glob(args.split_prefix.name + ".*"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()


def split_size(args) -> int:
    from fairseq.data import data_utils

    src = args.langs[0]
    dataset = data_utils.load_indexed_dataset(f"{args.split_prefix}.{src}", None)
    if dataset is None:
        raise BenchmarkError(f"--gen-subset: cannot read {args.split_prefix}.{src}")
    return len(dataset)


# --------------------------------------------------------------------------- exports


def export_models(rows: List[Row], args, log) -> None:
    """Export every row's model into WORKDIR/exports (reusing earlier exports of the same file)."""
    from fairseq_kd.deploy.export_fairseq import export_student

    exports = args.workdir / "exports"
    digests: Dict[Path, str] = {}
    for row in rows:
        source = row.checkpoint.resolve()
        if source not in digests:
            digests[source] = file_sha256(source)
        row.checkpoint_sha256 = digests[source]
        stem = f"{row.name}-{row.checkpoint_sha256[:12]}"
        if row.engine == FAIRSEQ:
            row.model = exports / f"{stem}.pt"
            if row.model.is_file():
                log(f"export {row.id}: reusing {row.model}")
                continue
            log(f"export {row.id}: {row.checkpoint} -> {row.model}")
            export_student(str(row.checkpoint), str(row.model))
        else:
            from fairseq_kd.deploy.export_ctranslate2 import RECORD_NAME, export_ctranslate2

            bits = int8_bits(row, args)
            row.model = exports / (f"{stem}-ct2-{row.weights}" + (f"-w{bits}" if bits else ""))
            if (row.model / RECORD_NAME).is_file():
                log(f"export {row.id}: reusing {row.model}")
                continue
            log(f"export {row.id}: {row.checkpoint} -> {row.model} ({row.weights}"
                + (f", {bits}-bit weights)" if bits else ")"))
            export_ctranslate2(str(row.checkpoint), str(row.model), quantization=row.weights, data=str(args.data),
                               overwrite=row.model.exists(), int8_weight_bits=bits)


def int8_bits(row: Row, args) -> Optional[int]:
    """The bits of a CTranslate2 int8 row's weights (None for every other row)."""
    from fairseq_kd.deploy.export_ctranslate2 import INT8_QUANTIZATIONS

    return args.int8_bits if row.engine == CT2 and row.weights in INT8_QUANTIZATIONS else None


def model_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- decoding


def decode_command(row: Row, args, threads: int, batch_size: int, results: Path) -> List[str]:
    common = [str(Path(args.data).resolve()), "--gen-subset", args.gen_subset, "--beam", str(args.beam),
              "--lenpen", str(args.lenpen), "--batch-size", str(batch_size), "--max-len-a", str(args.max_len_a),
              "--max-len-b", str(args.max_len_b), "-s", args.langs[0], "-t", args.langs[1],
              "--results-path", str(results)]
    if row.engine == FAIRSEQ:
        device = ["--cpu"] if args.device == "cpu" else FAIRSEQ_WEIGHTS[row.weights]
        return [sys.executable, "-m", "fairseq_cli.generate", *common, "--path", str(row.model.resolve()),
                "--task", "translation", "--required-batch-size-multiple", "1", *device, "--num-workers", "0"]
    return [sys.executable, "-m", "fairseq_kd.cli.translate", *common, "--model", str(row.model.resolve()),
            "--threads", str(threads), "--device", args.device, "--overwrite"]


def run_measured(command: List[str], env: Dict[str, str], log_path: Path,
                 gpu_memory: Optional["GpuMemoryPeak"] = None) -> Tuple[int, int, float]:
    """Run ``command`` alone, output to ``log_path``; returns (exit status, peak RSS bytes, wall s).
    ``gpu_memory`` (a :class:`GpuMemoryPeak`) polls the GPU while it runs."""
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            if gpu_memory is not None:
                with gpu_memory:
                    _, status, usage = os.wait4(proc.pid, 0)
            else:
                _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    # reaped by wait4: Popen must not wait again. os.waitstatus_to_exitcode (Python >= 3.9) spelt
    # out: the exit code, or minus the signal that ended the child (wait4 without WUNTRACED)
    proc.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    # ru_maxrss is in KiB on Linux, bytes on macOS
    peak = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return proc.returncode, peak, time.perf_counter() - start


def parse_translated(*paths: Path) -> Dict:
    """The last ``Translated N sentences (M tokens) in Xs (R sentences/s, S tokens/s)`` line of the
    first of ``paths`` that has one (fairseq-generate logs it to stderr, fairseq-kd-translate writes
    it into its output)."""
    matches = []
    for path in paths:
        matches = TRANSLATED.findall(path.read_text(encoding="utf-8", errors="replace")) if path.is_file() else []
        if matches:
            break
    if not matches:
        raise BenchmarkError(f"{' and '.join(map(str, paths))}: no 'Translated N sentences ...' line; was the "
                             "decode interrupted?")
    sentences, tokens, seconds, rate, token_rate = matches[-1]
    return {"sentences": int(sentences.replace(",", "")), "tokens": int(tokens.replace(",", "")),
            "seconds": float(seconds), "sentences_per_s": float(rate), "tokens_per_s": float(token_rate)}


def decode_key(row: Row, args, threads: int, batch_size: int) -> Dict:
    """Everything that changes a decode's output or timing: a changed value means a new decode."""
    key = {"system": row.id, "model_sha256": row.checkpoint_sha256, "data": str(Path(args.data).resolve()),
           "data_sha256": args.data_sha256, "gen_subset": args.gen_subset, "langs": list(args.langs),
           "beam": args.beam, "lenpen": args.lenpen, "max_len_a": args.max_len_a, "max_len_b": args.max_len_b,
           "threads": threads, "batch_size": batch_size, "machine": {k: args.machine[k] for k in (
               "cpu", "cores_available", "torch", "fairseq", "ctranslate2", "int8_dot_product", "kernel_pins")}}
    if int8_bits(row, args):
        key["int8_weight_bits"] = int8_bits(row, args)
    if args.device != "cpu":  # (only then: CPU decodes keep the keys they were recorded under)
        key.update(device=args.device, gpu=args.machine.get("gpu"))
    return key


def decode_all(rows: List[Row], args, log) -> Tuple[int, int]:
    """Decode every row at every (threads, batch size), one child at a time; returns (run, reused)."""
    done = reused = 0
    total = len(rows) * len(args.thread_counts) * len(args.batch_size_list)
    count = 0
    for row in rows:
        row.measurements = []
        for batch_size in args.batch_size_list:
            for threads in args.thread_counts:
                count += 1
                key = decode_key(row, args, threads, batch_size)
                digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
                folder = (args.workdir / "decode" /
                          f"{row.name}.{row.engine}.{row.weights}.t{threads}.b{batch_size}.{digest}")
                output = folder / f"generate-{args.gen_subset}.txt"
                record_path = folder / "measure.json"
                where = f"threads {threads}" if args.device == "cpu" else args.device
                label = f"[{count}/{total}] {row.id} {where} batch {batch_size}"
                if record_path.is_file() and output.is_file():
                    record = json.loads(record_path.read_text())
                    if record.get("key") == key:
                        row.measurements.append(record["measurement"])
                        reused += 1
                        log(f"{label}: reusing {output}")
                        continue
                folder.mkdir(parents=True, exist_ok=True)
                record_path.unlink(missing_ok=True)
                command = decode_command(row, args, threads, batch_size, folder)
                env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                       "PYTHONWARNINGS": "ignore"}
                log(f"{label}: decoding")
                gpu_memory = _gpu_memory_poller() if args.device == "cuda" else None
                status, peak, wall = run_measured(command, env, folder / "decode.log", gpu_memory)
                if status != 0:
                    tail = (folder / "decode.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
                    raise BenchmarkError(f"decoding {row.id} (threads {threads}, batch {batch_size}) failed with "
                                         f"exit status {status}: {tail[0][:300]} (full log: {folder / 'decode.log'})")
                measured = parse_translated(output, folder / "decode.log")
                measurement = {"threads": threads, "batch_size": batch_size, **measured, "peak_rss_bytes": peak,
                               "peak_gpu_bytes": gpu_memory.bytes if gpu_memory is not None else None,
                               "wall_s": round(wall, 3), "output": str(output), "command": shlex.join(command),
                               "decoded_at": datetime.datetime.now().isoformat(timespec="seconds")}
                tmp = record_path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"key": key, "measurement": measurement}, indent=1))
                os.replace(tmp, record_path)
                row.measurements.append(measurement)
                done += 1
                log(f"{label}: {measured['sentences_per_s']:.2f} sent/s, {measured['tokens_per_s']:.1f} tok/s, "
                    f"peak {peak / 2**20:.0f} MiB")
    return done, reused


def _gpu_memory_poller() -> Optional[GpuMemoryPeak]:
    try:
        return GpuMemoryPeak()
    except Exception:  # noqa: BLE001 - no NVML (nvidia-ml-py) here: the GPU column says '-'
        return None


# --------------------------------------------------------------------------- scoring


def hypotheses_by_id(path: Path) -> Dict[int, str]:
    result = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("H-"):
            parts = line.split("\t", 2)
            result[int(parts[0][2:])] = parts[2] if len(parts) == 3 else ""
    return result


def identical_outputs(row: Row) -> Dict:
    """Whether the row's hypotheses are the same at every thread count (per batch size) and batch size."""
    first = row.measurements[0]
    reference = hypotheses_by_id(Path(first["output"]))
    differing = []
    for m in row.measurements[1:]:
        if hypotheses_by_id(Path(m["output"])) != reference:
            differing.append({"threads": m["threads"], "batch_size": m["batch_size"]})
    across_threads = not any(d["batch_size"] == first["batch_size"] for d in differing)
    across_batches = not any(d["threads"] == first["threads"] for d in differing)
    return {"compared_with": {"threads": first["threads"], "batch_size": first["batch_size"]},
            "across_threads": across_threads, "across_batch_sizes": across_batches, "differing": differing}


def score_rows(rows: List[Row], args) -> Dict[str, Dict]:
    from fairseq_kd.scoring.report import compare_with_baseline, score_generate_output

    expected = None if args.ref is not None else split_size(args)
    scores = {}
    for row in rows:
        scores[row.id] = score_generate_output(
            row.id, Path(row.measurements[0]["output"]), args.processing, args.settings, args.bootstrap, args.seed,
            expected, False, args.ref, args.ref_is_plain)
    results = {}
    for row in rows:
        system = scores[row.id]
        result = system.result
        entry = {"bleu": result.score, "ci_mean": result.mean, "ci": result.ci, "n_bootstrap": result.n_bootstrap,
                 "signature": result.signature, "verbose": result.verbose, "n_sentences": result.n_sentences,
                 "scored_output": row.measurements[0]["output"], "paired": None, **system.chrf()}
        if row.baseline is not None:
            baseline = scores[row.baseline]
            entry["paired"] = compare_with_baseline(system, baseline, args.bootstrap, args.ar_trials, args.seed)
            entry["paired"]["sentences_differing"] = sum(
                a != b for a, b in zip(system.hypotheses, baseline.hypotheses))
        results[row.id] = entry
    return results


# --------------------------------------------------------------------------- report


def build_report(rows: List[Row], scores: Dict[str, Dict], args, argv: Sequence[str]) -> Dict:
    teacher = rows[0]
    teacher_rates = {(m["threads"], m["batch_size"]): m["sentences_per_s"] for m in teacher.measurements}
    out_rows = []
    for row in rows:
        measurements = []
        for m in row.measurements:
            base = teacher_rates.get((m["threads"], m["batch_size"]))
            gpu_bytes = m.get("peak_gpu_bytes")
            measurements.append({**m, "peak_rss_mb": m["peak_rss_bytes"] / 2**20,
                                 "peak_gpu_mb": gpu_bytes / 2**20 if gpu_bytes is not None else None,
                                 "speedup_vs_teacher": m["sentences_per_s"] / base if base else None})
        size = model_bytes(row.model)
        score = scores[row.id]
        paired = score["paired"]
        out_rows.append({
            "id": row.id, "system": row.name, "role": row.role, "engine": row.engine, "weights": row.weights,
            "checkpoint": str(row.checkpoint), "checkpoint_sha256": row.checkpoint_sha256, "model": str(row.model),
            "size_bytes": size, "size_mb": size / 1e6, **{k: v for k, v in score.items() if k != "paired"},
            "baseline": row.baseline, "delta": paired["difference"] if paired else None,
            "p_bootstrap": paired["p_bootstrap"] if paired else None,
            "p_randomization": paired["p_randomization"] if paired else None, "paired": paired,
            "outputs_identical": identical_outputs(row), "measurements": measurements,
        })
    data = Path(args.data)
    return {
        "format": FORMAT,
        "title": args.title or f"Deploy benchmark: {data.name} {args.gen_subset}",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([PROG, *argv]),
        "machine": args.machine,
        "settings": {
            "data": str(data.resolve()), "data_sha256": args.data_sha256, "gen_subset": args.gen_subset,
            "langs": list(args.langs), "beam": args.beam, "lenpen": args.lenpen, "max_len_a": args.max_len_a,
            "max_len_b": args.max_len_b, "device": args.device, "threads": args.thread_counts,
            "batch_sizes": args.batch_size_list, "fairseq_weights": args.fairseq_weight_list,
            "quantizations": args.quantization_list,
            "int8_weight_bits": args.int8_bits if args.int8_rows else None,
            "scoring": {**args.processing.to_dict(), **args.settings.to_dict(),
                        "ref": str(args.ref) if args.ref else None, "ref_is_plain": args.ref_is_plain, "bootstrap": args.bootstrap, "ar_trials": args.ar_trials,
                        "seed": args.seed},
            "workdir": str(args.workdir.resolve()),
        },
        "notes": notes(args),
        "rows": out_rows,
    }


GPU_MEMORY_NOTE = ("GPU MB: the most GPU memory in use while the decode ran, above what was in use before it "
                   "(NVML's device total, polled every 10 ms): the process's CUDA context, model, caches and "
                   "activations, in MiB")


def notes(args) -> List[str]:
    cuda = args.device == "cuda"
    first = f"batch {args.batch_size_list[0]}" if cuda else \
        f"threads {args.thread_counts[0]}, batch {args.batch_size_list[0]}"
    where = f"CUDA ({args.machine.get('gpu') or 'GPU'})" if cuda else "CPU"
    weights = args.fairseq_weight_list
    precisions = "" if len(weights) == 1 else (
        f"; fairseq rows at {', '.join(weights[1:])}: the same system at {weights[0]} (the teacher's: the first "
        "student at the same precision)")
    generate = "fairseq-generate on the exported checkpoint" + (
        "" if weights == ["float32"] else " (float16: --fp16, bfloat16: --bf16)")
    return [
        f"BLEU: sacreBLEU ({args.settings.tokenize}{', lowercased' if args.settings.lowercase else ''}) on the output "
        f"at {first}; 95% CI: μ ± half-width of the {args.bootstrap}-resample bootstrap interval.",
        "Δ, p: BLEU of the row minus its baseline's and sacreBLEU's paired bootstrap p (ties counted); baseline: the same student "
        f"under fairseq ({weights[0]}) for CTranslate2 rows, the first student under fairseq for the teacher"
        f"{precisions}.",
        f"Decoding: beam {args.beam}, lenpen {args.lenpen}, max length {args.max_len_a}·S + {args.max_len_b}, "
        f"{where}, one process at a time; fairseq rows: {generate}; CTranslate2 rows: "
        "fairseq-kd-translate (same batching).",
        "sent/s, tok/s: decoding time only (the 'Translated ...' line; no start-up or model loading); tokens are "
        f"target tokens with </s>. speed-up: sent/s over the teacher's under fairseq ({weights[0]}) at the same "
        f"{'batch size' if cuda else 'threads and batch'}.",
        "size MB: the exported .pt file, or the CTranslate2 model folder (10^6 bytes).",
        MEMORY_NOTE + ".",
        *([GPU_MEMORY_NOTE + "."] if cuda else []),
    ]


def kernel_line(machine: Dict, settings: Dict) -> str:
    """The int8 path: the CPU's int8 dot product, the kernel pins in force, the int8 weights' bits."""
    pins = machine.get("kernel_pins") or {}
    pinned = ", ".join(f"{name}={value}" for name, value in pins.items()) or "none"
    bits = settings.get("int8_weight_bits")
    return (f"CPU kernels: int8 dot product {machine.get('int8_dot_product', '-')}, pinned by {pinned}"
            + (f"; int8 rows: {bits}-bit weights" if bits else "") + ".")


def _f(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _identical_to_baseline(row: Dict) -> bool:
    return bool(row["paired"]) and row["paired"].get("sentences_differing") == 0


def to_markdown(report: Dict) -> str:
    from fairseq_kd.scoring.report import format_mean_ci, format_p_value

    machine, settings = report["machine"], report["settings"]
    cuda = settings.get("device") == "cuda"
    combos = [(t, b) for b in settings["batch_sizes"] for t in settings["threads"]]
    gpu = f"GPU {machine.get('gpu')}; " if cuda else ""
    lines = [f"## {report['title']}", "",
             f"Machine: {gpu}{machine['cpu']}, {machine['cores_available']} cores available (of "
             f"{machine['cores_total']}); "
             f"torch {machine['torch']}, fairseq {machine['fairseq']}, CTranslate2 {machine['ctranslate2'] or '-'}; "
             f"{report['date']}", "", kernel_line(machine, settings), "",
             f"Command: `{report['command']}`", ""]
    header = ["system", "engine", "weights", "BLEU", "95% CI", "Δ", "p", "chrF", "chrF++", "size MB"]
    for t, b in combos:
        at = f"B={b}" if cuda else f"T={t} B={b}"
        header += [f"sent/s {at}", f"tok/s {at}", f"speed-up {at}", f"peak MB {at}"]
        header += [f"GPU MB {at}"] if cuda else []
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|")
    for row in report["rows"]:
        by_combo = {(m["threads"], m["batch_size"]): m for m in row["measurements"]}
        cells = [row["system"], ENGINE_NAMES[row["engine"]], row["weights"], f"{row['bleu']:.2f}",
                 format_mean_ci(row["ci_mean"], row["ci"]), _f(row["delta"], "+.2f"),
                 "identical" if _identical_to_baseline(row) else format_p_value(row["p_bootstrap"]),
                 f"{row['chrf']:.2f}", f"{row['chrfpp']:.2f}", f"{row['size_mb']:.2f}"]
        for combo in combos:
            m = by_combo[combo]
            cells += [f"{m['sentences_per_s']:.1f}", f"{m['tokens_per_s']:.0f}",
                      _f(m["speedup_vs_teacher"], ".2f", "x"), f"{m['peak_rss_mb']:.0f}"]
            cells += [_f(m.get("peak_gpu_mb"), ".0f")] if cuda else []
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.extend(f"- {note}" for note in report["notes"])
    if any(_identical_to_baseline(row) for row in report["rows"]):
        lines.append("- identical: the output equals its baseline's on every sentence: no difference (p = 1).")
    kinds = ("across_threads", "across_batch_sizes")
    changed = [f"{row['id']} ({', '.join(k for k in kinds if not row['outputs_identical'][k])})"
               for row in report["rows"] if not all(row["outputs_identical"][k] for k in kinds)]
    if len(combos) > 1:
        lines.append("- Output differs with the threads/batch size: " + (", ".join(changed) if changed else "no row")
                     + ".")
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    """``path`` written whole through a temporary file of this process (never ``PATH.tmp``)."""
    from fairseq_kd.teacher_pass.common import replace_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda handle: handle.write(text.encode("utf-8")))


# --------------------------------------------------------------------------- main


def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = validate(args)
    if errors:
        for message in errors:
            sys.stderr.write(f"{PROG}: error: {message}\n")
        return 2
    from fairseq_kd.progress import progress_to_stderr

    with progress_to_stderr(LOGGER) as logger:
        log = logger.info
        args.machine = machine_info(args.device)
        args.data_sha256 = data_fingerprint(args)
        args.workdir.mkdir(parents=True, exist_ok=True)
        export_models(args.rows, args, log)
        decoded, reused = decode_all(args.rows, args, log)
        log(f"decoded {decoded}, reused {reused}; scoring")
        scores = score_rows(args.rows, args)
        report = build_report(args.rows, scores, args, argv)
        report["decodes"] = {"run": decoded, "reused": reused}
        markdown = to_markdown(report)
        if args.output_json is not None:
            _write(args.output_json, json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        if args.output_md is not None:
            _write(args.output_md, markdown)
        sys.stdout.write(markdown)
    return 0


def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    from fairseq_kd.cli.user_errors import exits_on_user_error

    status = exits_on_user_error(PROG)(run)(argv)
    sys.exit(status)


if __name__ == "__main__":
    cli_main()
