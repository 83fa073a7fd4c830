"""Sequence-level knowledge distillation data (Kim & Rush, 2016, "Sequence-Level Knowledge
Distillation", EMNLP, arXiv:1606.07947): the teacher beam-decodes every training source sentence
and the student is trained on (source, teacher hypothesis) pairs with any criterion.

:func:`run` decodes a binarised split (fairseq's ``SequenceGenerator``, CTranslate2, or a Hugging
Face teacher's ``generate``) and writes a binarised folder ``fairseq-train`` reads as it is: the
source ids unchanged, the best hypotheses as targets (or n-best ones chosen and filtered by
:mod:`.selection`), the other splits and dictionaries copied, and ``seqkd.json``, its record.
Resumable and splittable over workers in shards (:mod:`.common`); every check happens before
decoding. Details and the engines' differences: ``docs/design/teacher_passes.md``.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..data.binarised import split_files
from ..deploy.export_ctranslate2 import QUANTIZATIONS
from ..errors import FOLDER, OUTPUT_FOLDER, InputError, PathError, require_path
from ..fingerprint import fingerprint, fingerprint_files, record_sha256, write_json
from ..models.teacher import is_hugging_face_folder, teacher_file_problem
from ..scoring.detok import BPE_SCHEMES
from .common import (JOB_ARRAY, MERGED, MERGED_BEFORE, SHARDS_REMAIN, Workers, check_max_tokens, check_shards,
                     create_record, device_kind, identity, identity_differences, infer_languages, is_temporary,
                     job_array_worker, length_ordered_indices, load_split, load_teacher, merge_lock,
                     merge_when_complete, missing_shards, num_shards_field, on_device, own_pending_shards, pick_device,
                     rank_group, read_record, refuse_shard, shard_batches, shard_id_field, shard_progress, shard_range,
                     teacher_fingerprint, translation_task, user_folders, wait_for_ranks, workers_for, write_shard)
from .selection import SELECTIONS, choose, kept_by_cross_entropy, selection_problem, teacher_cross_entropy

MANIFEST_NAME = "seqkd.json"
WORK_DIR_NAME = "seqkd_work"
FORMAT_VERSION = 5  # seqkd.json's "format"
ENGINES = ("fairseq", "ctranslate2", "transformers")
AUTO_ENGINE = "auto"
CT2_TEACHER_DIR = "ctranslate2_teacher"
#: the flags that change the output's bytes (with the languages, the device and the engine's own)
SETTINGS = ("split", "beam", "max_len_a", "max_len_b", "lenpen", "fp16", "shard_size", "engine", "max_tokens",
            "batch_size", "nbest", "select", "keep_hypotheses", "filter_max_ce", "filter_keep_share", "mix_original")
LABELS = {**{name: "--" + name.replace("_", "-") for name in
             SETTINGS + ("source_lang", "target_lang", "ct2_quantization", "remove_bpe")},
          "ct2_batch_parts": "the batch split of --threads", "device": "the device (--cpu)",
          "split_files": "the split's files (--data)", "dictionaries": "the dictionaries (--data)",
          "teacher": "--teacher-checkpoint"}
INPUTS = ("split_files", "dictionaries", "teacher")


class SeqKDError(InputError):
    """Bad input for sequence-level KD decoding, detected before any decoding."""


def _help(text: str, **metadata) -> dict:
    return {"help": text, **metadata}


@dataclass(frozen=True)
class SeqKDConfig:
    """Inputs of :func:`run`, one flag of ``fairseq-kd-seqkd`` each."""

    data: str = field(metadata=_help(
        "binarised data folder (fairseq-preprocess --destdir) holding dict.*.txt and the split to decode"))
    teacher_checkpoint: str = field(metadata=_help(
        "fairseq Transformer translation checkpoint trained with the same dictionaries as --data, or a Hugging "
        "Face save_pretrained folder whose vocabulary --data is binarised in (fairseq-kd-hf-data)"))
    output: str = field(metadata=_help(
        "folder to write the new dataset into: new or empty, one this command started with the same flags "
        "(resumed), or any folder with --force"))
    teacher_data: Optional[str] = field(default=None, metadata=_help(
        "folder holding the teacher's dict.SRC.txt and dict.TGT.txt (its fairseq-preprocess --destdir), to "
        "check symbol for symbol that the teacher uses --data's dictionaries when the checkpoint cannot prove "
        "it (a teacher not trained by translation_kd, whose data folder is not on this machine); without any "
        "proof the teacher is refused", metavar="DIR"))
    source_lang: Optional[str] = field(default=None, metadata=_help(
        "source language suffix; inferred from the file names like fairseq does when either language is not "
        "given"))
    target_lang: Optional[str] = field(default=None, metadata=_help(
        "target language suffix; inferred like --source-lang"))
    split: str = field(default="train", metadata=_help(
        "split to decode; the other splits are copied unchanged"))
    beam: int = field(default=5, metadata=_help(
        "beam size; the best hypothesis becomes the target (Kim & Rush: 5)"))
    max_len_a: float = field(default=0.0, metadata=_help(
        "hypotheses are at most max_len_a * source_length + max_len_b tokens, source length of the batch's "
        "longest source"))
    max_len_b: int = field(default=200, metadata=_help("see --max-len-a"))
    lenpen: float = field(default=1.0, metadata=_help("length penalty of beam search, as in fairseq-generate"))
    max_tokens: Optional[int] = field(default=4096, metadata=_help("source tokens per decoding batch"))
    batch_size: Optional[int] = field(default=None, metadata=_help(
        "sentences per decoding batch (default: limited by --max-tokens only)"))
    shard_size: int = field(default=10000, metadata=_help(
        "sentences per resumable shard: an interrupted run loses at most one shard of work"))
    fp16: bool = field(default=False, metadata=_help("decode in half precision (CUDA only)"))
    cpu: bool = field(default=False, metadata=_help(
        "decode on the CPU even when CUDA is available (default: CUDA if available)"))
    force: bool = field(default=False, metadata=_help(
        "use an --output folder that holds another dataset: its binarised files (*.bin, *.idx, dict.*.txt) "
        "and previous seq-KD work are deleted first"))
    max_shards: Optional[int] = field(default=None, metadata=_help(
        "decode at most this many not-yet-written shards, then stop without binarising (re-run to "
        "continue); splits a long job across sessions (default: all)"))
    engine: str = field(default=AUTO_ENGINE, metadata=_help(
        "decoding engine: fairseq (SequenceGenerator), ctranslate2 (the teacher converted to CTranslate2 "
        "once per run; needs the deploy extra) or transformers (a Hugging Face teacher folder's own generate; "
        "needs the hf extra); auto: transformers for a Hugging Face folder, fairseq otherwise",
        metavar="{auto,fairseq,ctranslate2,transformers}"))
    ct2_quantization: str = field(default="float32", metadata=_help(
        f"with --engine ctranslate2: weight type of the converted teacher, one of {', '.join(QUANTIZATIONS)} "
        "(float32 gives fairseq's tokens most closely)", metavar="TYPE"))
    threads: int = field(default=0, metadata=_help(
        "with --engine ctranslate2: CTranslate2 threads on the CPU, N > 1 decoding each batch as N parts in "
        "parallel, one thread each (0: its default)"))
    nbest: int = field(default=1, metadata=_help("hypotheses decoded per source (at most --beam)"))
    select: str = field(default="best", metadata=_help(
        "which of the n-best become targets: best (the teacher's order), chrf or bleu (highest sentence chrF or "
        "BLEU against the pair's reference), mbr (highest mean chrF against the other hypotheses)",
        metavar="{" + ",".join(SELECTIONS) + "}"))
    remove_bpe: Optional[str] = field(default=None, metadata=_help(
        "how the subword segmentation of --data is undone before chrF or BLEU (required by --select chrf, bleu "
        "or mbr), as fairseq's --post-process", metavar="{" + ",".join(BPE_SCHEMES) + "}"))
    keep_hypotheses: int = field(default=1, metadata=_help(
        "the best hypotheses by --select kept per source, each as a pair of its own (at most --nbest)"))
    filter_max_ce: Optional[float] = field(default=None, metadata=_help(
        "remove the pairs whose target's per-token cross-entropy under the teacher (nats) exceeds this"))
    filter_keep_share: Optional[float] = field(default=None, metadata=_help(
        "keep this share (0 < S <= 1) of the pairs, those of lowest per-token cross-entropy under the teacher"))
    mix_original: bool = field(default=False, metadata=_help(
        "append the split's original pairs (its references) to the distilled ones"))
    num_shards: Optional[int] = num_shards_field()
    shard_id: Optional[int] = shard_id_field()

    @property
    def filtering(self) -> bool:
        return self.filter_max_ce is not None or self.filter_keep_share is not None

    @property
    def one_best(self) -> bool:
        """Kim & Rush's data: one hypothesis per source, unchosen, unfiltered (shards as ever)."""
        return self.nbest == 1 and not self.filtering


