"""A Hugging Face teacher for a recipe: ``fairseq-kd-recipe PAIR --teacher DIR``, where ``DIR`` is a
``save_pretrained`` folder (MarianMT, M2M100, NLLB; recognised by its ``config.json``).

Such a teacher reads its own vocabulary, from untokenised, cased text, so the recipe adds one step
after the preparation, ``hf-data``: ``fairseq-kd-hf-data`` binarises the text the preparation keeps
in its working folder (``WORKDIR/prepare/raw/{train,valid,test}.LANG``: every pair's preparation
writes it there before any Moses tokenisation, lowercasing or subword segmentation) into
``WORKDIR/data-hf``, in the teacher's vocabulary. Every student, the no-KD baselines included, then
trains on that data, the teacher is decoded by its own ``generate`` (``fairseq-kd-translate --model
DIR``), and every system is scored after the teacher's tokenizer has turned its tokens back into
text (``fairseq-kd-score --detok-hf DIR``), against the same untouched references as any recipe
(``raw/test.LANG`` of the prepared corpus).

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping, Optional, Sequence

from .execute import RecipeError
from .methods import Method, needs_teacher_heads

#: the file that makes a folder a Hugging Face model folder (save_pretrained writes it)
CONFIG_FILE = "config.json"
#: where the recipe's preparation keeps the untokenised, cased text of every split (under --workdir)
RAW_TEXT = Path("prepare") / "raw"
INSTALL_HINT = "pip install 'fairseq-kd[hf]'"


@dataclass(frozen=True)
class HuggingFaceTeacher:
    """What the plan needs to know of a ``--teacher DIR`` folder."""

    folder: Path
    model_type: str
    #: the tokenizer's codes of the pair's languages (multilingual tokenizers), for fairseq-kd-hf-data
    source_lang: Optional[str]
    target_lang: Optional[str]
    #: the source and target vocabularies differ (a Marian model with separate vocabularies), so
    #: the data's two dictionaries differ
    separate_vocabularies: bool
    #: attention heads of the encoder and the decoder (None where the config does not say)
    encoder_heads: Optional[int]
    decoder_heads: Optional[int]
    #: longest sentence its position embeddings read (None: no limit in the config)
    max_positions: Optional[int]

    def language_flags(self) -> list[str]:
        flags = []
        for flag, code in (("--teacher-source-lang", self.source_lang), ("--teacher-target-lang", self.target_lang)):
            if code is not None:
                flags += [flag, code]
        return flags


def read_config(folder: Path) -> dict:
    """``DIR/config.json`` of a model folder; refuses a folder that is not one."""
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise RecipeError(f"--teacher {folder}: a folder, but not a Hugging Face model folder (no {CONFIG_FILE}, "
                          "which save_pretrained writes); give a save_pretrained folder or a fairseq checkpoint file")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecipeError(f"--teacher {folder}: {CONFIG_FILE} is not readable JSON ({type(error).__name__}: "
                          f"{error}); write the folder again with save_pretrained") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise RecipeError(f"--teacher {folder}: {CONFIG_FILE} names no model_type; it is not a Hugging Face "
                          "model folder")
    return config


def read_teacher(folder: Path, source: str, target: str, source_code: Optional[str] = None,
                 target_code: Optional[str] = None) -> HuggingFaceTeacher:
    """Check ``--teacher DIR`` for a pair (``source``/``target``: its languages; the codes: what
    ``--teacher-source-lang``/``--teacher-target-lang`` name) and read what the plan needs. Loads
    the folder's tokenizer (offline), as fairseq-kd-hf-data will; reads no weights."""
    folder = folder.resolve()
    config = read_config(folder)
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    except ImportError as error:
        raise RecipeError(f"--teacher {folder}: a Hugging Face teacher needs transformers: {INSTALL_HINT} "
                          f"({error})") from None
    model_type = str(config["model_type"])
    if model_type not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise RecipeError(f"--teacher {folder}: model type {model_type!r} is not a text encoder-decoder "
                          "(AutoModelForSeq2SeqLM); a recipe's teacher translates: MarianMT, M2M100, NLLB")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                               trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - any failure means: no usable tokenizer there
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise RecipeError(f"--teacher {folder}: its tokenizer cannot be loaded offline ({type(error).__name__}: "
                          f"{first_line}); save the tokenizer with save_pretrained into the same folder") from None
    from fairseq_kd.cli.hf_data import set_languages
    from fairseq_kd.errors import InputError

    multilingual = hasattr(tokenizer, "src_lang") and hasattr(tokenizer, "tgt_lang")
    codes = (source_code or source, target_code or target) if multilingual else (source_code, target_code)
    try:  # the check fairseq-kd-hf-data makes, before the preparation rather than after it
        set_languages(tokenizer, SimpleNamespace(teacher=str(folder), source_lang=source, target_lang=target,
                                                 teacher_source_lang=source_code, teacher_target_lang=target_code))
    except InputError as error:
        raise RecipeError(str(error)) from None
    heads = [config.get(key) for key in ("encoder_attention_heads", "decoder_attention_heads")]
    positions = config.get("max_position_embeddings")
    return HuggingFaceTeacher(
        folder=folder, model_type=model_type, source_lang=codes[0], target_lang=codes[1],
        separate_vocabularies=bool(getattr(tokenizer, "separate_vocabs", False)),
        encoder_heads=heads[0] if isinstance(heads[0], int) else None,
        decoder_heads=heads[1] if isinstance(heads[1], int) else None,
        max_positions=positions if isinstance(positions, int) and positions > 0 else None,
    )


