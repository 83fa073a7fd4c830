"""Speed and memory of every distillation method relative to plain student training.

    PYTHONPATH=examples/translation python -m fairseq_kd_recipes.benchmark --configs tiny small \
        --output-dir benchmark_output

(``PYTHONPATH`` only in a checkout without ``pip install .``). It lives beside the recipes rather
than in the plugin: it is a developer tool that registers nothing with fairseq, and it measures the
rows of the one method table (:mod:`.methods`) that the recipes train.

Design notes: ``docs/design/recipes.md``.
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .methods import METHODS as METHOD_TABLE
from .methods import PLAIN_CRITERION, Method

PLAIN_FLAGS = ["--criterion", PLAIN_CRITERION, "--label-smoothing", "0.1"]
#: the two reference rows every table has (measured like the methods, in the same rounds)
PLAIN, LIMIT = "plain", "limit"


def method_flags(method: Method) -> List[str]:
    """The flags a table row adds to the common training flags (the student and the teacher come
    from the configuration; a cached teacher's path is filled in per configuration)."""
    cache = ["--teacher-cache", "{teacher_cache}"] if method.teacher_cache else []
    return ["--criterion", method.criterion, *method.criterion_args, *cache]


# The two reference rows, then every row of the method table that trains on the original corpus
# (seq_kd's step is plain training on other data). TinyBERT and MiniLM compare heads one to one:
# every configuration's student has the teacher's head count, so all methods (plain included)
# train the same student.
METHODS: Dict[str, List[str]] = {
    PLAIN: PLAIN_FLAGS,
    # plain training step, then the teacher's forward pass under no_grad (see the module docstring)
    LIMIT: PLAIN_FLAGS,
    **{name: method_flags(method) for name, method in METHOD_TABLE.items() if method.data == "original"},
}
#: the epoch each row's step is timed in (1 but for rows whose method says otherwise)
TIMED_EPOCHS: Dict[str, int] = {name: method.timed_epoch for name, method in METHOD_TABLE.items()}
#: what runs without --methods: the reference rows and the table's rows marked ``benchmarked``
DEFAULT_METHODS = [PLAIN, LIMIT, *(name for name, method in METHOD_TABLE.items() if method.benchmarked)]

CONFIGS = {
    "tiny": {
        "teacher_arch": "transformer_kd_tiny_teacher",
        "student_arch": "transformer_kd_tiny_student",
        # the teacher's 4 heads (the architecture's default is 2), so head-matched methods can run
        "student_args": ["--encoder-attention-heads", "4", "--decoder-attention-heads", "4"],
        "max_tokens": 1024,
        "corpus_train": 3000,
    },
    "small": {
        "teacher_arch": "transformer_kd_iwslt_teacher",
        "student_arch": "transformer_kd_iwslt_student_3l",
        "student_args": [],
        "max_tokens": 2048,
        "corpus_train": 3000,
    },
    # A2D's WMT'14 setting: 12+12 teacher and 4+4 student at transformer-base widths, 8 heads each
    # (slow on a CPU: ask for it with --configs wmt)
    "wmt": {
        "teacher_arch": "transformer_kd_wmt_teacher",
        "student_arch": "transformer_kd_wmt_student_4l",
        "student_args": [],
        "max_tokens": 4096,
        "corpus_train": 3000,
    },
}
# Configurations shaped like the students people distil for deployment (issue 28): small widths with
# real vocabularies. The synthetic corpus has a few hundred types; its joined dictionary is padded
# with never-seen symbols to ``vocab`` types, so the output projection, the softmaxes and the
# vocabulary-sized KD terms cost what they cost at that vocabulary (their cost does not depend on
# which types the data uses).
_D64_STUDENT = ["--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
_WIDTH = {d: ["--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d), "--encoder-ffn-embed-dim", str(4 * d),
              "--decoder-ffn-embed-dim", str(4 * d), "--encoder-attention-heads", "4",
              "--decoder-attention-heads", "4"] for d in (128, 256)}
CONFIGS.update({
    # the measured shape: student 2+2 d 64, teacher 4+4 d 128, an 8k joined vocabulary
    "d64_8k": {"teacher_arch": "transformer_kd_tiny_teacher", "student_arch": "transformer_kd_tiny_student",
               "student_args": _D64_STUDENT, "max_tokens": 1024, "corpus_train": 3000, "vocab": 8000},
    "d128_8k": {"teacher_arch": "transformer_kd_iwslt_teacher", "student_arch": "transformer_kd_iwslt_student_3l",
                "student_args": _WIDTH[128], "max_tokens": 2048, "corpus_train": 3000, "vocab": 8000},
    "d256_32k": {"teacher_arch": "transformer_kd_iwslt_teacher", "student_arch": "transformer_kd_iwslt_student_3l",
                 "student_args": _WIDTH[256], "max_tokens": 2048, "corpus_train": 3000, "vocab": 32000},
    "d512_32k": {"teacher_arch": "transformer_kd_iwslt_teacher", "student_arch": "transformer_kd_iwslt_student_3l",
                 "student_args": [], "max_tokens": 2048, "corpus_train": 3000, "vocab": 32000},
    "wmt_40k": {"teacher_arch": "transformer_kd_wmt_teacher", "student_arch": "transformer_kd_wmt_student_4l",
                "student_args": [], "max_tokens": 4096, "corpus_train": 3000, "vocab": 40000},
    # d64_8k with IWSLT'14-like sentence lengths (see join_sentence_pairs): fewer, longer sentences
    # per batch, where the attention terms (length squared) weigh more against the vocabulary's
    "d64_8k_long": {"teacher_arch": "transformer_kd_tiny_teacher", "student_arch": "transformer_kd_tiny_student",
                    "student_args": _D64_STUDENT, "max_tokens": 1024, "corpus_train": 7000, "vocab": 8000,
                    "mean_pairs_per_line": 2.25},
})
DEFAULT_CONFIGS = ["tiny", "small"]


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _quiet_env() -> dict:
    """The environment of child processes, which import this package by name (``-m``)."""
    package_parent = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": python_path}


def prepare_config(name: str, workdir: Path) -> Dict[str, str]:
    """Corpus, binarised data and an untrained teacher checkpoint for one configuration."""
    from fairseq_kd.data.synthetic import write_corpus

    config = CONFIGS[name]
    root = workdir / name
    raw, data_bin, teacher_dir = root / "raw", root / "data-bin", root / "teacher"
    if not (raw / "corpus.json").exists():
        write_corpus(raw, seed=7, train_size=config["corpus_train"], valid_size=100, test_size=200)
    if config.get("mean_pairs_per_line"):
        joined = root / "raw-joined"
        if not (joined / "done").exists():
            join_sentence_pairs(raw, joined, config["mean_pairs_per_line"], seed=7)
            (joined / "done").write_text("")
        raw = joined
    if not (data_bin / "dict.src.txt").exists():
        languages = [_bin("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
                     "--joined-dictionary", "--workers", "1"]
        preprocess = [*languages, "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test"]
        if config.get("vocab"):
            # the corpus's joined dictionary (from the training split alone, as fairseq-preprocess
            # builds it), padded below and handed to the real binarisation
            corpus_dict = root / "corpus-dict"
            subprocess.run([*languages, "--trainpref", raw / "train", "--destdir", corpus_dict, "--dict-only"],
                           check=True, capture_output=True, env=_quiet_env())
            padded = root / "dict.padded.txt"
            write_padded_dictionary(corpus_dict / "dict.src.txt", padded, config["vocab"])
            preprocess += ["--srcdict", padded]
        subprocess.run([*preprocess, "--destdir", data_bin], check=True, capture_output=True, env=_quiet_env())
    teacher = teacher_dir / "checkpoint_last.pt"
    if not teacher.exists():
        # One update is enough: timing does not depend on the teacher's quality.
        subprocess.run(
            [_bin("fairseq-train"), data_bin, "--user-dir", _user_dir(), "--task", "translation",
             "--arch", config["teacher_arch"], "--share-all-embeddings", "--optimizer", "adam",
             "--lr", "1e-4", "--max-tokens", str(config["max_tokens"]), "--max-update", "1",
             "--save-dir", teacher_dir, "--no-epoch-checkpoints", "--disable-validation",
             "--criterion", "label_smoothed_cross_entropy", "--no-progress-bar"],
            check=True, capture_output=True, env=_quiet_env(),
        )
    cache = root / "teacher-cache"
    if not (cache / "cache.json").exists():
        subprocess.run([sys.executable, "-m", "fairseq_kd.cli.teacher_cache", "--data", data_bin,
                        "--teacher-checkpoint", teacher, "--output", cache, "--k", "8", "--cpu"],
                       check=True, capture_output=True, env=_quiet_env())
    return {"data": str(data_bin), "teacher": str(teacher), "teacher_cache": str(cache)}


def join_sentence_pairs(raw: Path, out: Path, mean_pairs: float, seed: int) -> None:
    """Each split of ``raw`` with consecutive sentence pairs joined into lines of ``n`` pairs, ``n``
    geometric with mean ``mean_pairs`` (1, 2, 3, ... with probability ``p (1 - p)^(n - 1)``,
    ``p = 1 / mean_pairs``). The synthetic pairs average 10.9 target tokens; at 2.25 pairs per line
    the target lines average about 24 tokens with a long tail, as IWSLT'14 De-En's do after BPE (its
    validation and test targets: 24.5 and 23.2 tokens with </s>, standard deviation 16.5 and 15.4,
    up to 155 and 218)."""
    import random

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split in ("train", "valid", "test"):
        sides = {lang: (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("src", "tgt")}
        lines = {lang: [] for lang in sides}
        start, count = 0, len(sides["src"])
        while start < count:
            n = 1
            while rng.random() > 1 / mean_pairs:
                n += 1
            for lang, text in sides.items():
                lines[lang].append(" ".join(text[start:start + n]))
            start += n
        for lang, text in lines.items():
            (out / f"{split}.{lang}").write_text("\n".join(text) + "\n", encoding="utf-8")


def write_padded_dictionary(corpus_dict: Path, out: Path, vocab: int) -> None:
    """The corpus's dictionary file with never-seen symbols appended, so that fairseq's dictionary
    (4 special symbols first) holds ``vocab`` types."""
    lines = corpus_dict.read_text().splitlines()
    fillers = vocab - 4 - len(lines)
    if fillers < 0:
        raise ValueError(f"the corpus has {len(lines) + 4} types, more than the configuration's vocab {vocab}")
    out.write_text("\n".join(lines + [f"unseen{i:06d} 0" for i in range(fillers)]) + "\n")


def config_shapes(config_name: str, paths: Dict[str, str]) -> dict:
    """What a configuration's rows measured: the vocabulary, the tokens per batch and the corpus's
    mean lengths (the models' shapes are their architectures' and ``student_args``)."""
    from fairseq.data import Dictionary, data_utils

    data = Path(paths["data"])
    shapes = {"vocab": len(Dictionary.load(str(data / "dict.src.txt"))),
              "max_tokens": CONFIGS[config_name]["max_tokens"]}
    for lang in ("src", "tgt"):
        dataset = data_utils.load_indexed_dataset(str(data / f"train.src-tgt.{lang}"), None)
        shapes[f"mean_{lang}_len"] = round(float(dataset.sizes.mean()), 2)
        shapes[f"sd_{lang}_len"] = round(float(dataset.sizes.std()), 2)
        shapes[f"max_{lang}_len"] = int(dataset.sizes.max())
    return shapes


def _user_dir() -> str:
    """The plugin's folder, fairseq-train's --user-dir."""
    import fairseq_kd

    return str(Path(fairseq_kd.__file__).resolve().parent)


#: fairseq-train's flags of each precision a row can be timed in
PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}


def precision_flags(precision: str) -> List[str]:
    """The precision's flags, with ``--cpu`` where no GPU is visible (half precision trains on the
    CPU only when asked to)."""
    import torch

    if not PRECISIONS[precision]:
        return []
    return PRECISIONS[precision] + ([] if torch.cuda.is_available() else ["--cpu"])


def training_flags(config_name: str, paths: Dict[str, str], method: str, precision: str = "fp32") -> List[str]:
    config = CONFIGS[config_name]
    return [
        paths["data"], "--user-dir", _user_dir(), "--task", "translation_kd",
        "--teacher-checkpoint", paths["teacher"], "--arch", config["student_arch"],
        "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
        "--lr", "5e-4", "--max-tokens", str(config["max_tokens"]), "--seed", "1",
        "--dropout", "0.3", "--num-workers", "0", "--required-batch-size-multiple", "1",
        *config["student_args"], *(flag.format(**paths) for flag in METHODS[method]), *precision_flags(precision),
    ]


class _TrainingRun:
    """What fairseq-train builds from ``flags`` (task, student, criterion, ``Trainer``) and the
    configuration's batches, for timing ``train_step`` in this process: fairseq's length-sorted
    order, or with ``shuffle_seed`` the batches shuffled as fairseq-train shuffles an epoch's, so
    the timed ones mix the corpus's lengths. With ``teacher_forward`` each step also runs the
    teacher's forward pass on the same batch (the ``limit`` row)."""

    def __init__(self, flags: List[str], teacher_forward: bool = False, epoch: int = 1,
                 shuffle_seed: Optional[int] = None):
        import torch
        from fairseq import options, tasks, utils
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf
        from fairseq.trainer import Trainer

        import fairseq_kd
        from fairseq_kd.models.feature_capture import CaptureRequest

        # This module imported fairseq_kd before fairseq, so --user-dir would find it already
        # imported and not register anything.
        fairseq_kd.register()
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, flags)
        cfg = convert_namespace_to_omegaconf(args)
        utils.import_user_module(cfg.common)
        torch.manual_seed(cfg.common.seed)
        task = tasks.setup_task(cfg.task)
        task.load_dataset(cfg.dataset.train_subset, combine=False, epoch=1)
        model = task.build_model(cfg.model)
        criterion = task.build_criterion(cfg.criterion)
        self.trainer = Trainer(cfg, task, model, criterion)
        self.trainer.begin_epoch(epoch)
        self._task, self._cfg, self._model = task, cfg, model
        self.batches = self.epoch_batches(shuffle_seed)
        self.cuda = torch.cuda.is_available() and not cfg.common.cpu
        if teacher_forward and task.teacher is None:
            raise SystemExit("the limit row needs --teacher-checkpoint in the training flags")
        self._teacher_outputs = []
        if teacher_forward:
            nothing = CaptureRequest()

            # What a distillation criterion adds to the student's step (criterions/base.py): right
            # after the student's forward pass, with the student's activations alive, the teacher's
            # forward under no_grad, whose output the loss holds until the step ends.
            def run_teacher(module, args, kwargs, output):
                task.teacher.follow(next(model.parameters()))
                self._teacher_outputs.append(task.teacher.forward(kwargs, nothing))

            model.register_forward_hook(run_teacher, with_kwargs=True)

    def epoch_batches(self, shuffle_seed: Optional[int] = None):
        """An epoch's batches of the training set, as fairseq-train makes them (length-sorted, or
        shuffled with ``shuffle_seed``)."""
        from fairseq import utils

        task, cfg = self._task, self._cfg
        return task.get_batch_iterator(
            dataset=task.dataset(cfg.dataset.train_subset), max_tokens=cfg.dataset.max_tokens,
            max_positions=utils.resolve_max_positions(task.max_positions(), self._model.max_positions()),
            seed=1 if shuffle_seed is None else shuffle_seed, required_batch_size_multiple=1,
            disable_iterator_cache=True,  # a new seed is a new epoch iterator
        ).next_epoch_itr(shuffle=shuffle_seed is not None)

    def step(self, sample) -> None:
        self.trainer.train_step([sample])
        self._teacher_outputs.clear()

    def timed_step(self, sample) -> float:
        """One step's wall time in seconds (the device synchronised on both sides)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.step(sample)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def peak_mb(self, sample) -> tuple:
        """The step's peak memory in MB and how it was measured (see the module docstring)."""
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated"
        return cpu_step_peak_mb(lambda: self.step(sample)), "cpu_step_peak_allocated"


def _timed_samples(batches, steps: int, warmup: int):
    """(index, sample) of the first ``warmup + steps`` batches; a clear stop before any step when
    there are fewer."""
    if len(batches) < warmup + steps:
        raise SystemExit(f"--steps {steps} --warmup {warmup}: the configuration's corpus has only "
                         f"{len(batches)} batches; ask for fewer steps")
    return itertools.islice(enumerate(batches), warmup + steps)


def measure_training(flags: List[str], steps: int, warmup: int, teacher_forward: bool = False,
                     epoch: int = 1, top_ops: int = 0, shuffle_seed: Optional[int] = None) -> dict:
    """Run in a child process: build what fairseq-train builds and time ``train_step`` (followed,
    with ``teacher_forward``, by the teacher's forward pass on the same batch: the ``limit`` row)."""
    import torch

    run = _TrainingRun(flags, teacher_forward, epoch, shuffle_seed)
    times, first_timed = [], None
    for index, sample in _timed_samples(run.batches, steps, warmup):
        if run.cuda and index == warmup:
            torch.cuda.reset_peak_memory_stats()
        elapsed = run.timed_step(sample)
        if index >= warmup:
            times.append(elapsed)
            first_timed = sample if first_timed is None else first_timed
    peak, measure = run.peak_mb(first_timed)
    result = {"step_ms": 1000 * statistics.median(times), "peak_mb": peak, "memory_measure": measure}
    if top_ops:
        result["top_ops"] = top_operators(lambda: run.step(first_timed), top_ops, run.cuda)
    return result


def measure_paired(flags: List[str], limit_flags: List[str], steps: int, warmup: int, epoch: int = 1,
                   top_ops: int = 0, shuffle_seed: Optional[int] = None) -> dict:
    """Run in a child process: a row's step and the ``limit`` step, both built here, alternate on
    the same batches (limit first on even batches, the row first on odd ones, so that neither
    always runs on a warm cache). Each batch gives one ratio (row / limit) from two steps a second
    or so apart; the load of other processes on a shared machine moves both alike, so the median
    of these ratios resolves differences that the fastest of separate runs minutes apart cannot.
    Memory is the row's own step: on CPU measured as in :func:`measure_training`, on CUDA over one
    more step of the row after the limit's run is freed."""
    import gc

    import torch

    limit = _TrainingRun(limit_flags, teacher_forward=True, shuffle_seed=shuffle_seed)
    samples = _timed_samples(limit.batches, steps, warmup)  # (checks the corpus before the row is built)
    row = _TrainingRun(flags, epoch=epoch)
    times, limit_times, first_timed = [], [], None
    for index, sample in samples:
        if row.cuda and index == warmup:
            torch.cuda.reset_peak_memory_stats()
        if index % 2 == 0:
            limit_elapsed, elapsed = limit.timed_step(sample), row.timed_step(sample)
        else:
            elapsed, limit_elapsed = row.timed_step(sample), limit.timed_step(sample)
        if index >= warmup:
            times.append(elapsed)
            limit_times.append(limit_elapsed)
            first_timed = sample if first_timed is None else first_timed
    if row.cuda:
        # max_memory_allocated would count the limit's student, optimiser state and teacher too:
        # without them, one more step of the row alone
        del limit
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row.step(first_timed)
        torch.cuda.synchronize()
    peak, measure = row.peak_mb(first_timed)
    result = {"step_ms": 1000 * statistics.median(times), "limit_step_ms": 1000 * statistics.median(limit_times),
              "paired_ratios": [t / lt for t, lt in zip(times, limit_times)], "peak_mb": peak,
              "memory_measure": measure}
    if top_ops:
        result["top_ops"] = top_operators(lambda: row.step(first_timed), top_ops, row.cuda)
    return result


def median_with_interval(values: List[float], level: float = 0.95, resamples: int = 2000,
                         seed: int = 1) -> tuple:
    """The median of ``values`` and a percentile bootstrap interval for it (seeded: the same values
    always give the same interval)."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    outside = round((1 - level) / 2 * resamples)  # resampled medians left out on each side
    low, high = medians[outside], medians[resamples - 1 - outside]
    return statistics.median(values), low, high


def top_operators(run_step, count: int, cuda: bool) -> List[dict]:
    """Where one more step's time goes: the ``count`` operators with the most self time (on the GPU
    when there is one), from the torch profiler; times in ms."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_step()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key, 0) for e in events) or 1
    ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:count]
    return [{"op": e.key, "self_ms": getattr(e, key, 0) / 1000, "share": getattr(e, key, 0) / total,
             "calls": e.count} for e in ranked]