@dataclass
class SeqKDResult:
    status: str  # complete, up_to_date, partial (stopped by max_shards) or worker_done (others remain or merge)
    output: Path
    sentences: int  # sentences in the split
    decoded_now: int  # sentences decoded by this call
    decode_seconds: float  # time spent in the generator loop by this call
    shards_done: int
    shards_total: int
    worker: str = ""  # the prefix of this worker's lines ('' for one process)
    reports: bool = True  # False on ranks other than 0, which print nothing
    summary: Optional[dict] = None  # a complete output's pairs: kept, filtered, original, mean chosen rank

    @property
    def sentences_per_second(self) -> float:
        return self.decoded_now / self.decode_seconds if self.decode_seconds > 0 else float("nan")


# ----------------------------------------------------------------------------- helpers
def _dataset_files_of_other_splits(data: Path, split: str, src: str, tgt: str) -> List[Path]:
    pairs, split_part = {f"{src}-{tgt}", f"{tgt}-{src}"}, re.escape(split) + r"\d*"
    found = []
    for path in sorted(data.iterdir()):
        parts = path.name.split(".")
        if (len(parts) == 4 and parts[1] in pairs and parts[2] in (src, tgt) and parts[3] in ("bin", "idx")
                and not re.fullmatch(split_part, parts[0])):
            found.append(path)
    return found


# ------------------------------------------------------------------------------ planning
@dataclass
class _Plan:
    config: SeqKDConfig
    data: Path
    output: Path
    src: str
    tgt: str
    parameters: dict
    inputs: dict
    manifest: Optional[dict]
    first_target: Optional[int] = None

    @property
    def record(self) -> dict:
        return {"format": FORMAT_VERSION, "parameters": self.parameters, "inputs": self.inputs}

    @property
    def identity_digest(self) -> str:
        return record_sha256(_identity(self.record))

    @property
    def work(self) -> Path:
        return self.output / WORK_DIR_NAME

    def shard_path(self, index: int) -> Path:
        return self.work / f"shard{index:06d}.pt"

    def output_prefix(self, lang: str) -> Path:
        return self.output / f"{self.config.split}.{self.src}-{self.tgt}.{lang}"


