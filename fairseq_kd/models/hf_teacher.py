"""A Hugging Face seq2seq model as the frozen teacher of every distillation method.

``--teacher-checkpoint DIR``: a ``save_pretrained`` folder (recognised by its ``config.json``) with
the model and its tokenizer (MarianMT, M2M100 and NLLB are tested), read offline and strictly
(:mod:`.hf_folder`); the data must be binarised in its vocabulary (``fairseq-kd-hf-data``).
:class:`HuggingFaceTeacherModel` speaks fairseq's model interface and
:class:`HuggingFaceFeatureCapture` gives :mod:`.feature_capture`'s features in the student's
positions. How ids, positions, padding and hidden states are mapped: ``docs/design/teachers.md``.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import pickle
from functools import partial
from pathlib import Path
from typing import Mapping, Optional, Tuple

import torch
from torch import nn

from ..errors import InputError, MissingDependencyError
from ..fingerprint import file_sha256
from . import hf_folder
from .feature_capture import (DECODER_CROSS, DECODER_SELF, ENCODER_SELF, CapturedFeatures, CaptureRequest,
                              FeatureCapture, NotATransformerError, attention_modules)
from .hf_vocabulary import NO_ID, VocabularyError, VocabularyMap, tokenizer_maps
from .shape import TransformerShape
from .dictionary_check import FLAG, TeacherCheckpointError, TeacherFileError, check_data_dictionaries
from .teacher import HF_CONFIG_FILE as CONFIG_FILE, FrozenTeacher, readable

logger = logging.getLogger(__name__)

#: model types whose adapter is tested (NLLB checkpoints are ``m2m_100``)
TESTED_MODEL_TYPES = ("marian", "m2m_100")
#: how far below a position's lowest logit a symbol the teacher lacks is put (docs/design/teachers.md)
MISSING_SYMBOL_MARGIN = 1e4
INSTALL_HINT = "pip install 'fairseq-kd[hf]' (transformers>=5,<6 and sentencepiece)"


def folder_sha256(folder, file_digests: Optional[Mapping[str, str]] = None) -> str:
    """SHA-256 over the names and SHA-256 of the folder's files (not recursive), so a moved copy binds
    as the same teacher; ``file_digests``: {file name: SHA-256} already taken, not read again."""
    digest = hashlib.sha256()
    for child in sorted(Path(folder).iterdir()):
        if child.is_file():
            sha256 = (file_digests or {}).get(child.name) or file_sha256(child)
            digest.update(f"{child.name}\0{sha256}\n".encode())
    return digest.hexdigest()


class TransformersMissingError(TeacherCheckpointError, MissingDependencyError):
    """A Hugging Face teacher is given but transformers is not installed."""


def import_transformers():
    """transformers, or one line saying how to install it (the plugin imports it only here)."""
    try:
        import transformers
    except ImportError as err:
        raise TransformersMissingError(f"{FLAG}: a Hugging Face teacher needs transformers: {INSTALL_HINT} "
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
        refusal = refuse(folder, f"{CONFIG_FILE} is not readable JSON ({type(err).__name__}: {err}); "
                         "write the folder again with save_pretrained")
        raise (TeacherFileError(str(refusal)) if isinstance(err, OSError) else refusal) from None
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
    names = {child.name for child in readable(lambda path: list(Path(path).iterdir()), folder)}
    if names & set(hf_folder.SAFETENSORS_FILES):
        return True
    if names & set(hf_folder.PICKLE_FILES):
        return False
    raise refuse(folder, f"holds no weights ({' or '.join(hf_folder.SAFETENSORS_FILES + hf_folder.PICKLE_FILES)}); "
                 "save the model with save_pretrained")


def load_tokenizer(folder):
    """The folder's own tokenizer, offline."""
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    # transformers and the libraries under it (tokenizers, sentencepiece, json, protobuf) raise no
    # common class for a folder's missing or damaged tokenizer files
    except Exception as err:  # noqa: BLE001
        raise refuse(folder, f"its tokenizer cannot be loaded offline ({type(err).__name__}: "
                     f"{hf_folder.first_line(err)}); save the tokenizer with "
                     "save_pretrained into the same folder") from None


