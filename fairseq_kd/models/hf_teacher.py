"""A Hugging Face seq2seq model as the frozen teacher of the output-distribution methods.

``--teacher-checkpoint DIR`` where ``DIR`` is a folder written by ``save_pretrained`` (recognised by
its ``config.json``) holding the model and its tokenizer: MarianMT (OPUS-MT), M2M100 and NLLB
(``model_type`` ``m2m_100``) are tested; another ``AutoModelForSeq2SeqLM`` text model whose forward
takes ``input_ids``, ``attention_mask`` and ``decoder_input_ids`` is accepted with a warning. It is
read offline (``local_files_only``; nothing is downloaded), safetensors first, pickled weights only
through ``weights_only=True``, no remote code. The data must be binarised in the teacher's
vocabulary (``fairseq-kd-hf-data``), whose dictionaries are checked symbol for symbol here.

:class:`HuggingFaceTeacherModel` speaks fairseq's model interface, so the criterions see the same
``(logits, extra)`` as from a fairseq teacher, over the data's dictionary:

* source: fairseq's ``src_tokens`` (left-padded by default) are re-padded on the right and mapped
  to Hugging Face ids, with the attention mask of the real tokens (Marian's positions count from
  the first slot, so left padding would shift them);
* target: fairseq's ``prev_output_tokens`` is ``</s>`` followed by the target; its first column
  becomes the model's ``decoder_start_token_id`` (Marian: ``<pad>``; M2M100/NLLB: ``</s>``), the
  rest is mapped id for id. M2M100/NLLB's target language tag is the first token of every target
  sentence in the binarised data (as Hugging Face's ``text_target`` tokenisation puts it in the
  labels), so the decoder reads ``</s> __en__ ...`` exactly as in Hugging Face training and the
  student learns to emit the tag first;
* logits: an ``index_select`` of the model's logits by :class:`.hf_vocabulary.VocabularyMap`
  (one fixed index in each direction). A fairseq symbol the teacher lacks (Marian's ``<s>``) gets a
  logit 10,000 below the position's lowest, probability exactly 0 in float32 at any temperature the
  loss uses, without the NaN that ``-inf`` gives in ``0 * log 0``.

Not yet supported with such a teacher (refused, naming the criterion): the feature methods
(attention maps and hidden states), the teacher cache and sequence-level KD.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import nn

from ..fingerprint import file_sha256
from .feature_capture import CapturedFeatures, CaptureRequest
from .hf_vocabulary import NO_ID, VocabularyError, VocabularyMap
from .teacher import FLAG, HF_CONFIG_FILE as CONFIG_FILE, FrozenTeacher, TeacherCheckpointError

logger = logging.getLogger(__name__)

#: model types whose adapter is tested (NLLB checkpoints are ``m2m_100``)
TESTED_MODEL_TYPES = ("marian", "m2m_100")
#: weight files, in the order they are preferred: safetensors, then pickles (read weights-only)
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: how far below a position's lowest logit a symbol the teacher lacks is put (see the docstring)
MISSING_SYMBOL_MARGIN = 1e4
INSTALL_HINT = "pip install 'fairseq-kd[hf]' (transformers>=5,<6 and sentencepiece)"


def folder_sha256(folder) -> str:
    """The content hash of a teacher folder: SHA-256 over the names and SHA-256 of its files (not
    recursive; what ``save_pretrained`` writes), so a moved copy binds as the same teacher."""
    import hashlib

    digest = hashlib.sha256()
    for child in sorted(Path(folder).iterdir()):
        if child.is_file():
            digest.update(f"{child.name}\0{file_sha256(child)}\n".encode())
    return digest.hexdigest()


def import_transformers():
    """transformers, or one line saying how to install it (the plugin imports it only here)."""
    try:
        import transformers
    except ImportError as err:
        raise TeacherCheckpointError(f"{FLAG}: a Hugging Face teacher needs transformers: {INSTALL_HINT} "
                                     f"({err})") from None
    return transformers


def refuse(folder, problem: str) -> TeacherCheckpointError:
    """The one-line refusal of a teacher folder."""
    return TeacherCheckpointError(f"{FLAG} {str(folder)!r}: {problem}")


# ------------------------------------------------------------------------------- reading a folder
def read_config(folder) -> dict:
    """``folder/config.json``, refusing a file that is not a model's JSON config."""
    try:
        with open(Path(folder) / CONFIG_FILE, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise refuse(folder, f"{CONFIG_FILE} is not readable JSON ({type(err).__name__}: {err}); "
                     "write the folder again with save_pretrained") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise refuse(folder, f"{CONFIG_FILE} names no model_type; it is not a Hugging Face model folder")
    return config


def model_class(transformers, folder, model_type: str):
    """The seq2seq LM class of ``model_type``, refusing one that is not a text encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, class_name, None) if class_name else None
    inputs = set(inspect.signature(cls.forward).parameters) if cls is not None else set()
    if cls is None or not {"input_ids", "attention_mask", "decoder_input_ids"} <= inputs:
        raise refuse(folder, f"model type {model_type!r} is not supported as a teacher: it is not a "
                     "text encoder-decoder (AutoModelForSeq2SeqLM); supported: MarianMT (marian), "
                     "M2M100 and NLLB (m2m_100)")
    if model_type not in TESTED_MODEL_TYPES:
        logger.warning(f"{FLAG} {folder}: model type {model_type!r} is read as a seq2seq LM "
                       f"({class_name}); only {', '.join(TESTED_MODEL_TYPES)} are tested")
    return cls


def prefers_safetensors(folder) -> bool:
    """True when the folder has safetensors weights, False for pickled ones only; refuses none."""
    names = {child.name for child in Path(folder).iterdir()}
    if names & set(SAFETENSORS_FILES):
        return True
    if names & set(PICKLE_FILES):
        return False
    raise refuse(folder, f"holds no weights ({' or '.join(SAFETENSORS_FILES + PICKLE_FILES)}); "
                 "save the model with save_pretrained")


def load_tokenizer(folder):
    """The folder's own tokenizer, offline."""
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - any failure means: this folder has no usable tokenizer
        raise refuse(folder, f"its tokenizer cannot be loaded offline ({type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''}); save the tokenizer with "
                     "save_pretrained into the same folder") from None


def load_model(folder, cls):
    """The folder's model (of class ``cls``) in eval mode, float32, on the CPU, offline and
    weights-only."""
    try:
        model = cls.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                    use_safetensors=prefers_safetensors(folder), weights_only=True,
                                    dtype=torch.float32)
    except TeacherCheckpointError:
        raise
    except pickle.UnpicklingError:
        raise refuse(folder, unsafe_weights_problem(folder)) from None
    except Exception as err:  # noqa: BLE001 - any failure means: these weights cannot be read
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise refuse(folder, f"its model cannot be loaded ({type(err).__name__}: {first_line})") from None
    return model.eval()