def _check_flags(config: SeqKDConfig) -> None:
    c = config
    problem = next((message for bad, message in (
        (c.engine not in ENGINES, f"--engine {c.engine!r}: choose one of {', '.join((AUTO_ENGINE,) + ENGINES)}"),
        (c.ct2_quantization not in QUANTIZATIONS,
         f"--ct2-quantization {c.ct2_quantization!r}: choose one of {', '.join(QUANTIZATIONS)}"),
        (c.threads < 0, f"--threads must be >= 0 (0: CTranslate2's default), got {c.threads}"),
        (c.fp16 and c.engine == "ctranslate2", "--fp16 is for --engine fairseq; with --engine ctranslate2 use "
         "--ct2-quantization float16 or int8_float16 on CUDA"),
        (c.beam < 1, f"--beam must be >= 1, got {c.beam}"),
        (c.shard_size < 1, f"--shard-size must be >= 1 sentence, got {c.shard_size}"),
        (c.max_len_a < 0 or c.max_len_b < 1,
         f"--max-len-a must be >= 0 and --max-len-b >= 1, got {c.max_len_a} and {c.max_len_b}"),
        (c.max_tokens is None and c.batch_size is None,
         "give --max-tokens or --batch-size (or both) to size the decoding batches"),
        (any(value is not None and value < 1 for value in (c.max_tokens, c.batch_size)),
         f"--max-tokens and --batch-size must be positive, got {c.max_tokens} and {c.batch_size}"),
        (c.max_shards is not None and c.max_shards < 1, f"--max-shards must be >= 1, got {c.max_shards}"),
        (c.fp16 and (c.cpu or not torch.cuda.is_available()), "--fp16 needs a CUDA device (and no --cpu)"),
    ) if bad), None) or selection_problem(config)
    if problem is not None:
        raise SeqKDError(problem)


def plan(config: SeqKDConfig) -> _Plan:
    """Every check that needs no model: flags, data, split, output folder. Raises SeqKDError."""
    if config.engine == AUTO_ENGINE:
        config = replace(config, engine="transformers" if is_hugging_face_folder(config.teacher_checkpoint)
                         else "fairseq")
    _check_flags(config)
    if os.pathsep in config.data:
        raise SeqKDError(f"--data {config.data!r}: give one binarised folder, not a {os.pathsep!r}-separated list")
    data = Path(config.data).resolve()
    _require_path(config.data, "--data", FOLDER, hint="a fairseq-preprocess --destdir is expected")
    src, tgt = infer_languages(data, config.source_lang, config.target_lang, SeqKDError)
    for lang, flag in ((src, "--source-lang"), (tgt, "--target-lang")):
        if not (data / f"dict.{lang}.txt").is_file():
            raise SeqKDError(f"--data {data}: no dict.{lang}.txt; is {flag} {lang} right?")
    files = split_files(data, config.split, src, tgt)
    if not any(p.name.endswith(f".{src}.idx") for p in files):
        raise SeqKDError(f"--split {config.split}: no binarised {config.split}.{src}-{tgt}.{src} in {data}; "
                         "binarise it with fairseq-preprocess or pick another split")
    source_bins = [p for p in files if p.name.endswith(f".{src}.bin")]
    if sum(p.stat().st_size for p in source_bins) == 0:  # every sentence holds at least </s>
        raise SeqKDError(f"--split {config.split}: the split in {data} has no sentences "
                         f"({', '.join(p.name for p in source_bins) or 'no .bin file'})")
    _check_teacher_for_engine(config)
    output = Path(config.output).resolve()
    if output == data:
        raise SeqKDError(f"--output {config.output} is the --data folder; the input split would be "
                         "overwritten while it is read. Choose another folder.")
    _require_path(config.output, "--output", OUTPUT_FOLDER)
    manifest = read_record(output / MANIFEST_NAME)
    recorded = (manifest or {}).get("inputs") or {}  # their checksums are reused for unchanged files
    dictionaries = [data / f"dict.{src}.txt", data / f"dict.{tgt}.txt"]
    teacher = Path(config.teacher_checkpoint)
    # what the output is a function of: contents, not paths (a moved folder still resumes)
    parameters = {**{name: getattr(config, name) for name in SETTINGS}, "source_lang": src, "target_lang": tgt,
                  "device": device_kind(config.cpu)}
    if config.select != "best":
        parameters["remove_bpe"] = config.remove_bpe
    if config.engine == "ctranslate2":
        parameters["ct2_quantization"] = config.ct2_quantization
        # CTranslate2Engine splits each batch into --threads parts on the CPU, each padded alone
        if config.threads > 1 and parameters["device"] == "cpu":
            parameters["ct2_batch_parts"] = config.threads
    inputs = {
        "split_files": fingerprint_files(files, recorded.get("split_files")),
        "dictionaries": fingerprint_files(dictionaries, recorded.get("dictionaries")),
        "teacher": teacher_fingerprint(teacher, recorded.get("teacher")),
    }
    plan_ = _Plan(config, data, output, src, tgt, parameters, inputs, manifest=None)
    plan_.manifest = _check_output_folder(plan_, manifest)
    return plan_


def _require_path(path: str, flag: str, expected: str, hint: str = "") -> None:
    try:
        require_path(path, flag, expected, hint)
    except PathError as error:
        raise SeqKDError(str(error)) from None