def read_checked_config(folder):
    """``(config.json as a dict, the model class, its transformers config)`` once the weights' headers
    show the model the config describes (:mod:`.hf_folder`); nothing is allocated before."""
    config = read_config(folder)
    cls = model_class(import_transformers(), folder, config["model_type"])
    refusal = partial(refuse, folder)
    try:
        header = hf_folder.read_weights_header(folder, prefers_safetensors(folder), refusal)
    except pickle.UnpicklingError:
        raise refuse(folder, unsafe_weights_problem(folder)) from None
    try:
        with _quiet_transformers():  # its warnings about the ids checked below would precede the one line
            hf_config = cls.config_class.from_dict(config)
    # each config class validates its own values (ValueError, TypeError, AttributeError, KeyError, its
    # own classes): no common class
    except Exception as err:  # noqa: BLE001
        raise refuse(folder, f"{CONFIG_FILE} is not a valid {config['model_type']} config ({type(err).__name__}: "
                     f"{_first_lines(err)}); fix it or save the model again with save_pretrained") from None
    hf_folder.check_floating_point(header, refusal)
    hf_folder.check_config_fits_weights(hf_config, config, header, refusal)
    return config, cls, hf_config


def _first_lines(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else ""


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings, loading report and progress bar off stderr: the checks here say it in one line."""
    from transformers.utils import logging as transformers_logging

    library = logging.getLogger("transformers")
    level, progress_bar = library.level, transformers_logging.is_progress_bar_enabled()
    library.setLevel(logging.ERROR)
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        library.setLevel(level)
        if progress_bar:
            transformers_logging.enable_progress_bar()


def load_model(folder, cls, hf_config=None):
    """The folder's model in eval mode, float32, on the CPU, offline and weights-only; refused unless
    every tensor came from the folder and every value is finite (:mod:`.hf_folder`)."""
    extra = {} if hf_config is None else {"config": hf_config}
    use_safetensors = prefers_safetensors(folder)
    try:
        with _quiet_transformers():
            model, info = cls.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                              use_safetensors=use_safetensors, weights_only=True,
                                              dtype=torch.float32, output_loading_info=True,
                                              ignore_mismatched_sizes=True, **extra)
    except pickle.UnpicklingError:
        raise refuse(folder, unsafe_weights_problem(folder)) from None
    # from_pretrained builds the model class the config names and reads its weights through torch or
    # safetensors: their errors for a folder's damaged files have no common class
    except Exception as err:  # noqa: BLE001
        raise refuse(folder, f"its model cannot be loaded ({type(err).__name__}: {hf_folder.first_line(err)})"
                     ) from None
    hf_folder.check_loading_info(info, partial(refuse, folder))
    hf_folder.check_finite(model, partial(refuse, folder))
    return model.eval()


def unsafe_weights_problem(folder) -> str:
    """Why weights-only loading refused the folder's pickles, naming what they reference (read from
    the opcodes, never run); torch's advice to load with ``weights_only=False`` is not repeated."""
    from ..checkpoints import refused_globals

    named = sorted({name for weights in sorted(Path(folder).glob("pytorch_model*.bin"))
                    for name in refused_globals(weights)})
    what = f"the class or function {', '.join(named[:5])}" if named else "an object that is not plain data"
    return (f"refusing to load its pickled weights: they contain {what}; unpickling it could run arbitrary "
            "code, so it was not loaded (weights_only=True). Save the model as safetensors with save_pretrained.")


def vocabulary_maps(folder, tokenizer, config: dict) -> Tuple[VocabularyMap, VocabularyMap]:
    """``(source, target)`` :class:`VocabularyMap` (one object twice for one vocabulary), refusing a
    vocabulary fairseq cannot hold."""
    try:
        target_rows = 0 if config.get("share_encoder_decoder_embeddings", True) else config.get("decoder_vocab_size")
        return tokenizer_maps(tokenizer, int(config.get("vocab_size") or 0), int(target_rows or 0))
    except VocabularyError as err:
        raise refuse(folder, f"its tokenizer's vocabulary cannot be a fairseq dictionary: {err}") from None