def cpu_step_peak_mb(run_step) -> float:
    """Peak of the CPU tensor bytes allocated by ``run_step()`` and alive at the same time, in MB.

    The torch profiler reports every CPU allocation and the release of every block it saw allocated
    (blocks from before profiling are not reported when freed), so the running sum of its
    ``[memory]`` events is the bytes the step holds above what lives across steps.
    """
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    allocations = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                         if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
    live = peak = 0
    for _, nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def measure_decoding(paths: Dict[str, str], student_arch: str, student_args: List[str], sentences: int,
                     length: int) -> dict:
    """Beam-5 decoding speed (sentences/s) of an untrained student vs the teacher."""
    import torch
    from fairseq import checkpoint_utils

    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_kd

    fairseq_kd.register()
    parser = options.get_generation_parser()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
        parser, [paths["data"], "--user-dir", _user_dir(), "--task", "translation_kd"]))
    utils.import_user_module(cfg.common)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("test")
    teacher, _cfg = checkpoint_utils.load_model_ensemble([paths["teacher"]], task=task)
    args = argparse.Namespace(arch=student_arch, _name="transformer", share_all_embeddings=True)
    for flag, value in zip(student_args[::2], student_args[1::2]):
        setattr(args, flag.lstrip("-").replace("-", "_"), int(value))
    from fairseq.models import ARCH_CONFIG_REGISTRY

    ARCH_CONFIG_REGISTRY[student_arch](args)
    student = task.build_model(args)
    results = {}
    for name, model in (("teacher", teacher[0]), ("student", student)):
        model.eval()
        generator = task.build_generator(
            [model], argparse.Namespace(beam=5, max_len_a=0, max_len_b=length, min_len=length)
        )
        itr = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=50, seed=1).next_epoch_itr(shuffle=False)
        done, start = 0, time.perf_counter()
        with torch.no_grad():
            for sample in itr:
                task.inference_step(generator, [model], sample)
                done += sample["nsentences"]
                if done >= sentences:
                    break
        results[name] = done / (time.perf_counter() - start)
    results["student_speedup"] = results["student"] / results["teacher"]
    return results