def _check_teacher_for_engine(config: SeqKDConfig) -> None:
    """A Hugging Face folder for ``transformers``, a readable fairseq checkpoint for the others."""
    flag = f"--teacher-checkpoint {config.teacher_checkpoint!r}"
    folder = is_hugging_face_folder(config.teacher_checkpoint)
    if config.engine == "transformers" and not folder:
        raise SeqKDError(f"{flag}: --engine transformers decodes with a Hugging Face save_pretrained folder (one "
                         "holding config.json); for a fairseq checkpoint use --engine fairseq or ctranslate2")
    if folder and config.engine != "transformers":
        raise SeqKDError(f"{flag} is a Hugging Face model folder: decode with --engine transformers (what --engine "
                         f"auto chooses for a folder), not --engine {config.engine}")
    if not folder:
        problem = teacher_file_problem(config.teacher_checkpoint)
        if problem is not None:
            raise SeqKDError(f"{flag}: {problem}")


def _identity(record: dict) -> dict:
    return identity(record.get("parameters", {}), record.get("inputs", {}))


def _check_output_folder(plan_: _Plan, manifest: Optional[dict]) -> Optional[dict]:
    """The manifest to resume from (None: start afresh); refuses a folder holding other data."""
    output = plan_.output
    # a worker starting at the same time may be creating the manifest (its temporary file)
    if not output.exists() or all(is_temporary(path) for path in output.iterdir()):
        return None
    if manifest is not None and _identity(manifest) == _identity(plan_.record):
        return manifest
    if plan_.config.force:
        return None
    if manifest is None:
        listing = ", ".join(sorted(p.name for p in output.iterdir())[:5])
        raise SeqKDError(
            f"--output {output} is not empty and was not written by this command with these settings "
            f"(no readable {MANIFEST_NAME}; it holds {listing}, ...). Choose an empty or new folder, or "
            "pass --force to replace the binarised dataset in it.")
    _refuse_other_settings(plan_, manifest)


def _refuse_other_settings(plan_: _Plan, manifest: dict) -> None:
    old, new = _identity(manifest), _identity(plan_.record)
    differing = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    details = "; ".join(identity_differences(old, new, LABELS, INPUTS))
    raise SeqKDError(
        f"--output {plan_.output} holds a sequence-KD dataset made with other settings (differing: "
        f"{', '.join(differing)}; see {plan_.output / MANIFEST_NAME}): {details}. Give every worker the recorded "
        "settings, choose another folder, or pass --force to discard it and decode anew.")


def _clear_for_force(plan_: _Plan) -> None:
    """Remove previous seq-KD work and every binarised file (no stale ``train1`` read with the new)."""
    if plan_.work.exists():
        shutil.rmtree(plan_.work)
    if not plan_.output.is_dir():  # --force into a folder that does not exist yet: nothing to clear
        return
    binarised = [p for p in plan_.output.iterdir() if p.is_file() and (
        p.suffix in (".bin", ".idx") or re.fullmatch(r"dict\..+\.txt", p.name))]
    for path in binarised + [plan_.output / MANIFEST_NAME]:
        if path.exists():
            path.unlink()


# ------------------------------------------------------------------------------ decoding
def _load(plan_: _Plan, workers: Workers):
    """``(task, split, teacher model, device)``, checked before any work."""
    task = translation_task(plan_.data, plan_.src, plan_.tgt, plan_.config.split)
    dataset = load_split(task, plan_.config.split)
    if len(dataset) == 0:
        raise SeqKDError(f"--split {plan_.config.split}: the split in {plan_.data} has no sentences")
    teacher = load_teacher(task, plan_.config.teacher_checkpoint, plan_.config.teacher_data,
                           plan_.inputs["teacher"]["sha256"])  # fingerprinted by plan()
    max_source = teacher.model.max_positions()[0]
    too_long = (dataset.src_sizes > max_source).nonzero()[0]
    if len(too_long):
        raise SeqKDError(
            f"{len(too_long)} source sentences of --split {plan_.config.split} are longer than the "
            f"teacher's {max_source} source positions (first: sentence {int(too_long[0])}, "
            f"{int(dataset.src_sizes[too_long[0]])} tokens); filter them out of the data first.")
    check_max_tokens(dataset, plan_.config.max_tokens, plan_.config.split, SeqKDError)
    if dataset.tgt is None and (plan_.config.select in ("chrf", "bleu") or plan_.config.mix_original):
        raise SeqKDError(f"--split {plan_.config.split} has no target side: --select {plan_.config.select} and "
                         "--mix-original read its references; binarise the split with its targets")
    device = pick_device(plan_.config.cpu, workers)
    use_cuda = device.type == "cuda"
    if plan_.config.engine == "ctranslate2":
        from ..deploy import import_ctranslate2

        ctranslate2 = import_ctranslate2()  # a missing extra: one line naming the fix, before any work
        if use_cuda and ctranslate2.get_cuda_device_count() == 0:
            raise SeqKDError("--engine ctranslate2: this CTranslate2 build sees no CUDA device; pass --cpu "
                             "or install a CUDA build of CTranslate2")
        # the torch model stays on the CPU, unused, unless it computes the filter's cross-entropy
        model = on_device(teacher.model, device, False) if plan_.config.filtering else teacher.model
        return task, dataset, model, device
    if plan_.config.engine == "transformers":
        from ..deploy.hf_engine import HuggingFaceDecodingError, first_target_symbol

        try:  # a multilingual teacher's target-language tag, read from the split's targets
            plan_.first_target = first_target_symbol(plan_.config.teacher_checkpoint, dataset, task.target_dictionary,
                                                     "--teacher-checkpoint")
        except HuggingFaceDecodingError as error:
            raise SeqKDError(str(error)) from None
    return task, dataset, on_device(teacher.model, device, plan_.config.fp16), device


