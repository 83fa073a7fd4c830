"""Export a fairseq Transformer translation checkpoint as a CTranslate2 model folder.

    fairseq-kd-export CKPT OUT --format ctranslate2 --quantization int8

In-process through CTranslate2's converter API, with fairseq's conventions (``add_source_eos``,
decoding from ``</s>``); the folder is written whole (:mod:`.model_folder`) with its record
(:data:`RECORD_NAME`). Design notes: ``docs/design/deploy.md``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ..checkpoints import task_state
from ..errors import InputError
from ..fingerprint import dictionary_sha256, fingerprint
from . import import_ctranslate2
from .layout import LayoutChecker, check_positions_decoder_and_widths, normformer_modules
from .model_folder import ExportFolder, read_export_record

#: CTranslate2's weight types (``ct2-*-converter --quantization``); the *_float16/bfloat16 ones
#: compute in that type on a GPU and fall back to what the CPU supports.
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                 "float32")
#: the int8 weight types, whose weights --int8-weight-bits rounds
INT8_QUANTIZATIONS = tuple(q for q in QUANTIZATIONS if q.startswith("int8"))
#: bits of an int8 weight: 7 (|q| <= 63) by default, 8 for CTranslate2's own rounding (|q| <= 127)
INT8_WEIGHT_BITS = (7, 8)
DEFAULT_INT8_WEIGHT_BITS = 7
RECORD_NAME = "fairseq_kd_export.json"
RECORD_FORMAT = "fairseq-kd-ctranslate2/1"

#: fairseq's --activation-fn values and CTranslate2's equivalents (by name: ``common_spec.Activation``)
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu_fast": "GELUTanh", "gelu_accurate": "GELUTanh",
                "swish": "SWISH"}


class CTranslate2ExportError(InputError):
    """The checkpoint, the data or the output folder cannot give a CTranslate2 model."""


@dataclass
class LoadedTransformer:
    """A checkpoint's model, built by fairseq, with the dictionaries it was checked against."""

    model: torch.nn.Module
    source_dictionary: object
    target_dictionary: object
    source_lang: str
    target_lang: str
    data: str
    activation_fn: str
    num_updates: int


def load_transformer(checkpoint: str, data: Optional[str] = None) -> LoadedTransformer:
    """Read ``checkpoint`` (weights only) and build its Transformer on the dictionaries of
    ``data`` (default: the data folder the checkpoint records), checking that they fit it."""
    from ..models.from_checkpoint import WeightsMismatchError, build_checkpoint_model

    state = _read_checkpoint(checkpoint)
    cfg = state["cfg"]
    task_cfg = cfg.get("task") or {}
    folder, flag = _data_folder(task_cfg, data)
    src, tgt, dictionaries = _data_dictionaries(task_cfg, folder, flag)
    _check_dictionaries_fit(state, dictionaries, flag)

    class _Dictionaries:  # what build_model reads of a translation task
        source_dictionary, target_dictionary = dictionaries

    try:
        model = build_checkpoint_model(state, _Dictionaries())
    except WeightsMismatchError as err:
        raise CTranslate2ExportError(f"{checkpoint!r}: weights do not fit its own config: {err}") from err
    model.eval()
    history = state.get("optimizer_history") or [{}]
    return LoadedTransformer(model, dictionaries[0], dictionaries[1], src, tgt, str(Path(folder).resolve()),
                             str(getattr(cfg.model, "activation_fn", None) or "relu"),
                             int(history[-1].get("num_updates", 0) or 0))


def _read_checkpoint(checkpoint: str) -> dict:
    """The checkpoint's state (:func:`fairseq_kd.models.from_checkpoint.read_transformer_checkpoint`),
    its errors worded for the export's CHECKPOINT."""
    from ..models.from_checkpoint import NoModelError, NotATransformerCheckpointError, read_transformer_checkpoint

    if os.path.isdir(checkpoint):
        raise CTranslate2ExportError(f"checkpoint {checkpoint!r} is a folder; give the checkpoint file "
                                     "(e.g. checkpoints/student/checkpoint_best.pt)")
    if not os.path.isfile(checkpoint):
        raise CTranslate2ExportError(f"checkpoint {checkpoint!r}: no such file")
    try:
        return read_transformer_checkpoint(checkpoint)
    except NoModelError:
        raise CTranslate2ExportError(f"{checkpoint!r} is not a fairseq training checkpoint (no cfg/model)") from None
    except NotATransformerCheckpointError as err:
        raise CTranslate2ExportError(f"{checkpoint!r} holds a {err.model_type!r} model; only fairseq's "
                                     "encoder-decoder Transformers can be exported to CTranslate2") from None