def unsafe_weights_problem(folder) -> str:
    """Why weights-only loading refused the folder's pickled weights, naming what they reference
    (read from the pickle's opcodes, never run); torch's own advice to load with
    ``weights_only=False`` is not repeated."""
    from ..checkpoints import refused_globals

    named = sorted({name for weights in sorted(Path(folder).glob("pytorch_model*.bin"))
                    for name in refused_globals(weights)})
    what = f"the class or function {', '.join(named[:5])}" if named else "an object that is not plain data"
    return (f"refusing to load its pickled weights: they contain {what}; unpickling it could run arbitrary "
            "code, so it was not loaded (weights_only=True). Save the model as safetensors with save_pretrained.")


def vocabulary_map(folder, tokenizer, config: dict) -> VocabularyMap:
    """The tokenizer's :class:`VocabularyMap`, refusing a vocabulary fairseq cannot hold."""
    if getattr(tokenizer, "separate_vocabs", False):
        raise refuse(folder, "a Marian model with separate source and target vocabularies is not yet "
                     "supported as a teacher")
    try:
        return VocabularyMap.from_tokenizer(tokenizer, int(config.get("vocab_size") or 0))
    except VocabularyError as err:
        raise refuse(folder, f"its tokenizer's vocabulary cannot be a fairseq dictionary: {err}") from None