def _ctranslate2_teacher(plan_: _Plan, workers: Workers) -> Path:
    """The teacher converted to CTranslate2 in the work folder (reused when its record matches; one
    copy per worker, so that none replaces a folder another decodes with)."""
    from ..deploy.export_ctranslate2 import export_ctranslate2, read_record

    name = CT2_TEACHER_DIR if workers.count == 1 else f"{CT2_TEACHER_DIR}_worker{workers.index}"
    folder = plan_.work / name
    for stale in itertools.chain(plan_.work.glob(f".{name}.export-*"), plan_.work.glob(f".{name}.replaced-*")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while converting
    if folder.exists():
        record = read_record(str(folder)) if (folder / "model.bin").is_file() else None
        if (record and record.get("checkpoint_sha256") == plan_.inputs["teacher"]["sha256"]
                and record.get("quantization") == plan_.config.ct2_quantization):
            return folder
        shutil.rmtree(folder)
    export_ctranslate2(plan_.config.teacher_checkpoint, str(folder), quantization=plan_.config.ct2_quantization,
                       data=str(plan_.data))
    return folder


#: one decoding batch (a collated fairseq sample) -> the ``--nbest`` hypotheses of each sentence in
#: the teacher's order, sentences in the order of ``sample["id"]``, as int32 target ids ending with
#: ``</s>``, each with its per-token cross-entropy under the teacher (with a filter; else NaN)
Decoder = Callable[[dict], List[List[Tuple[torch.Tensor, float]]]]


def make_decoder(plan_: _Plan, task, dataset, model, device, ct2_model: Optional[Path] = None) -> Decoder:
    """The engine's :data:`Decoder`; the cross-entropy from ``model`` whatever the engine."""
    from fairseq import utils

    config, decode = plan_.config, _engine_decoder(plan_, task, dataset, model, device, ct2_model)
    pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()

    def decode_and_score(sample: dict) -> List[List[Tuple[torch.Tensor, float]]]:
        nbest = decode(sample)
        if not config.filtering:
            return [[(tokens, math.nan) for tokens in hypotheses] for hypotheses in nbest]
        if any(len(hypotheses) != config.nbest for hypotheses in nbest):
            raise RuntimeError(f"the engine returned other than {config.nbest} hypotheses for a source")
        moved = utils.move_to_cuda(sample, device=device) if device.type == "cuda" else sample
        scores = teacher_cross_entropy(model, moved, [t for hypotheses in nbest for t in hypotheses], config.nbest,
                                       pad, eos).tolist()
        return [list(zip(hypotheses, scores[i * config.nbest:(i + 1) * config.nbest]))
                for i, hypotheses in enumerate(nbest)]

    return decode_and_score


def _engine_decoder(plan_: _Plan, task, dataset, model, device,
                    ct2_model: Optional[Path]) -> Callable[[dict], List[List[torch.Tensor]]]:
    """Each sentence's ``--nbest`` hypotheses by the engine, with the same search settings."""
    config = plan_.config
    if config.engine in ("ctranslate2", "transformers"):
        from ..deploy.ctranslate2_engine import CTranslate2Engine, DecodingSettings

        if config.engine == "ctranslate2":
            engine = CTranslate2Engine(str(ct2_model), task.source_dictionary, task.target_dictionary,
                                       device=device.type, device_index=device.index or 0, threads=config.threads)
        else:
            from ..deploy.hf_engine import HuggingFaceEngine

            engine = HuggingFaceEngine(model, plan_.first_target)
        settings = DecodingSettings(beam=config.beam, lenpen=config.lenpen, max_len_a=config.max_len_a,
                                    max_len_b=config.max_len_b, nbest=config.nbest)

        def decode_with_engine(sample: dict) -> List[List[torch.Tensor]]:
            sources = [dataset[int(i)]["source"].tolist() for i in sample["id"].tolist()]
            # fairseq's length limit comes from the padded batch's source length
            longest = sample["net_input"]["src_tokens"].size(1)
            hypotheses = [torch.tensor(h.tokens, dtype=torch.int32)
                          for h in engine.translate(sources, settings, longest_source=longest)]
            return [hypotheses[i:i + config.nbest] for i in range(0, len(hypotheses), config.nbest)]

        return decode_with_engine

    from fairseq import utils
    from fairseq.dataclass.configs import GenerationConfig

    generator = task.build_generator([model], GenerationConfig(
        beam=config.beam, nbest=config.nbest, max_len_a=config.max_len_a, max_len_b=config.max_len_b,
        lenpen=config.lenpen))

    def decode_fairseq(sample: dict) -> List[List[torch.Tensor]]:
        sample = utils.move_to_cuda(sample, device=device) if device.type == "cuda" else sample
        outputs = task.inference_step(generator, [model], sample)
        return [[hypothesis["tokens"].int().cpu() for hypothesis in nbest[:config.nbest]] for nbest in outputs]

    return decode_fairseq


def _decode_shard(plan_: _Plan, dataset, decode: Decoder, ordered, index: int,
                  on_batch: Callable[[int], None] = lambda sentences: None) -> int:
    """Decode shard ``index``, keep each sentence's hypotheses chosen by ``--select``, write it."""
    first, last = shard_range(index, plan_.config.shard_size, len(dataset))
    batches = shard_batches(dataset, ordered, first, last, plan_.config.max_tokens, plan_.config.batch_size)
    chosen: Dict[int, list] = {}
    for batch in batches:
        sample = dataset.collater([dataset[int(i)] for i in batch])
        sentence_ids = sample["id"].tolist()
        scored = decode(sample)
        if len(scored) != len(sentence_ids):
            raise RuntimeError(f"shard {index}: {len(scored)} hypotheses for a batch of {len(sentence_ids)}")
        for i, hypotheses in zip(sentence_ids, scored):
            reference = None if dataset.tgt is None else dataset.tgt[i]
            chosen[i] = choose(plan_.config, dataset.tgt_dict, hypotheses, reference)
        on_batch(len(batch))
    ids = list(range(first, last))
    if sorted(chosen) != ids:
        raise RuntimeError(f"shard {index}: decoded sentence ids do not cover {first}..{last - 1}")
    kept = [hypothesis for i in ids for hypothesis in chosen[i]]
    tokens = [tokens for _, tokens, _ in kept]
    shard = {
        "first_id": first,
        "count": len(ids),
        "lengths": torch.tensor([len(t) for t in tokens], dtype=torch.long),
        "tokens": torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int32),
    }
    if not plan_.config.one_best:
        shard["ranks"] = torch.tensor([rank for rank, _, _ in kept], dtype=torch.long)
        shard["cross_entropy"] = torch.tensor([ce for _, _, ce in kept], dtype=torch.float64)
    payload = io.BytesIO()
    torch.save(shard, payload)
    write_shard(plan_.shard_path(index), payload.getvalue(), plan_.identity_digest, index, (first, last))
    return len(ids)