def _data_folder(task_cfg, data: Optional[str]) -> Tuple[str, str]:
    """The data folder whose dictionaries the model is built on (``--data``, else the one the
    checkpoint records) and how to name it in an error."""
    recorded = task_cfg.get("data")
    folder = data or (str(recorded).split(os.pathsep)[0] if recorded else None)
    flag = "--data" if data else f"the data folder the checkpoint records ({folder!r}; pass --data DIR)"
    if not folder or not os.path.isdir(folder):
        if data and os.path.isfile(data):
            raise CTranslate2ExportError(f"--data {data!r} is a file; give the binarised data folder holding "
                                         "dict.SRC.txt and dict.TGT.txt (fairseq-preprocess --destdir)")
        raise CTranslate2ExportError(
            f"{flag if data else 'the checkpoint'}: no data folder {folder!r} on this machine; pass --data DIR, "
            "the folder holding the dictionaries the model was trained with (dict.SRC.txt, dict.TGT.txt)")
    return folder, flag


def _data_dictionaries(task_cfg, folder: str, flag: str) -> Tuple[str, str, list]:
    """The language pair (recorded, else inferred from ``folder``'s files) and its two dictionaries."""
    from fairseq.data import Dictionary
    from fairseq.data.data_utils import infer_language_pair

    src, tgt = task_cfg.get("source_lang"), task_cfg.get("target_lang")
    if not src or not tgt:
        src, tgt = infer_language_pair(folder)
    if not src or not tgt:
        raise CTranslate2ExportError(f"{flag}: cannot tell the language pair (the checkpoint records none and "
                                     f"{folder} has no <split>.<src>-<tgt>.* files)")
    dictionaries = []
    for lang in (src, tgt):
        path = Path(folder) / f"dict.{lang}.txt"
        if not path.is_file():
            raise CTranslate2ExportError(f"{flag}: no dict.{lang}.txt in {folder}")
        dictionaries.append(Dictionary.load(str(path)))
    return src, tgt, dictionaries


def _check_dictionaries_fit(state: dict, dictionaries: list, flag: str) -> None:
    """The dictionaries fit the model's embeddings and the hashes the checkpoint records, if any."""
    for side, prefix, dictionary in (("source", "encoder", dictionaries[0]), ("target", "decoder", dictionaries[1])):
        weight = state["model"].get(f"{prefix}.embed_tokens.weight")
        if weight is not None and weight.size(0) != len(dictionary):
            raise CTranslate2ExportError(
                f"{flag}: its {side} dictionary has {len(dictionary)} symbols but the model's {side} embedding "
                f"{weight.size(0)}; give the data folder the model was trained on")
    binding = task_state(state).get("binding") or {}
    for side, dictionary in (("source", dictionaries[0]), ("target", dictionaries[1])):
        recorded_hash = binding.get(f"{side}_dictionary_sha256")
        if recorded_hash and recorded_hash != dictionary_sha256(dictionary):
            raise CTranslate2ExportError(
                f"{flag}: its {side} dictionary differs from the one the checkpoint was trained with "
                f"(sha256 {dictionary_sha256(dictionary)[:12]} vs {recorded_hash[:12]} recorded)")


def unsupported_features(loaded: LoadedTransformer) -> List[str]:
    """What this model has that CTranslate2's ``TransformerSpec`` cannot express (empty: exportable)."""
    encoder, decoder = loaded.model.encoder, loaded.model.decoder
    layers = list(encoder.layers) + list(decoder.layers)
    check = LayoutChecker()
    check(loaded.activation_fn not in _ACTIVATIONS,
          f"--activation-fn {loaded.activation_fn} (CTranslate2: {', '.join(_ACTIVATIONS)})")
    heads = {layer.self_attn.num_heads for layer in encoder.layers} | {
        attention.num_heads for layer in decoder.layers for attention in (layer.self_attn, layer.encoder_attn)}
    check(len(heads) > 1, f"attention heads differ between layers or between encoder and decoder ({sorted(heads)}); "
                          "CTranslate2 has one head count")
    pre_norm = {layer.normalize_before for layer in layers}
    check(len(pre_norm) > 1, "--encoder-normalize-before and --decoder-normalize-before differ")
    check(pre_norm == {True} and (encoder.layer_norm is None or decoder.layer_norm is None),
          "a pre-norm model without a final layer norm (--no-decoder-final-norm)")
    check((getattr(encoder, "layernorm_embedding", None) is None) != (getattr(decoder, "layernorm_embedding", None) is None),
          "--layernorm-embedding on one side only")
    check_positions_decoder_and_widths(check, encoder, decoder)
    normformer = normformer_modules(layers)
    check(normformer, f"NormFormer layers ({', '.join(normformer)}: --scale-attn/--scale-fc/--scale-heads/--scale-resids)")
    for side, dictionary in (("source", loaded.source_dictionary), ("target", loaded.target_dictionary)):
        check(len(set(dictionary.symbols)) != len(dictionary.symbols), f"the {side} dictionary repeats a symbol")
        check((dictionary.unk_word, dictionary.bos_word, dictionary.eos_word) != ("<unk>", "<s>", "</s>"),
              f"the {side} dictionary's special symbols are not <unk>, <s>, </s>")
    return check.problems