def _train_in_child(flags: List[str], steps: int, warmup: int, teacher_forward: bool = False,
                    epoch: int = 1, top_ops: int = 0, paired_limit: List[str] = None,
                    shuffle_seed: Optional[int] = None) -> dict:
    """:func:`measure_training` (or, given the limit row's flags, :func:`measure_paired`) in a fresh
    process, so that no row inherits another's allocator state or warm caches."""
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_kd_recipes.benchmark", "--child-train", json.dumps(flags),
         "--steps", str(steps), "--warmup", str(warmup), "--child-epoch", str(epoch), "--top-ops", str(top_ops),
         *(["--child-teacher-forward"] if teacher_forward else []),
         *(["--child-paired-limit", json.dumps(paired_limit)] if paired_limit else []),
         *(["--shuffle-seed", str(shuffle_seed)] if shuffle_seed is not None else [])],
        capture_output=True, text=True, env=_quiet_env(),
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(configs: List[str], methods: List[str], steps: int, warmup: int, repeats: int,
        workdir: Path, top_ops: int = 0, paired: bool = False, shuffle_seed: Optional[int] = None,
        precision: str = "fp32") -> dict:
    """Methods run interleaved in ``repeats`` rounds; each keeps its fastest round, which filters
    out interference from other processes on a shared machine. With ``paired`` every row but
    ``limit`` alternates its steps with the limit's in one process (:func:`measure_paired`), and its
    time against the limit is the median of the per-batch ratios of all its rounds, with a 95%
    bootstrap interval. Every row times the same batches: the first ``warmup + steps`` of fairseq's
    length-sorted epoch (the shortest sentences), or of the epoch shuffled with ``shuffle_seed``."""
    from fairseq_kd.progress import print_above_bars, progress_bar

    report = {}
    # one bar over every training child process (rate and time left; only when stderr is a terminal)
    bar = progress_bar(total=len(configs) * repeats * len(methods), desc="benchmark", unit="run")
    say = print_above_bars(lambda line: print(line, flush=True))
    for config_name in configs:
        paths = prepare_config(config_name, workdir)
        rows: Dict[str, dict] = {}
        rounds: Dict[str, List[float]] = {}  # every round's median step time, per method
        paired_ratios: Dict[str, List[float]] = {}  # with ``paired``: every batch's row / limit
        for round_index in range(repeats):
            for method in methods:
                bar.set_postfix_str(f"{config_name} {method}", refresh=False)
                if "error" in rows.get(method, {}):
                    bar.update()
                    continue
                last_round = round_index == repeats - 1
                pair = training_flags(config_name, paths, LIMIT, precision) if paired and method != LIMIT else None
                result = _train_in_child(training_flags(config_name, paths, method, precision), steps, warmup,
                                         teacher_forward=method == LIMIT, epoch=TIMED_EPOCHS.get(method, 1),
                                         top_ops=top_ops if last_round else 0, paired_limit=pair,
                                         shuffle_seed=shuffle_seed)
                bar.update()
                if "error" in result:
                    rows[method] = result
                    say(f"[{config_name}] {method}: FAILED: {result['error']}")
                    continue
                rounds.setdefault(method, []).append(result["step_ms"])
                paired_ratios.setdefault(method, []).extend(result.pop("paired_ratios", []))
                best = rows.get(method)
                operators = result.pop("top_ops", None)
                if best is None or result["step_ms"] < best["step_ms"]:
                    rows[method] = {**result, "peak_mb": min(result["peak_mb"], (best or result)["peak_mb"])}
                if operators:
                    rows[method]["top_ops"] = operators
                versus = (f" (limit in the same process {result['limit_step_ms']:.1f} ms/step)"
                          if "limit_step_ms" in result else "")
                say(f"[{config_name}] round {round_index + 1}: {method}: {result['step_ms']:.1f} ms/step{versus}")
                for op in operators or []:
                    say(f"    {op['self_ms']:8.2f} ms {100 * op['share']:5.1f}%  {op['calls']:5d}x  {op['op']}")
        add_ratios(rows, rounds, paired_ratios)
        decoding = measure_decoding(paths, CONFIGS[config_name]["student_arch"],
                                    CONFIGS[config_name]["student_args"], sentences=200, length=20)
        report[config_name] = {"config": CONFIGS[config_name], "precision": precision,
                               "shapes": config_shapes(config_name, paths),
                               "timed_batches": timed_batches(steps, warmup, shuffle_seed),
                               "methods": rows, "decoding": decoding}
    bar.close()
    return report


