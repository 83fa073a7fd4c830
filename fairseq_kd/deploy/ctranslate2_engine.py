"""Decoding fairseq-binarised data with a CTranslate2 model: token ids in, token ids out.

One engine for ``fairseq-kd-translate``, ``fairseq-kd-seqkd --engine ctranslate2`` and the deploy
benchmark. It is given fairseq's own batches and applies fairseq-generate's rules, so that a
CTranslate2 model decodes what ``fairseq-generate`` would (beam search may differ on near-ties).
Design notes: ``docs/design/deploy.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from ..errors import InputError
from . import import_ctranslate2
from .ctranslate2_folder import (DamagedFolderError, check_ctranslate2_folder, looks_like_ctranslate2_folder,
                                 reexport_advice)
from .export_ctranslate2 import ctranslate2_vocabulary, dictionary_fits_vocabulary, read_record

#: where CTranslate2 may run
DEVICES = ("cpu", "cuda", "auto")
#: CTranslate2's compute types (``default``: the type the model was saved in, or the nearest the
#: device supports)
COMPUTE_TYPES = ("default", "auto", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                 "float16", "bfloat16", "float32")


class CTranslate2ModelError(InputError):
    """The CTranslate2 model folder cannot decode this data."""


@dataclass(frozen=True)
class DecodingSettings:
    """fairseq-generate's search settings (same names, same defaults)."""

    beam: int = 5
    lenpen: float = 1.0
    max_len_a: float = 0.0
    max_len_b: int = 200
    min_len: int = 1
    nbest: int = 1  # hypotheses per source, sentence by sentence in the engine's order


def fairseq_length_limit(longest_source: int, settings: DecodingSettings,
                         max_target_positions: Optional[int]) -> int:
    """fairseq's ``SequenceGenerator`` limit (tokens before ``</s>``) for a batch whose longest
    source (with ``</s>``) has ``longest_source`` tokens, capped by the model's target positions
    minus one when known; every engine decodes within it."""
    limit = int(settings.max_len_a * longest_source + settings.max_len_b)
    if max_target_positions:
        limit = min(limit, int(max_target_positions) - 1)
    return limit


@dataclass
class Hypothesis:
    tokens: List[int]  # target dictionary ids, ending with </s>
    score: float  # CTranslate2's length-normalised log-probability (natural log)


class CTranslate2Engine:
    """A CTranslate2 ``Translator`` over a model folder, bound to the data's dictionaries."""

    def __init__(self, model_dir: str, source_dictionary, target_dictionary, device: str = "cpu",
                 threads: int = 0, compute_type: str = "default", flag: str = "--model", device_index: int = 0):
        """``device_index``: the GPU (among the visible ones) with ``device="cuda"``: a teacher-pass
        rank decodes on its own GPU, as the fairseq engine does (teacher_pass.common.pick_device)."""
        ctranslate2 = import_ctranslate2()
        folder = Path(model_dir)
        if folder.is_file():
            raise CTranslate2ModelError(f"{flag} {model_dir!r} is a file; give a CTranslate2 model folder "
                                        "(fairseq-kd-export CKPT OUT --format ctranslate2)")
        if not folder.is_dir() or not looks_like_ctranslate2_folder(folder):
            raise CTranslate2ModelError(f"{flag} {model_dir!r}: no CTranslate2 model there (no model.bin); "
                                        "make one with fairseq-kd-export CKPT OUT --format ctranslate2")
        try:
            check_ctranslate2_folder(folder)
        except DamagedFolderError as err:
            raise CTranslate2ModelError(f"{flag}: {err}; {reexport_advice(folder)}") from None
        if device not in DEVICES:
            raise CTranslate2ModelError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
        if compute_type not in COMPUTE_TYPES:
            raise CTranslate2ModelError(f"--compute-type {compute_type!r}: choose one of {', '.join(COMPUTE_TYPES)}")
        if threads < 0:
            raise CTranslate2ModelError(f"--threads must be >= 0 (0: CTranslate2's default), got {threads}")
        for side, dictionary in (("source", source_dictionary), ("target", target_dictionary)):
            fits, why = dictionary_fits_vocabulary(dictionary, model_dir, side)
            if not fits:
                raise CTranslate2ModelError(f"{flag} {model_dir}: {why}; decode data binarised with the model's "
                                            "dictionaries")
        self.record = read_record(model_dir) or {}
        self.source_symbols = ctranslate2_vocabulary(source_dictionary)
        self.target_index = {symbol: i for i, symbol in enumerate(ctranslate2_vocabulary(target_dictionary))}
        self.source_eos = source_dictionary.eos()
        self.target_eos = target_dictionary.eos()
        self.max_target_positions = self.record.get("max_target_positions")
        # N threads on the CPU are N workers of one thread each (docs/design/deploy.md)
        self.workers = threads if threads > 1 and device == "cpu" else 1
        try:
            self.translator = ctranslate2.Translator(
                str(folder), device=device, device_index=device_index, compute_type=compute_type,
                inter_threads=self.workers, intra_threads=1 if self.workers > 1 else threads)
        except (RuntimeError, ValueError, LookupError, UnicodeDecodeError) as err:
            # what check_ctranslate2_folder cannot see in a folder without a record of its files (a
            # variable the spec lacks: IndexError; an unknown spec: RuntimeError)
            words = str(err).splitlines()[0] if not isinstance(err, UnicodeDecodeError) else "a damaged name"
            raise CTranslate2ModelError(f"{flag} {model_dir!r}: CTranslate2 cannot load this model ({words}); "
                                        f"if the folder is damaged, {reexport_advice(folder)}") from None

    def source_tokens(self, ids: Sequence[int]) -> List[str]:
        ids = list(ids)
        if ids and ids[-1] == self.source_eos:
            ids = ids[:-1]  # CTranslate2 appends </s> itself (add_source_eos)
        return [self.source_symbols[i] for i in ids]

    def translate(self, sources: Sequence[Sequence[int]], settings: DecodingSettings,
                  longest_source: int) -> List[Hypothesis]:
        """Decode one fairseq batch of source id sequences (each ending with ``</s>``; the longest
        has ``longest_source`` tokens): ``settings.nbest`` hypotheses per source."""
        if not sources:
            return []
        limit = fairseq_length_limit(longest_source, settings, self.max_target_positions)
        results = self.translator.translate_batch(
            [self.source_tokens(s) for s in sources], beam_size=settings.beam, length_penalty=settings.lenpen,
            max_decoding_length=limit, min_decoding_length=settings.min_len, return_scores=True,
            num_hypotheses=settings.nbest, max_batch_size=-(-len(sources) // self.workers) if self.workers > 1 else 0)
        hypotheses = []
        for result in results:
            for words, score in zip(result.hypotheses[:settings.nbest], result.scores):
                ids = [self.target_index[word] for word in words if word != "</s>"][:limit]
                hypotheses.append(Hypothesis(ids + [self.target_eos], float(score)))
        return hypotheses