def ctranslate2_vocabulary(dictionary) -> List[str]:
    """A fairseq dictionary as CTranslate2's vocabulary, index for index (``<pad>`` is CTranslate2's
    ``<blank>``), as CTranslate2's fairseq converter registers it."""
    return ["<blank>" if symbol == "<pad>" else symbol for symbol in dictionary.symbols]


def build_spec(loaded: LoadedTransformer):
    """CTranslate2's ``TransformerSpec`` for ``loaded`` (call :func:`unsupported_features` first)."""
    import_ctranslate2()
    from ctranslate2.converters import fairseq as ct2_fairseq
    from ctranslate2.specs import common_spec, transformer_spec

    model = loaded.model
    encoder, decoder = model.encoder, model.decoder
    spec = transformer_spec.TransformerSpec.from_config(
        (len(encoder.layers), len(decoder.layers)), encoder.layers[0].self_attn.num_heads,
        pre_norm=bool(encoder.layers[0].normalize_before),
        activation=getattr(common_spec.Activation, _ACTIVATIONS[loaded.activation_fn]),
        layernorm_embedding=getattr(encoder, "layernorm_embedding", None) is not None)
    with torch.no_grad():
        ct2_fairseq.set_transformer_encoder(spec.encoder, encoder)
        ct2_fairseq.set_transformer_decoder(spec.decoder, decoder)
    spec.register_source_vocabulary(ctranslate2_vocabulary(loaded.source_dictionary))
    spec.register_target_vocabulary(ctranslate2_vocabulary(loaded.target_dictionary))
    # fairseq's translation conventions: every source ends with </s>, decoding starts from </s>
    spec.config.decoder_start_token = spec.config.eos_token
    spec.config.add_source_eos = True
    return spec


def round_int8_weights(spec, quantization: str, bits: int) -> None:
    """CTranslate2's ``ModelSpec.optimize`` (alias equal variables, then quantise), with every int8
    weight rounded to ``bits`` bits: ``q = rint(w * L / max|w_row|)``, scale ``L / max|w_row|``,
    ``L = 2**(bits-1) - 1``, one scale per output row (docs/design/deploy.md)."""
    from ctranslate2.specs.model_spec import Variable

    spec._alias_variables()
    levels = float(2 ** (bits - 1) - 1)  # the largest code: 63 for 7 bits, 127 for 8
    floats = {}

    def keep_float(layer, name, value):
        # a quantisable variable, as CTranslate2's _quantize tells it (the layer has a NAME_scale
        # slot); aliases are names, not variables
        key = name.split("/")[-1]
        if hasattr(layer, f"{key}_scale") and isinstance(value, Variable) and not value.is_scalar():
            floats[name] = value.to("float32").numpy().copy()

    if quantization in INT8_QUANTIZATIONS and bits != 8:
        spec._visit(keep_float)
    spec._quantize(quantization)
    if not floats:
        return
    import numpy as np
    from ctranslate2.specs.model_spec import NumpyVariable

    def requantize(layer, name, value):
        if name not in floats:
            return
        weight = floats[name].reshape(floats[name].shape[0], -1)
        amax = np.abs(weight).max(axis=1)
        amax[amax == 0] = levels  # an all-zero row: scale 1, codes 0 (CTranslate2's rule)
        scale = (np.float32(levels) / amax).astype(np.float32)
        codes = np.rint(weight * scale[:, None]).astype(np.int8).reshape(floats[name].shape)
        key = name.split("/")[-1]
        setattr(layer, key, NumpyVariable(codes))
        setattr(layer, f"{key}_scale", NumpyVariable(scale))

    spec._visit(requantize)