def timed_batches(steps: int, warmup: int, shuffle_seed: Optional[int]) -> dict:
    """Which batches a run timed, as its report records it."""
    return {"order": "length-sorted" if shuffle_seed is None else f"shuffled (seed {shuffle_seed})",
            "warmup": warmup, "steps": steps}


def add_ratios(rows: Dict[str, dict], rounds: Dict[str, List[float]],
               paired_ratios: Dict[str, List[float]] = None) -> None:
    """Time and memory of every row relative to ``plain`` and to ``limit``, and the spread of its
    rounds (slowest / fastest), in place. A row with paired ratios (row / limit per batch, timed in
    one process) takes its time against the limit from their median, with a 95% bootstrap
    interval, instead of from the fastest rounds of separate runs."""
    for method, row in rows.items():
        if "error" in row:
            continue
        if rounds.get(method):
            row["rounds_ms"] = rounds[method]
            row["spread"] = max(rounds[method]) / min(rounds[method])
        for reference, suffix in ((PLAIN, ""), (LIMIT, "_vs_limit")):
            base = rows.get(reference)
            if not base or "error" in base:
                continue
            row[f"time_ratio{suffix}"] = row["step_ms"] / base["step_ms"]
            row[f"memory_ratio{suffix}"] = row["peak_mb"] / base["peak_mb"] if base["peak_mb"] > 0 else float("nan")
        if (paired_ratios or {}).get(method):
            row["paired_ratios"] = paired_ratios[method]
            median, low, high = median_with_interval(paired_ratios[method])
            row.update(time_ratio_vs_limit=median, time_ratio_vs_limit_interval=[low, high])