def vocabulary_map(folder, tokenizer, config: dict) -> VocabularyMap:
    """The target side's :class:`VocabularyMap`: the map of the logits and of target ids."""
    return vocabulary_maps(folder, tokenizer, config)[1]


# ------------------------------------------------------------------------------- the adapter
class HuggingFaceTeacherModel(nn.Module):
    """fairseq's model interface over a Hugging Face seq2seq LM: ``(logits, {})`` over the fairseq
    dictionary of ``vocabulary`` (the target side's map); ``source_vocabulary`` maps the encoder's
    inputs (the same object for one vocabulary)."""

    def __init__(self, hf_model: nn.Module, vocabulary: VocabularyMap, fairseq_pad: int = 1,
                 source_vocabulary: Optional[VocabularyMap] = None):
        super().__init__()
        self.hf_model = hf_model
        self.vocabulary = vocabulary
        self.source_vocabulary = vocabulary if source_vocabulary is None else source_vocabulary
        self.fairseq_pad = fairseq_pad
        self.decoder_start_token_id = hf_model.config.decoder_start_token_id
        hf_of_fairseq = torch.tensor(vocabulary.hf_id_of_fairseq, dtype=torch.long)
        source_hf_of_fairseq = torch.tensor(self.source_vocabulary.hf_id_of_fairseq, dtype=torch.long)
        self.register_buffer("hf_of_fairseq", hf_of_fairseq, persistent=False)
        self.register_buffer("source_hf_of_fairseq", source_hf_of_fairseq, persistent=False)
        self.register_buffer("logit_index", hf_of_fairseq.clamp_min(0), persistent=False)
        self.register_buffer("lacks_symbol", hf_of_fairseq.eq(NO_ID), persistent=False)
        self.has_missing_symbols = bool(self.lacks_symbol.any())
        self.source_has_missing_symbols = bool(source_hf_of_fairseq.eq(NO_ID).any())
        self.hf_source_pad = int(source_hf_of_fairseq[fairseq_pad])
        self.active_capture: Optional["HuggingFaceFeatureCapture"] = None

    def max_positions(self) -> Tuple[Optional[int], Optional[int]]:
        limit = getattr(self.hf_model.config, "max_position_embeddings", None)
        return limit, limit

    def to_hf_ids(self, fairseq_tokens: torch.Tensor, source: bool = False) -> torch.Tensor:
        """fairseq indices -> Hugging Face ids of the target (or ``source``) side; refuses a symbol the
        teacher lacks."""
        table, missing = ((self.source_hf_of_fairseq, self.source_has_missing_symbols) if source
                          else (self.hf_of_fairseq, self.has_missing_symbols))
        hf_ids = table[fairseq_tokens]
        if missing and bool(hf_ids.eq(NO_ID).any()):
            raise InputError("the batch holds a symbol the teacher's vocabulary lacks (fairseq's <s>: "
                             "do not use --prepend-bos with a Hugging Face teacher)")
        return hf_ids

    def source_order(self, src_tokens: torch.Tensor) -> torch.Tensor:
        """``(batch, len)``: the fairseq position of each right-padded slot."""
        is_pad = src_tokens.eq(self.fairseq_pad)
        return torch.sort(is_pad.to(torch.int8), dim=1, stable=True).indices

    def encoder_inputs(self, src_tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids`` and ``attention_mask`` of fairseq's (left- or right-padded) source."""
        order = self.source_order(src_tokens)
        tokens = src_tokens.gather(1, order)
        real = tokens.ne(self.fairseq_pad)
        input_ids = self.to_hf_ids(tokens, source=True).masked_fill(~real, self.hf_source_pad)
        return input_ids, real.long()

    def decoder_inputs(self, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        """``decoder_input_ids``: the model's start token, then fairseq's shifted target."""
        decoder_input_ids = self.to_hf_ids(prev_output_tokens)
        decoder_input_ids[:, 0] = self.decoder_start_token_id
        return decoder_input_ids

    def to_fairseq_logits(self, hf_logits: torch.Tensor) -> torch.Tensor:
        logits = hf_logits.index_select(-1, self.logit_index)
        if self.has_missing_symbols:
            floor = hf_logits.amin(-1, keepdim=True) - MISSING_SYMBOL_MARGIN
            logits = torch.where(self.lacks_symbol, floor, logits)
        return logits

    def forward(self, src_tokens, src_lengths=None, prev_output_tokens=None, **unused):
        input_ids, attention_mask = self.encoder_inputs(src_tokens)
        capture = self.active_capture
        asked = capture.model_kwargs(prev_output_tokens) if capture is not None else {}
        output = self.hf_model(input_ids=input_ids, attention_mask=attention_mask,
                               decoder_input_ids=self.decoder_inputs(prev_output_tokens), use_cache=False, **asked)
        if capture is not None:
            capture.collect(output, src_tokens, prev_output_tokens)
        return self.to_fairseq_logits(output.logits), {}

    # ------------------------------------------------------------------ features
    def layer_stacks(self):
        """``(encoder, decoder)`` when they have fairseq's layer layout; else raises
        :class:`NotATransformerError` saying what is missing."""
        model = self.hf_model
        try:
            encoder, decoder = model.get_encoder(), model.get_decoder()
            for stack, attentions in ((encoder, ("self_attn",)), (decoder, ("self_attn", "encoder_attn"))):
                if len(stack.layers) == 0:
                    raise NotATransformerError("the model has an empty encoder or decoder")
                for layer in stack.layers:
                    for name in attentions:
                        attention = getattr(layer, name)
                        for needed in ("num_heads", "head_dim", "scaling", "q_proj", "k_proj", "v_proj"):
                            getattr(attention, needed)
        except (AttributeError, TypeError) as err:
            raise NotATransformerError(
                f"the {type(model).__name__} model does not have the layer layout whose attention and hidden "
                f"states the adapter reads (encoder/decoder .layers[i].self_attn, .encoder_attn): {err}") from None
        return encoder, decoder

    def transformer_shape(self) -> TransformerShape:
        encoder, decoder = self.layer_stacks()
        d_model = int(self.hf_model.config.d_model)
        return TransformerShape(
            encoder_layers=len(encoder.layers), decoder_layers=len(decoder.layers),
            encoder_heads=encoder.layers[0].self_attn.num_heads, decoder_heads=decoder.layers[0].self_attn.num_heads,
            cross_heads=decoder.layers[0].encoder_attn.num_heads, encoder_embed_dim=d_model, decoder_embed_dim=d_model,
        )

    @property
    def capture_class(self):  # what FeatureCapture(model, request) builds
        return HuggingFaceFeatureCapture


def _split_heads(projected: torch.Tensor, heads: int) -> torch.Tensor:
    """``(batch, len, heads * d)`` -> ``(batch, heads, len, d)``."""
    return projected.view(*projected.shape[:2], heads, -1).transpose(1, 2)


class HuggingFaceFeatureCapture(FeatureCapture):
    """The capture of a :class:`HuggingFaceTeacherModel`: the model's own ``output_attentions`` (eager
    path) and ``output_hidden_states``, hooks only for what they lack (``q/k/v_proj`` outputs, the top
    layer's output before a final layer norm); docs/design/teachers.md."""

    def __init__(self, model: HuggingFaceTeacherModel, request: CaptureRequest):
        super().__init__(model, request)
        self._top_outputs: dict = {}  # "encoder"/"decoder" -> the top layer's output
        self._output = self._masks_of = self._slot = None  # what the forward pass left

    def _hook_attention(self, kind: str, index: int, module: nn.Module) -> None:
        keys = (("q", "k") if self.request.attention_scores else ()) + (("v",) if self.request.attention_values else ())
        for key in keys:
            self._keep(getattr(module, f"{key}_proj"), self._records.setdefault((kind, index), {}), key)

    def _install(self) -> None:
        encoder, decoder = self.model.layer_stacks()
        for side, stack, wanted in (("encoder", encoder, self.request.encoder_hidden),
                                    ("decoder", decoder, self.request.decoder_hidden)):
            if wanted and isinstance(getattr(stack, "layer_norm", None), nn.Module):
                # Hugging Face's hidden_states[n] is after this final layer norm; fairseq's is before
                self._keep(stack.layers[-1], self._top_outputs, side)
        if self.request.attention_kinds:
            # only the eager path returns the attention weights (sdpa returns none)
            configs = {id(m.config): m.config for m in self.model.hf_model.modules()
                       if hasattr(getattr(m, "config", None), "_attn_implementation")}
            for config in configs.values():
                self.assign(config, "_attn_implementation", "eager")
        self.assign(self.model, "active_capture", self)

    def _keep(self, module: nn.Module, store: dict, key) -> None:
        """``store[key]``: ``module``'s output (its first element when a tuple)."""
        def hook(module, args, output):
            store[key] = output[0] if isinstance(output, tuple) else output
        self.hook(module, hook)

    def model_kwargs(self, prev_output_tokens: torch.Tensor) -> dict:
        """What the Hugging Face model is asked for; the decoder's padded keys are masked as fairseq
        masks them (only padded query rows change: no loss reads them)."""
        request = self.request
        kwargs = {"decoder_attention_mask": prev_output_tokens.ne(self.model.fairseq_pad).long()}
        if request.attention_kinds:
            kwargs["output_attentions"] = True
        if request.encoder_hidden or request.decoder_hidden:
            kwargs["output_hidden_states"] = True
        return kwargs

    def collect(self, output, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor) -> None:
        pad = self.model.fairseq_pad
        self._output, self._masks_of = output, (src_tokens.eq(pad), prev_output_tokens.eq(pad))
        # slot of each fairseq position in the right-padded source
        self._slot = self.model.source_order(src_tokens).argsort(1)

    def _masks(self) -> Optional[CapturedFeatures]:
        if self._output is None:
            return None
        source, target = self._masks_of
        return CapturedFeatures(source_padding_mask=source, target_padding_mask=target)

    def _hidden(self, side: str, features: CapturedFeatures) -> torch.Tensor:
        """Hugging Face's states, the top one before a final layer norm, the source's in fairseq's positions."""
        states = list(getattr(self._output, f"{side}_hidden_states"))
        if side in self._top_outputs:
            states[-1] = self._top_outputs[side]
        states = torch.stack(states, 0)
        if side == "encoder":
            states = states.gather(2, self._slot[None, :, :, None].expand_as(states))
        # fairseq's embedding output is 0 at padded positions (the encoder zeroes them; the decoder's
        # pad embedding and pad position are 0); Hugging Face's position embeddings are not
        states[0] = states[0].masked_fill(features.padding_mask(side)[..., None], 0.0)
        return states

    def _maps(self, kind: str, indices: Tuple[int, ...], features: CapturedFeatures) -> tuple:
        per_layer = getattr(self._output, {ENCODER_SELF: "encoder_attentions", DECODER_SELF: "decoder_attentions",
                                           DECODER_CROSS: "cross_attentions"}[kind])
        if not per_layer:
            raise RuntimeError(f"the Hugging Face model returned no {kind} attention weights")
        # Hugging Face returns every layer's maps; the request's selection keeps some of them
        probs = torch.stack([per_layer[i] for i in indices], 0).float()  # (layers, batch, heads, query, key)
        num_layers, bsz, num_heads, tq, tk = probs.shape
        source_queries, source_keys = kind == ENCODER_SELF, kind in (ENCODER_SELF, DECODER_CROSS)
        probs = self._to_fairseq_positions(probs, source_queries, source_keys)
        future = torch.ones(tq, tk, dtype=torch.bool, device=probs.device).triu(1) if kind == DECODER_SELF else None
        scores = values = None
        if self.request.attention_scores:
            modules = attention_modules(self.model, kind)
            scores = torch.stack([
                _split_heads(self._records[kind, i]["q"], num_heads)
                @ _split_heads(self._records[kind, i]["k"], num_heads).transpose(-1, -2) * modules[i].scaling
                for i in indices], 0)
            scores = self._to_fairseq_positions(scores, source_queries, source_keys)
        if self.request.attention_values:
            values = torch.stack([_split_heads(self._records[kind, i]["v"], num_heads) for i in indices], 0)
            if source_keys:  # (layers, batch, heads, key, d_head): the key axis is the source's
                values = values.gather(3, self._slot[None, :, None, :, None].expand_as(values))
        return probs, future, scores, values

    def _to_fairseq_positions(self, maps: torch.Tensor, queries: bool, keys: bool) -> torch.Tensor:
        """``(layers, batch, heads, query, key)`` maps with source axes put back in fairseq's positions."""
        slot = self._slot
        if queries:
            maps = maps.gather(3, slot[None, :, None, :, None].expand_as(maps))
        if keys:
            maps = maps.gather(4, slot[None, :, None, None, :].expand_as(maps))
        return maps


class HuggingFaceTeacher(FrozenTeacher):
    """A :class:`FrozenTeacher` over a :class:`HuggingFaceTeacherModel`, bound to the run by
    :func:`folder_sha256`; ``shape`` is None, with ``feature_problem`` saying why, when the model lacks
    fairseq's layer layout (then only output-distribution methods can use it)."""

    def read_shape(self) -> Optional[TransformerShape]:
        try:
            return self.model.transformer_shape()
        except NotATransformerError as err:
            self.feature_problem = str(err)
            return None

    @classmethod
    def load(cls, path: str, task, teacher_data: Optional[str] = None, sha256: Optional[str] = None):
        """Load the folder ``path`` for ``task``, whose dictionaries must be the teacher's vocabulary;
        ``teacher_data`` is refused. Every refusal comes before the weights are read."""
        task_cfg = getattr(task, "cfg", None)
        if teacher_data or getattr(task_cfg, "teacher_data", None):
            raise refuse(path, "--teacher-data names a fairseq teacher's dictionaries; a Hugging Face folder "
                         "holds its own vocabulary: drop --teacher-data")
        config, cls_of_model, hf_config = read_checked_config(path)
        source_vocabulary, vocabulary = vocabulary_maps(path, load_tokenizer(path), config)
        check_data_dictionaries(path, vocabulary, task.source_dictionary, task.target_dictionary,
                                source_vocabulary=source_vocabulary)
        if getattr(task_cfg, "left_pad_target", False):
            raise refuse(path, "--left-pad-target is not supported with a Hugging Face teacher (its "
                         "decoder positions count from the first slot); drop it")
        model = load_model(path, cls_of_model, hf_config)
        check_model_fits(path, model, vocabulary, source_vocabulary=source_vocabulary)
        symbols = (f"{len(vocabulary)} symbols" if source_vocabulary is vocabulary else
                   f"{len(source_vocabulary)} source and {len(vocabulary)} target symbols")
        logger.info(f"{FLAG} {path}: Hugging Face {model.config.model_type} teacher, "
                    f"{symbols}, dictionaries compared symbol for symbol")
        return cls(HuggingFaceTeacherModel(model, vocabulary, task.target_dictionary.pad(),
                                           source_vocabulary=source_vocabulary), path, sha256)

    @property
    def sha256(self) -> Optional[str]:
        if self._sha256 is None and self.path and os.path.isdir(self.path):
            self._sha256 = readable(folder_sha256, self.path)
        return self._sha256


def check_model_fits(path, model, vocabulary: VocabularyMap, source_vocabulary: VocabularyMap) -> None:
    """The model has a decoder start, a logit for every target token and an encoder input embedding
    for every source token."""
    separate = source_vocabulary is not vocabulary
    if model.config.decoder_start_token_id is None:
        raise refuse(path, f"{CONFIG_FILE} sets no decoder_start_token_id, so the decoder's first input is unknown")
    rows = model.get_output_embeddings().weight.size(0)
    if rows < vocabulary.hf_vocab_size:
        raise refuse(path, f"the model has {rows} output logits but its tokenizer"
                     f"{' target vocabulary' if separate else ''} {vocabulary.hf_vocab_size} tokens; the model "
                     "and tokenizer do not belong together")
    try:  # the encoder's (Marian with separate vocabularies: not the decoder's)
        rows = model.get_input_embeddings().weight.size(0)
    except (AttributeError, NotImplementedError):  # a model that does not say: its forward pass will
        return
    if rows < source_vocabulary.hf_vocab_size:
        raise refuse(path, f"the model's encoder has {rows} input embeddings but its tokenizer"
                     f"{' source vocabulary' if separate else ''} {source_vocabulary.hf_vocab_size} tokens; the "
                     "model and tokenizer do not belong together")