def architecture_heads(flags: Sequence[str]) -> tuple[int, int]:
    """(encoder, decoder) attention heads of a model given by fairseq-train flags (``--arch`` and
    its overrides), with the registered architecture's defaults (the plugin must be registered)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    flags = list(flags)
    given = argparse.Namespace()
    for name in ("encoder_attention_heads", "decoder_attention_heads"):
        flag = "--" + name.replace("_", "-")
        if flag in flags:
            setattr(given, name, int(flags[flags.index(flag) + 1]))
    ARCH_CONFIG_REGISTRY[flags[flags.index("--arch") + 1]](given)
    return given.encoder_attention_heads, given.decoder_attention_heads


def method_problems(teacher: HuggingFaceTeacher, methods: Sequence[Method],
                    student_flags: Mapping[str, Sequence[str]]) -> list[str]:
    """Why each method that cannot run with ``teacher`` cannot (empty when all can).
    ``student_flags``: each student role's architecture flags.

    Every criterion that reads only the teacher's output distribution runs with any seq2seq model
    (word-level and selective KD, live or from the cache; sequence-level KD decodes with its
    ``generate``). The feature methods read attention maps and hidden states through the adapter
    (:mod:`fairseq_kd.models.hf_teacher`), for the model types whose layer layout it is tested on;
    those comparing attention head by head (TinyBERT, MiniLM) also need the student's head counts
    to be the teacher's."""
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq_kd.models.hf_teacher import TESTED_MODEL_TYPES

    problems = []
    for method in methods:
        if not (method.uses_teacher or method.teacher_cache):
            continue  # no_kd, seq_kd: the teacher is not queried while the student trains
        criterion = CRITERION_REGISTRY[method.criterion]
        if getattr(criterion, "reads_output_only", lambda: False)():
            continue  # output distribution only
        if teacher.model_type not in TESTED_MODEL_TYPES:
            problems.append(f"{method.name} reads the teacher's attention maps or hidden states, which the adapter "
                            f"reads from {', '.join(TESTED_MODEL_TYPES)} models only (this one is "
                            f"{teacher.model_type})")
        elif needs_teacher_heads(method.criterion):
            student = architecture_heads(student_flags[method.student])
            if student != (teacher.encoder_heads, teacher.decoder_heads):
                problems.append(f"{method.name} compares attention head by head, but its student has {student[0]}+"
                                f"{student[1]} heads (encoder+decoder), the teacher {teacher.encoder_heads}+"
                                f"{teacher.decoder_heads}")
    return problems