def _read_shard(plan_: _Plan, index: int, sentences: int) -> dict:
    """A checked shard's ``hypotheses`` (and ``ranks``, ``cross_entropy`` unless one-best), else refused."""
    path = plan_.shard_path(index)
    first, last = shard_range(index, plan_.config.shard_size, sentences)
    pairs = (last - first) * plan_.config.keep_hypotheses
    extra = () if plan_.config.one_best else ("ranks", "cross_entropy")
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever torch says, the shard is refused by name
        problem = f"is unreadable ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
    else:
        valid = (isinstance(shard, dict) and shard.get("first_id") == first and shard.get("count") == last - first
                 and all(isinstance(shard.get(key), torch.Tensor) for key in ("lengths", "tokens", *extra))
                 and all(len(shard[key]) == pairs for key in ("lengths", *extra))
                 and int(shard["lengths"].sum()) == shard["tokens"].numel())
        if valid:
            return {"hypotheses": list(torch.split(shard["tokens"], shard["lengths"].tolist())),
                    **{key: shard[key].tolist() for key in extra}}
        problem = f"does not hold the hypotheses of sentences {first}..{last - 1}"
    refuse_shard(path, problem, f"--output {plan_.output}: {WORK_DIR_NAME}/{path.name}", SeqKDError)


def _kept_pairs(plan_: _Plan, shard_count: int, sentences: int) -> Optional[List[bool]]:
    config = plan_.config
    if not config.filtering:
        return None
    ce = [value for index in range(shard_count) for value in _read_shard(plan_, index, sentences)["cross_entropy"]]
    return kept_by_cross_entropy(ce, config.filter_max_ce, config.filter_keep_share)