# ------------------------------------------------------------------------------- the adapter
class HuggingFaceTeacherModel(nn.Module):
    """fairseq's model interface over a Hugging Face seq2seq LM (see the module docstring):
    ``forward(src_tokens, src_lengths, prev_output_tokens)`` gives ``(logits, {})`` with logits over
    the fairseq dictionary of ``vocabulary``."""

    def __init__(self, hf_model: nn.Module, vocabulary: VocabularyMap, fairseq_pad: int = 1):
        super().__init__()
        self.hf_model = hf_model
        self.vocabulary = vocabulary
        self.fairseq_pad = fairseq_pad
        self.decoder_start_token_id = hf_model.config.decoder_start_token_id
        hf_of_fairseq, _ = vocabulary.tensors()
        self.register_buffer("hf_of_fairseq", hf_of_fairseq, persistent=False)
        self.register_buffer("logit_index", hf_of_fairseq.clamp_min(0), persistent=False)
        self.register_buffer("lacks_symbol", hf_of_fairseq.eq(NO_ID), persistent=False)
        self.has_missing_symbols = bool(self.lacks_symbol.any())
        self.hf_pad = int(hf_of_fairseq[fairseq_pad])

    def max_positions(self) -> Tuple[Optional[int], Optional[int]]:
        limit = getattr(self.hf_model.config, "max_position_embeddings", None)
        return limit, limit

    def to_hf_ids(self, fairseq_tokens: torch.Tensor) -> torch.Tensor:
        """fairseq indices -> Hugging Face ids; refuses a symbol the teacher lacks."""
        hf_ids = self.hf_of_fairseq[fairseq_tokens]
        if self.has_missing_symbols and bool(hf_ids.eq(NO_ID).any()):
            raise ValueError("the batch holds a symbol the teacher's vocabulary lacks (fairseq's <s>: "
                             "do not use --prepend-bos with a Hugging Face teacher)")
        return hf_ids

    def encoder_inputs(self, src_tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` right-padded and ``attention_mask`` from fairseq's (left- or right-padded)
        source: a stable sort moves each row's real tokens to the front in their order."""
        is_pad = src_tokens.eq(self.fairseq_pad)
        order = torch.sort(is_pad.to(torch.int8), dim=1, stable=True).indices
        tokens = src_tokens.gather(1, order)
        real = ~is_pad.gather(1, order)
        input_ids = self.to_hf_ids(tokens).masked_fill(~real, self.hf_pad)
        return input_ids, real.long()

    def decoder_inputs(self, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        """``decoder_input_ids``: the model's start token, then the target shifted as fairseq's."""
        decoder_input_ids = self.to_hf_ids(prev_output_tokens)
        decoder_input_ids[:, 0] = self.decoder_start_token_id
        return decoder_input_ids

    def to_fairseq_logits(self, hf_logits: torch.Tensor) -> torch.Tensor:
        """The model's logits over the fairseq dictionary: one ``index_select``."""
        logits = hf_logits.index_select(-1, self.logit_index)
        if self.has_missing_symbols:
            floor = hf_logits.amin(-1, keepdim=True) - MISSING_SYMBOL_MARGIN
            logits = torch.where(self.lacks_symbol, floor, logits)
        return logits

    def forward(self, src_tokens, src_lengths=None, prev_output_tokens=None, **unused):
        input_ids, attention_mask = self.encoder_inputs(src_tokens)
        output = self.hf_model(input_ids=input_ids, attention_mask=attention_mask,
                               decoder_input_ids=self.decoder_inputs(prev_output_tokens), use_cache=False)
        return self.to_fairseq_logits(output.logits), {}


class HuggingFaceTeacher(FrozenTeacher):
    """A :class:`FrozenTeacher` whose model is a :class:`HuggingFaceTeacherModel`: the teacher's
    output distribution only (no features yet); bound to the student's run by :func:`folder_sha256`."""

    def __init__(self, model: HuggingFaceTeacherModel, path: str, sha256: Optional[str] = None):
        self.path = path
        self._sha256 = sha256
        self.model = model
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.shape = None  # no fairseq Transformer layout: feature methods are refused by the task

    @classmethod
    def load(cls, path: str, task, teacher_data: Optional[str] = None, sha256: Optional[str] = None):
        """Load the folder ``path`` for ``task``, whose dictionaries must be the teacher's
        vocabulary symbol for symbol; ``teacher_data`` (``--teacher-data``) is refused: the folder
        holds the vocabulary. Every refusal comes before the weights are read."""
        task_cfg = getattr(task, "cfg", None)
        if teacher_data or getattr(task_cfg, "teacher_data", None):
            raise refuse(path, "--teacher-data names a fairseq teacher's dictionaries; a Hugging Face folder "
                         "holds its own vocabulary: drop --teacher-data")
        config = read_config(path)
        cls_of_model = model_class(import_transformers(), path, config["model_type"])
        vocabulary = vocabulary_map(path, load_tokenizer(path), config)
        check_data_dictionaries(path, vocabulary, task.source_dictionary, task.target_dictionary)
        if getattr(task_cfg, "left_pad_target", False):
            raise refuse(path, "--left-pad-target is not supported with a Hugging Face teacher (its "
                         "decoder positions count from the first slot); drop it")
        model = load_model(path, cls_of_model)
        check_model_fits(path, model, vocabulary)
        logger.info(f"{FLAG} {path}: Hugging Face {model.config.model_type} teacher, "
                    f"{len(vocabulary)} symbols, dictionaries compared symbol for symbol")
        return cls(HuggingFaceTeacherModel(model, vocabulary, task.target_dictionary.pad()), path, sha256)

    @property
    def sha256(self) -> Optional[str]:
        if self._sha256 is None and self.path and os.path.isdir(self.path):
            self._sha256 = folder_sha256(self.path)
        return self._sha256

    def forward(self, net_input: dict, request: CaptureRequest) -> Tuple[tuple, CapturedFeatures]:
        if not request.is_empty:
            raise NotImplementedError("attention maps and hidden states of a Hugging Face teacher are not yet supported")
        with torch.no_grad():
            return self.model(**net_input), CapturedFeatures()


def check_model_fits(path, model, vocabulary: VocabularyMap) -> None:
    """The model starts its decoder somewhere and has a logit for every token of its tokenizer."""
    if model.config.decoder_start_token_id is None:
        raise refuse(path, f"{CONFIG_FILE} sets no decoder_start_token_id, so the decoder's first input is unknown")
    rows = model.get_output_embeddings().weight.size(0)
    if rows < vocabulary.hf_vocab_size:
        raise refuse(path, f"the model has {rows} output logits but its tokenizer {vocabulary.hf_vocab_size} "
                     "tokens; the model and tokenizer do not belong together")


def check_data_dictionaries(path, vocabulary: VocabularyMap, source_dictionary, target_dictionary) -> None:
    """The data's dictionaries must be the teacher's vocabulary, index for index."""
    for side, dictionary in (("source", source_dictionary), ("target", target_dictionary)):
        problem = vocabulary.mismatch(dictionary.symbols)
        if problem is not None:
            raise refuse(path, f"the data's {side} dictionary is not the teacher's vocabulary ({problem}); "
                         "binarise the data with fairseq-kd-hf-data --teacher "
                         f"{path}")