def export_ctranslate2(checkpoint: str, output: str, quantization: str = "int8", data: Optional[str] = None,
                       overwrite: bool = False, int8_weight_bits: Optional[int] = None) -> dict:
    """Write the CTranslate2 model folder ``output`` from ``checkpoint``; return a summary.

    ``int8_weight_bits`` (int8 quantisations only; default 7): see :func:`round_int8_weights`."""
    from .export_fairseq import count_parameters

    if quantization not in QUANTIZATIONS:
        raise CTranslate2ExportError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if int8_weight_bits is not None and quantization not in INT8_QUANTIZATIONS:
        raise CTranslate2ExportError(f"--int8-weight-bits applies to the int8 quantizations ({', '.join(INT8_QUANTIZATIONS)}), "
                                     f"not to --quantization {quantization}: drop it")
    if int8_weight_bits is not None and int8_weight_bits not in INT8_WEIGHT_BITS:
        raise CTranslate2ExportError(f"--int8-weight-bits {int8_weight_bits}: choose 7 or 8")
    if quantization in INT8_QUANTIZATIONS and int8_weight_bits is None:
        int8_weight_bits = DEFAULT_INT8_WEIGHT_BITS
    ct2 = import_ctranslate2()  # before any work: a missing extra is one line naming the fix
    output_folder = ExportFolder(checkpoint, output, overwrite, kind="CTranslate2", record_name=RECORD_NAME,
                                 record_format=RECORD_FORMAT, error=CTranslate2ExportError)
    out = output_folder.check()
    loaded = load_transformer(checkpoint, data)
    LayoutChecker(unsupported_features(loaded)).refuse(CTranslate2ExportError,
                                                       f"{checkpoint!r} cannot be expressed in CTranslate2")
    spec = build_spec(loaded)

    with output_folder.staged() as staging:
        # what CTranslate2's Converter.convert does (validate, optimize, save), with the int8
        # weights rounded to int8_weight_bits (round_int8_weights; other types as CTranslate2 does)
        spec.validate()
        round_int8_weights(spec, None if quantization == "float32" else quantization, int8_weight_bits or 8)
        staging.mkdir()
        spec.save(str(staging))
        record = {"format": RECORD_FORMAT, "checkpoint": str(Path(checkpoint).resolve()),
                  "checkpoint_sha256": fingerprint(Path(checkpoint))["sha256"], "num_updates": loaded.num_updates,
                  "quantization": quantization, "int8_weight_bits": int8_weight_bits,
                  "source_lang": loaded.source_lang, "target_lang": loaded.target_lang,
                  "source_dictionary_sha256": dictionary_sha256(loaded.source_dictionary),
                  "target_dictionary_sha256": dictionary_sha256(loaded.target_dictionary), "data": loaded.data,
                  "encoder_layers": len(loaded.model.encoder.layers),
                  "decoder_layers": len(loaded.model.decoder.layers),
                  "parameters": count_parameters(loaded.model.state_dict()),
                  "max_source_positions": int(loaded.model.max_positions()[0]),
                  "max_target_positions": int(loaded.model.max_positions()[1]),
                  "ctranslate2_version": ct2.__version__}
        output_folder.write_record(staging, record)
    return {"output": str(out), "format": "ctranslate2", "quantization": quantization,
            "int8_weight_bits": int8_weight_bits, "bytes": output_folder.size(),
            **{k: record[k] for k in ("parameters", "num_updates", "encoder_layers", "decoder_layers",
                                      "source_lang", "target_lang")}}


def read_record(model_dir: str) -> Optional[dict]:
    """The export record of a CTranslate2 folder written by :func:`export_ctranslate2` (None for a
    folder converted by other tools); ValueError naming the file when it is damaged."""
    return read_export_record(Path(model_dir), RECORD_NAME) if (Path(model_dir) / RECORD_NAME).is_file() else None


def dictionary_fits_vocabulary(dictionary, model_dir: str, side: str) -> Tuple[bool, str]:
    """Whether a fairseq dictionary is, index for index, the model folder's ``side`` vocabulary
    (``source``/``target``), read from CTranslate2's vocabulary files; and a reason if not."""
    from .ctranslate2_folder import read_vocabulary

    folder = Path(model_dir)
    for name in (f"{side}_vocabulary.json", "shared_vocabulary.json", f"{side}_vocabulary.txt",
                 "shared_vocabulary.txt"):
        path = folder / name
        if path.is_file():
            vocabulary = read_vocabulary(path)
            expected = ctranslate2_vocabulary(dictionary)
            if vocabulary == expected:
                return True, ""
            first = next((i for i, (a, b) in enumerate(zip(vocabulary, expected)) if a != b),
                         min(len(vocabulary), len(expected)))
            return False, (f"the model's {side} vocabulary ({path.name}, {len(vocabulary)} tokens) differs from the "
                           f"data's {side} dictionary ({len(expected)} symbols; first difference at index {first})")
    return False, f"{model_dir} has no {side} vocabulary file; is it a CTranslate2 translation model?"