def _binarize(plan_: _Plan, dataset, task, shard_count: int) -> dict:
    """Write the new split (the kept pairs, then with ``--mix-original`` the original ones); its summary."""
    from fairseq.data import indexed_dataset

    staging = plan_.work / "binarised"
    staging.mkdir(parents=True, exist_ok=True)
    stats = {"source_tokens": 0, "target_tokens": 0, "empty_hypotheses": 0}
    writers = {}
    for lang, dictionary in ((plan_.src, task.source_dictionary), (plan_.tgt, task.target_dictionary)):
        prefix = staging / plan_.output_prefix(lang).name
        writers[lang] = (prefix, indexed_dataset.make_builder(str(prefix) + ".bin", "mmap",
                                                               vocab_size=len(dictionary)))
    eos = task.target_dictionary.eos()
    keep, sentences = plan_.config.keep_hypotheses, len(dataset)
    kept = _kept_pairs(plan_, shard_count, sentences)
    pair, first_ranks, kept_ce = 0, [], []

    def add(source, target):
        writers[plan_.src][1].add_item(source)
        writers[plan_.tgt][1].add_item(target.long())
        stats["source_tokens"] += len(source)
        stats["target_tokens"] += len(target)

    for index in range(shard_count):
        shard = _read_shard(plan_, index, sentences)
        first_ranks += shard.get("ranks", [0] * len(shard["hypotheses"]))[::keep]
        for offset, hypothesis in enumerate(shard["hypotheses"]):
            if kept is None or kept[pair]:
                add(dataset.src[pair // keep], hypothesis)
                stats["empty_hypotheses"] += int(len(hypothesis) == 1 and hypothesis[0] == eos)
                if kept is not None:
                    kept_ce.append(shard["cross_entropy"][offset])
            pair += 1
    if pair != sentences * keep:
        raise RuntimeError(f"the shards hold {pair} hypotheses for {sentences} sentences")
    distilled = pair if kept is None else sum(kept)
    for sentence_id in range(sentences if plan_.config.mix_original else 0):
        add(dataset.src[sentence_id], dataset.tgt[sentence_id])
    for prefix, builder in writers.values():
        builder.finalize(str(prefix) + ".idx")
    for lang in (plan_.src, plan_.tgt):
        for suffix in (".bin", ".idx"):
            os.replace(str(staging / plan_.output_prefix(lang).name) + suffix, str(plan_.output_prefix(lang)) + suffix)
    original = sentences if plan_.config.mix_original else 0
    summary = {"pairs": distilled + original, "distilled_pairs": distilled, "filtered_pairs": pair - distilled,
               "original_pairs": original, "mean_chosen_rank": 1 + sum(first_ranks) / sentences}
    if kept is not None:
        summary["kept_cross_entropy"] = {"mean": sum(kept_ce) / max(len(kept_ce), 1), "max": max(kept_ce, default=None)}
    return {**stats, "summary": summary}


def _copy_other_splits(plan_: _Plan) -> List[str]:
    copied = []
    for path in ([plan_.data / f"dict.{plan_.src}.txt", plan_.data / f"dict.{plan_.tgt}.txt"]
                 + _dataset_files_of_other_splits(plan_.data, plan_.config.split, plan_.src, plan_.tgt)):
        if path.name in copied:
            continue  # --source-lang equal to --target-lang: one dictionary file
        tmp = plan_.output / (path.name + ".tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, plan_.output / path.name)
        copied.append(path.name)
    return copied


def _checked_output_files(plan_: _Plan) -> dict:
    """The output files' fingerprints now, once each is of its recorded size and SHA-256."""
    recorded = plan_.manifest.get("files")
    entries = recorded.get("files") if isinstance(recorded, dict) else None
    what = f"--output {plan_.output}: {MANIFEST_NAME} says complete but"
    if not isinstance(entries, dict) or not entries or not all(
            isinstance(entry, dict) and "sha256" in entry and "size" in entry for entry in entries.values()):
        raise SeqKDError(f"{what} records no digests of its files; pass --force to decode anew")
    now = {}
    for name, entry in sorted(entries.items()):
        path = plan_.output / name
        if not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != entry["size"]:
            problem = f"is {path.stat().st_size} bytes where it records {entry['size']}"
        else:
            now[name] = fingerprint(path, entry)
            if now[name]["sha256"] == entry["sha256"]:
                continue
            problem = "is not the file it records (its SHA-256 differs): changed on disk"
        raise SeqKDError(f"{what} {name} {problem}; pass --force to decode anew")
    return {**recorded, "files": now}


def _is_complete(plan_: _Plan) -> bool:
    return (read_record(plan_.output / MANIFEST_NAME) or {}).get("status") == "complete"


def _check_shards(plan_: _Plan, shards: List[int], sentences: int) -> None:
    check_shards(plan_.shard_path, shards, plan_.identity_digest, plan_.config.shard_size, sentences,
                 f"--output {plan_.output}: {WORK_DIR_NAME}", SeqKDError, vanished_ok=True)


def run(config: SeqKDConfig, log: Callable[[str], None] = print) -> SeqKDResult:
    """Decode, resume or confirm the dataset of ``config`` (this worker's shards; the binaries once all exist)."""
    workers = workers_for(config.num_shards, config.shard_id, SeqKDError)
    if config.force and workers.count > 1:
        raise SeqKDError(f"--force with {workers.count} workers ({workers.launcher}): each would delete the others' "
                         f"work; clear --output {config.output} first, or run one process with --force")
    log = workers.log(log)
    plan_ = plan(config)
    with user_folders({"--output": plan_.output, "--data": plan_.data}):
        if plan_.manifest is not None and plan_.manifest.get("status") == "complete":
            return _confirm_complete(plan_, log)
        task, dataset, model, device = _load(plan_, workers)  # teacher and length checks: still before any work
        sentences, shard_count = len(dataset), math.ceil(len(dataset) / config.shard_size)
        output_existed = plan_.output.exists()
        manifest = _start_manifest(plan_, workers, sentences, shard_count)
        with contextlib.ExitStack() as claim:
            claim.enter_context(job_array_worker(plan_.work, workers, SeqKDError))
            pending = own_pending_shards(workers, shard_count, plan_.shard_path, lambda: _is_complete(plan_),
                                         lambda done: _check_shards(plan_, done, sentences))
            ct2_model = (_prepare_ctranslate2(plan_, workers, output_existed)
                         if plan_.config.engine == "ctranslate2" else None)
            decode = make_decoder(plan_, task, dataset, model, device, ct2_model)
            del model  # the CTranslate2 engine holds its own copy of the teacher; fairseq's decoder keeps its own
            with rank_group(workers):
                decoded_now, seconds, left = _decode_own_shards(plan_, dataset, decode, workers, device, pending, log)
                claim.close()  # this --shard-id's shards are done; the merge removes the work folder
                wait_for_ranks(workers)
                outcome = None if left else merge_when_complete(
                    plan_.work, workers, shard_count, missing=lambda: missing_shards(plan_.shard_path, shard_count),
                    merged=lambda: _is_complete(plan_), merge=lambda: _merge(plan_, dataset, task, manifest, device),
                    log=log)
    if outcome in (MERGED, MERGED_BEFORE):
        status, done = "complete", shard_count
    else:
        status = "partial" if left or (outcome == SHARDS_REMAIN and workers.launcher != JOB_ARRAY) else "worker_done"
        done = shard_count - len(missing_shards(plan_.shard_path, shard_count))
    summary = (read_record(plan_.output / MANIFEST_NAME) or {}).get("summary") if status == "complete" else None
    return SeqKDResult(status, plan_.output, sentences, decoded_now, seconds, done, shard_count,
                       workers.label, workers.reports, summary)


def _confirm_complete(plan_: _Plan, log: Callable[[str], None]) -> SeqKDResult:
    """Check a complete output's files, refresh its fingerprints, tidy a killed merge's work folder."""
    files = _checked_output_files(plan_)
    refreshed = {**plan_.manifest, **plan_.record, "files": files}
    if refreshed != plan_.manifest:
        write_json(plan_.output / MANIFEST_NAME, refreshed)
    if plan_.work.exists():
        with merge_lock(plan_.work) as holder:
            if holder is None:
                shutil.rmtree(plan_.work)
    sentences = plan_.manifest["sentences"]
    shards = math.ceil(sentences / plan_.config.shard_size)
    log(f"{plan_.output} already holds this sequence-KD dataset ({sentences} sentences); nothing to do")
    return SeqKDResult("up_to_date", plan_.output, sentences, 0, 0.0, shards, shards,
                       summary=plan_.manifest.get("summary"))


def _start_manifest(plan_: _Plan, workers: Workers, sentences: int, shard_count: int) -> dict:
    """Write the manifest of a decoding in progress (the first of several workers; the others
    refused when their settings differ), then the work folder."""
    manifest = {**plan_.record, "status": "decoding", "sentences": sentences, "shards": shard_count,
                "data": str(plan_.data), "teacher_checkpoint": str(Path(plan_.config.teacher_checkpoint).resolve())}
    if plan_.manifest is None and plan_.config.force:
        _clear_for_force(plan_)  # --force: one process only (run())
        write_json(plan_.output / MANIFEST_NAME, manifest)
    elif plan_.manifest is None:
        found = create_record(plan_.output / MANIFEST_NAME, manifest)
        if found is not None and _identity(found) != _identity(plan_.record):  # another worker wrote it first
            _refuse_other_settings(plan_, found)
    elif manifest != plan_.manifest:
        write_json(plan_.output / MANIFEST_NAME, manifest)
    plan_.work.mkdir(parents=True, exist_ok=True)
    return manifest


def _prepare_ctranslate2(plan_: _Plan, workers: Workers, output_existed: bool) -> Path:
    """This worker's CTranslate2 teacher; a refused conversion of one process's fresh start leaves no trace."""
    try:
        return _ctranslate2_teacher(plan_, workers)
    except Exception:
        if plan_.manifest is None and workers.count == 1:
            (plan_.output / MANIFEST_NAME).unlink(missing_ok=True)
            shutil.rmtree(plan_.work, ignore_errors=True)
            if not output_existed:
                with contextlib.suppress(OSError):
                    plan_.output.rmdir()
        raise


def _decode_own_shards(plan_: _Plan, dataset, decode: Decoder, workers: Workers, device, pending: List[int],
                       log: Callable[[str], None]) -> Tuple[int, float, List[int]]:
    """Decode ``pending`` (at most ``max_shards``): ``(sentences decoded, seconds, shards left)``."""
    if _is_complete(plan_):
        return 0, 0.0, []
    config, sentences = plan_.config, len(dataset)
    shard_count = math.ceil(sentences / config.shard_size)
    owned = workers.owned(range(shard_count))
    if len(pending) < len(owned):
        log(f"{workers.label}resuming: {len(owned) - len(pending)} of {len(owned)} shards already decoded")
    to_decode = pending if config.max_shards is None else pending[:config.max_shards]
    ordered = length_ordered_indices(dataset)
    decoded_now, seconds = 0, 0.0
    with shard_progress(to_decode, config.shard_size, sentences, "seq-KD decoding", log,
                        shown=workers.reports) as (on_batch, log_line):
        for index in to_decode:
            start = time.perf_counter()
            count = _decode_shard(plan_, dataset, decode, ordered, index, on_batch=on_batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            seconds += elapsed
            decoded_now += count
            log_line(f"{workers.label}shard {index + 1}/{shard_count}: {count} sentences in {elapsed:.1f} s")
    return decoded_now, seconds, pending[len(to_decode):]


def _merge(plan_: _Plan, dataset, task, manifest: dict, device) -> None:
    """Every shard exists (one worker, under the merge lock): write the output, then mark it complete."""
    shard_count = manifest["shards"]
    _check_shards(plan_, list(range(shard_count)), len(dataset))
    stats = _binarize(plan_, dataset, task, shard_count)
    copied = _copy_other_splits(plan_)
    written = [plan_.output_prefix(lang).name + suffix
               for lang in (plan_.src, plan_.tgt) for suffix in (".bin", ".idx")]
    unrecorded = ("num_shards", "shard_id")  # how the work was split, not what it is
    if plan_.config.engine != "ctranslate2":  # the CTranslate2 engine's settings, not used
        unrecorded += ("ct2_quantization", "threads")
    decoding = {k: v for k, v in asdict(plan_.config).items() if k not in unrecorded}
    decoding["output"] = str(plan_.output)
    if plan_.config.engine == "ctranslate2":
        from ..deploy import import_ctranslate2

        decoding["ctranslate2_version"] = import_ctranslate2().__version__
    elif plan_.config.engine == "transformers":
        import transformers

        decoding["transformers_version"] = transformers.__version__
    complete = {**manifest, "status": "complete", **stats, "copied": copied, "device": str(device),
                "files": fingerprint_files([plan_.output / name for name in written + copied]),
                "decoding": decoding}
    write_json(plan_.output / MANIFEST_NAME, complete)
    shutil.rmtree(plan_.work)