MEMORY_MEASURES = {
    "cuda_max_allocated": "torch.cuda.max_memory_allocated over the timed steps",
    "cpu_step_peak_allocated": "peak of the tensor bytes one step allocates and holds at once "
                               "(torch profiler), above parameters and optimiser state",
}


def to_markdown(report: dict) -> str:
    lines = []
    for config_name, result in report.items():
        cfg = result["config"]
        shapes = result.get("shapes", {})
        student = f" {' '.join(cfg['student_args'])}" if cfg["student_args"] else ""
        lines.append(f"### {config_name}: teacher `{cfg['teacher_arch']}`, student `{cfg['student_arch']}{student}`, "
                     f"max-tokens {cfg['max_tokens']}"
                     + (f", trained in {result['precision']}" if result.get("precision", "fp32") != "fp32" else "")
                     + (f", vocabulary {shapes['vocab']:,}, mean lengths {shapes['mean_src_len']} / "
                        f"{shapes['mean_tgt_len']} tokens" if shapes else ""))
        lines.append("")
        lines.append("| method | step (ms) | vs plain | vs limit | spread | peak mem (MB) | memory vs plain "
                     "| memory vs limit |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        nan = float("nan")
        for method, row in result["methods"].items():
            if "error" in row:
                lines.append(f"| {method} | failed: {row['error']} | | | | | | |")
                continue
            versus_limit = f"{row.get('time_ratio_vs_limit', nan):.2f}x"
            if "time_ratio_vs_limit_interval" in row:
                versus_limit += " ({:.2f}-{:.2f})".format(*row["time_ratio_vs_limit_interval"])
            lines.append(
                f"| {method} | {row['step_ms']:.1f} | {row.get('time_ratio', nan):.2f}x | "
                f"{versus_limit} | {row.get('spread', nan):.2f} | {row['peak_mb']:.1f} | "
                f"{row.get('memory_ratio', nan):.2f}x | {row.get('memory_ratio_vs_limit', nan):.2f}x |"
            )
        lines.append("")
        lines.append("limit = plain step + teacher forward under no_grad (the least a distillation step can "
                     "cost); spread = slowest / fastest of the interleaved rounds.")
        if any("time_ratio_vs_limit_interval" in row for row in result["methods"].values()):
            lines.append("vs limit (a, b): paired, the median over batches of (row step / limit step), the two "
                         "steps alternating in one process, with its 95% bootstrap interval; vs plain compares "
                         "separate runs.")
        if "timed_batches" in result:
            batches = result["timed_batches"]
            lines.append(f"Timed batches: {batches['steps']} after {batches['warmup']} untimed, from the start of the "
                         f"epoch in {batches['order']} order (one batch of {cfg['max_tokens']} tokens each).")
        measures = {row.get("memory_measure") for row in result["methods"].values()} - {None}
        if measures:
            lines.append("peak mem: " + ", ".join(MEMORY_MEASURES.get(m, m) for m in sorted(measures)) + ".")
        dec = result["decoding"]
        lines.append("")
        lines.append(f"Decoding (beam 5, equal output length): teacher {dec['teacher']:.1f} sent/s, "
                     f"student {dec['student']:.1f} sent/s, student speed-up {dec['student_speedup']:.2f}x")
        lines.append("")
    return "\n".join(lines)


def cli_main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=sorted(CONFIGS),
                        help="configurations to measure (default: %(default)s; wmt is A2D's WMT'14 size)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"rows of the method table to measure (default: {', '.join(DEFAULT_METHODS)}; "
                             f"any of: {', '.join(METHODS)}); 'plain' and 'limit' are always added")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--repeats", type=int, default=2,
                        help="interleaved rounds over all methods; each method keeps its fastest")
    parser.add_argument("--workdir", type=Path, default=Path("benchmark_output/work"),
                        help="where corpora and teacher checkpoints are made (reused across runs)")
    parser.add_argument("--output-dir", type=Path, default=Path("benchmark_output"),
                        help="writes benchmark.json and benchmark.md here")
    parser.add_argument("--top-ops", type=int, default=0, metavar="N",
                        help="print (and record) where each row's step time goes: its N operators with the "
                             "most self time in one more step of the last round (torch profiler)")
    parser.add_argument("--shuffle-seed", type=int, default=None, metavar="SEED",
                        help="time batches from an epoch shuffled with this seed, as fairseq-train shuffles "
                             "them, so they mix the corpus's sentence lengths (default: fairseq's length-sorted "
                             "order, whose first batches hold the shortest sentences)")
    parser.add_argument("--paired", action="store_true",
                        help="time every row against the limit in one process, their steps alternating on the "
                             "same batches, and report the median per-batch ratio with a 95%% interval: it "
                             "resolves differences of a few percent on a loaded machine, where separate runs "
                             "do not (each row's child builds the limit too, so it takes about twice as long)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                        help="train every row in this precision (fairseq-train's --fp16 / --bf16; default: "
                             "%(default)s); the decoding rows stay in float32")
    parser.add_argument("--child-train", help=argparse.SUPPRESS)
    parser.add_argument("--child-paired-limit", help=argparse.SUPPRESS)
    parser.add_argument("--child-teacher-forward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-epoch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_train and args.child_paired_limit:
        result = measure_paired(json.loads(args.child_train), json.loads(args.child_paired_limit), args.steps,
                                args.warmup, epoch=args.child_epoch, top_ops=args.top_ops,
                                shuffle_seed=args.shuffle_seed)
        print(json.dumps(result))
        return
    if args.child_train:
        result = measure_training(json.loads(args.child_train), args.steps, args.warmup,
                                  teacher_forward=args.child_teacher_forward, epoch=args.child_epoch,
                                  top_ops=args.top_ops, shuffle_seed=args.shuffle_seed)
        print(json.dumps(result))
        return
    methods = args.methods or DEFAULT_METHODS
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {sorted(METHODS)}")
    methods = [PLAIN, LIMIT, *(m for m in methods if m not in (PLAIN, LIMIT))]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report = run(args.configs, methods, args.steps, args.warmup, args.repeats, args.workdir, args.top_ops,
                 paired=args.paired, shuffle_seed=args.shuffle_seed, precision=args.precision)
    (args.output_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    markdown = to_markdown(report)
    (args.output_dir / "benchmark.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    cli_main()
